"""Probe (issue 26, not shipped): time VSA fine variants on the same inputs at the released geometry."""
import json, os, sys, time, traceback
import torch
sys.path.insert(0, os.path.dirname(__file__))
from bench_common import cuda_time, rel_err
from h3render.kernels.vsa import select_tiles, tile_plan, topk_budget, vsa_attention_naive
from h3render.kernels.vsa.naive import coarse_attention_naive, tile_scores
from h3render.kernels.vsa.triton_impl import fine_attention_triton, pool_tiles_triton, tuned_fine_config
from h3render.kernels.vsa.triton_hopper import fine_attention_hopper, pair_union
from h3render.kernels.vsa.tiles import gather_tiles, to_tiles

OUT = os.environ.get("OUT", "/tmp")
rows = []
def rec(**r):
    rows.append(r); print(json.dumps(r), flush=True)
    json.dump(rows, open(f"{OUT}/probe{'_ws' if len(sys.argv) > 1 else ''}.json", "w"), indent=1)

s = 0.9
plan = tile_plan((300, 810), (72, 24, 42), "cuda")
heads, dim, n = 56, 128, plan.num_tiles
kk = topk_budget(s, plan.num_video)
P, V = plan.num_prefix, plan.num_video
blocks = P * n + V * (P + kk)  # 64x64 blocks per head
flop = 4 * 64 * 64 * dim * blocks * heads
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, gate = (torch.randn(plan.seq_len, heads, dim, device="cuda", generator=g).bfloat16() for _ in range(4))
scores = tile_scores(pool_tiles_triton(q, plan), pool_tiles_triton(k, plan))
sel = select_tiles(scores, plan, s)
coarse = coarse_attention_naive(scores, pool_tiles_triton(v, plan))
sub = slice(0, 4)
t0 = time.time()
ref = vsa_attention_naive(*(x[:, sub].contiguous() for x in (q, k, v, gate)), plan, s)
rec(what="setup", blocks_per_head=blocks, tflop=flop / 1e12, ref_s=round(time.time() - t0, 1),
    gpu=torch.cuda.get_device_name(), triton=__import__("triton").__version__, torch=torch.__version__)

keys, bits, count = pair_union(sel)
cf = count.float()
rec(what="pair union size, random data", k=kk, mean=cf.mean().item(), min=cf.min().item(), max=cf.max().item())
sel_shared = sel.clone(); sel_shared[:, 1::2] = sel[:, 0::2][:, : sel[:, 1::2].shape[1]]
sel_hot = (P + (sel - P) % 128).sort(-1).values.to(torch.int32).contiguous()
rec(what="to_tiles k+v (old: zero fill + index_copy_)", s=round(cuda_time(lambda: (to_tiles(k, plan), to_tiles(v, plan)), reps=5), 5))
rec(what="gather_tiles k+v (index_select)", s=round(cuda_time(lambda: (gather_tiles(k, plan), gather_tiles(v, plan)), reps=5), 5))
idx = plan.row_of_slot.clamp(min=0).long()
rec(what="k[idx] + v[idx]", s=round(cuda_time(lambda: (k[idx], v[idx]), reps=5), 5))
rec(what="pair_union", s=round(cuda_time(lambda: pair_union(sel), reps=5), 5))

def run(label, fn, check=True):
    try:
        t = cuda_time(fn, reps=5, warm=2)
        r = dict(what=label, s=round(t, 5), tflops=round(flop / t / 1e12, 1))
        if check:
            r["rel_err"] = rel_err(fn()[:, sub], ref)
        rec(**r)
    except Exception as e:
        rec(what=label, error=f"{type(e).__name__}: {str(e)[-400:]}")

T = lambda **kw: (lambda: fine_attention_triton(q, k, v, plan, kw.pop("sel_", sel), gate, coarse, **kw))
H = lambda sel_=sel, **kw: (lambda: fine_attention_hopper(q, k, v, plan, sel_, gate, coarse, **kw))
WS = len(sys.argv) > 1 and sys.argv[1] == "ws"
if not WS:
    run("base autotuned", T())
    rec(what="base picked", cfg=tuned_fine_config())
    run("base 4w/3s", T(num_warps=4, num_stages=3))
    run("base 4w/3s hot sel (128 tiles/head)", T(sel_=sel_hot, num_warps=4, num_stages=3), check=False)
    for st in (2, 3, 4):
        run(f"tma qt1 4w/{st}s", H(num_warps=4, num_stages=st))
    run("tma qt1 4w/3s hot sel", H(sel_hot, num_warps=4, num_stages=3), check=False)
    run("tma qt1 4w/3s kv_once (math only)", H(num_warps=4, num_stages=3, _kv_once=True), check=False)
    for st in (2, 3):
        run(f"tma qt2 8w/{st}s random", H(query_tiles=2, num_warps=8, num_stages=st))
        run(f"tma qt2 8w/{st}s shared sel", H(sel_shared, query_tiles=2, num_warps=8, num_stages=st), check=False)
    run("tma qt2 8w/2s kv_once shared (math only)", H(sel_shared, query_tiles=2, num_warps=8, num_stages=2, _kv_once=True), check=False)
    run("pair_union alone", lambda: pair_union(sel_shared), check=False)
else:
    run("tma qt2 8w/2s ws shared", H(sel_shared, query_tiles=2, num_warps=8, num_stages=2, warp_specialize=True), check=False)
    run("tma qt2 8w/2s ws random", H(query_tiles=2, num_warps=8, num_stages=2, warp_specialize=True))
    run("tma qt1 4w/3s ws", H(num_warps=4, num_stages=3, warp_specialize=True))
