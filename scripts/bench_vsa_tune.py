"""The VSA TMA fine kernel's launch settings with their register budgets at the released geometry (issue 26,
`--stages vsa-tune`).

Each of --vsa-tune-canvases (default 1344x768x243: S = 73,686, 56 heads x 128, 1,206 tiles; and 960x544x124),
s = --vsa-sparsity, random bf16 q/k/v/gate (seed 0), kept sets from their tile scores; the TMA kernel
(`triton_hopper`) with the gate, int8 and bf16 QK^T. One row per launch setting (4 warps x --vsa-tune-stages x no cap
and each of --vsa-tune-maxnreg) and program order (head by head, or the dense query tiles first:
`triton_impl.program_tile`): seconds (median of 5), effective TFLOP/s,
rel. error of the whole layer on 4 heads against the torch reference, and the compiled kernel's registers, spilled
registers and shared memory, which decide how many programs share a multiprocessor (65,536 registers, 228 KB).
Before those, per canvas, the coarse stage's rows (`_coarse`, with the prep pass's: `_prep`); `--vsa-tune-stages ""`
runs only them.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def run(args, bench) -> None:
    for canvas in args.vsa_tune_canvases.split(","):
        _coarse(args, bench, bench.parse_canvas(canvas))
    for canvas in args.vsa_tune_canvases.split(",") if args.vsa_tune_stages else ():  # "": the coarse rows only
        _canvas(args, bench, bench.parse_canvas(canvas))


def _coarse(args, bench, canvas: tuple[int, int, int]) -> None:
    """The coarse stage's pieces at one canvas: the kept-set selection (torch topk + sort, the Triton radix search,
    the Triton interpolation search; each set checked equal to torch's), the pool kernel per heads a program, and the
    coarse output GEMM in fp32 and TF32 (rel. error of the TF32 one against fp32, and after the bf16 rounding the
    layer applies)."""
    from h3render.kernels.vsa import select_tiles, topk_budget
    from h3render.kernels.vsa.naive import coarse_attention_naive
    from h3render.kernels.vsa.select_triton import select_tiles_triton
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton

    case = bench.released_vsa_case(args.vsa_sparsity, canvas)
    plan, scores = case.plan, case.scores
    where = "x".join(map(str, canvas))
    k = topk_budget(args.vsa_sparsity, plan.num_video)
    ref = select_tiles(scores, plan, args.vsa_sparsity, use_triton=False)
    rows = [("torch topk + sort", lambda: select_tiles(scores, plan, args.vsa_sparsity, use_triton=False))]
    for search in ("radix", "interpolate"):
        rows.append((f"Triton {search}, autotuned",
                     lambda search=search: select_tiles_triton(scores, plan.num_prefix, k, search=search)))
        for warps in (1, 2, 4):
            rows.append((f"Triton {search}, {warps} warps", lambda search=search, warps=warps: select_tiles_triton(
                scores, plan.num_prefix, k, search=search, num_warps=warps)))
    for label, fn in rows:
        t = bench.cuda_time(fn, reps=20, warm=3)
        bench.rec(stage="vsa-tune", what=f"VSA selection {where} k={k}: {label}", ours_s=round(t, 6),
                  same_set=bool(torch.equal(fn(), ref)))
    v_pooled = pool_tiles_triton(case.v, plan, heads_per_program=1)
    for hb in (1, 2, 4, 8, None):
        fn = lambda hb=hb: pool_tiles_triton(case.v, plan, heads_per_program=hb)  # noqa: E731
        t = bench.cuda_time(fn, reps=20, warm=3)
        bench.rec(stage="vsa-tune", what=f"VSA pool {where}: {hb or 'POOL_HEADS'} head(s) a program",
                  ours_s=round(t, 6), max_abs_vs_1=float((fn() - v_pooled).abs().max()))
    exact = coarse_attention_naive(scores, v_pooled)
    previous = torch.backends.cuda.matmul.allow_tf32
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            t = bench.cuda_time(lambda: coarse_attention_naive(scores, v_pooled), reps=20, warm=3)
            out = coarse_attention_naive(scores, v_pooled)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        bench.rec(stage="vsa-tune", what=f"VSA coarse softmax @ v̄ {where} ({'TF32' if tf32 else 'fp32'})",
                  ours_s=round(t, 6), rel_err=bench.rel_err(out, exact),
                  rel_err_bf16=bench.rel_err(out.bfloat16(), exact.bfloat16()))
    _prep(bench, canvas, where)


# `vsa_prep` launch settings the bench times: (rows, heads, warps, pipeline stages); None = the module's default
# (`prep_triton.ROWS, BLOCK_H, NUM_WARPS, STAGES`). All keep >= 8 elements a thread at H = 56, D = 128, the layout
# under which q and k are `qk_norm_rope`'s bits (prep_triton.py's note on the default).
PREP_LAUNCHES = ((None, None, None, None), (4, 8, 8, 1), (2, 8, 4, 1), (1, 16, 8, 1), (1, 8, 4, 1), (2, 4, 2, 1),
                 (4, 4, 4, 1), (2, 8, 4, 2), (4, 8, 8, 2))


def _prep(bench, canvas: tuple[int, int, int], where: str) -> None:
    """The DiT's VSA prep at one canvas: (a) the unfused path, `qk_norm_rope` writing v through `plan.slot` into
    `empty_tiles` then `pool_tiles_triton` of q, k, v (one timed function; and its norm pass alone), against (b) the
    fused `vsa_prep` at each of `PREP_LAUNCHES`, each checked: q, k and v_tiles bit-equal to (a)'s (`torch.equal`),
    and the largest difference of each tile mean from (a)'s pools relative to that mean's largest magnitude (fp32
    summation order only: ~1e-7). Inputs: random bf16 qkv `[S, 56, 3, 128]` viewed as the DiT does, random bf16 norm
    weights, the released DiT's RoPE tables of the layout (R = 96), seed 1."""
    from h3render.kernels.qk_norm_rope import qk_norm_rope
    from h3render.kernels.vsa import empty_tiles, prep_triton, vsa_prep
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton
    from h3render.models.attention import SparseAttention
    from h3render.models.dit_config import DiTConfig
    from h3render.models.dit_embed import rope_tables
    from h3render.packing import t2va_layout

    width, height, frames = canvas
    layout = t2va_layout(300, height, width, frames)  # as `released_vsa_case`
    plan = SparseAttention.for_layout(layout, 0.9, "cuda").plan
    cfg = DiTConfig()
    heads, dim = cfg.num_attention_heads, cfg.attention_head_dim
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(plan.seq_len, heads, 3, dim, device="cuda", generator=g).bfloat16()
    q, k, v = qkv.unbind(2)  # strided [S, H, D] views, as `Attention.forward`
    q_w, k_w = ((1 + 0.1 * torch.randn(dim, device="cuda", generator=g)).bfloat16() for _ in range(2))
    cos, sin = rope_tables(layout.positions.to("cuda"), cfg.rope_freq_dim, cfg.rope_theta)
    eps = cfg.qk_norm_eps

    def norm_only():
        buffers = (torch.empty_like(q, memory_format=torch.contiguous_format),
                   torch.empty_like(k, memory_format=torch.contiguous_format),
                   empty_tiles(plan, heads, dim, v.dtype, v.device))
        return qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps, out=buffers, v_slot=plan.slot)

    def unfused():
        q_out, k_out, v_tiles = norm_only()
        return (q_out, k_out, v_tiles, pool_tiles_triton(q_out, plan), pool_tiles_triton(k_out, plan),
                pool_tiles_triton(v_tiles, plan, tiled=True))

    ref = unfused()
    t_norm = bench.cuda_time(norm_only, reps=20, warm=3)
    bench.rec(stage="vsa-tune", what=f"VSA prep {where}: qk_norm_rope + empty_tiles (v_slot), no pools",
              ours_s=round(t_norm, 6))
    t_ref = bench.cuda_time(unfused, reps=20, warm=3)
    bench.rec(stage="vsa-tune", what=f"VSA prep {where}: unfused, qk_norm_rope + empty_tiles + 3 pools",
              ours_s=round(t_ref, 6))
    for rows, block_h, warps, stages in PREP_LAUNCHES:
        launch = dict(rows=rows, block_h=block_h, num_warps=warps, stages=stages)
        shown = [prep_triton.ROWS, prep_triton.BLOCK_H, prep_triton.NUM_WARPS, prep_triton.STAGES]
        shown = [x if x is not None else d for x, d in zip((rows, block_h, warps, stages), shown)]
        label = (f"VSA prep {where}: fused vsa_prep {shown[0]} rows x {shown[1]} heads, {shown[2]} warps, "
                 f"{shown[3]} stage(s){' (default)' if rows is None else ''}")

        def fn(launch=launch):
            return vsa_prep(q, k, v, q_w, k_w, cos, sin, eps, plan, **launch)

        timed = _timed(bench, label, fn, reps=20, warm=3)
        if timed is None:
            continue
        got, t = timed
        same = {f"same_{name}": bool(torch.equal(a, b)) for name, a, b in zip(("q", "k", "v_tiles"), got, ref)}
        diffs = {f"mean_rel_diff_{name}": float((a - b).abs().max() / b.abs().max())
                 for name, a, b in zip("qkv", got[3:], ref[3:])}
        bench.rec(stage="vsa-tune", what=label, ours_s=round(t, 6), vs_unfused=round(t / t_ref, 3),
                  saved_ms=round((t_ref - t) * 1e3, 3), **same, **diffs)
        del got


def _timed(bench, label: str, fn, *, reps: int, warm: int):
    """(fn()'s result, its median seconds), or None after recording a failed row with `label` (a launch setting that
    does not compile or fit shares the table with the ones that do)."""
    try:
        result = fn()
        return result, bench.cuda_time(fn, reps=reps, warm=warm)
    except Exception as exc:  # noqa: BLE001  a row says why
        bench.rec(stage="vsa-tune", what=label, failed=f"{type(exc).__name__}: {exc}"[:300])
        return None


def _canvas(args, bench, canvas: tuple[int, int, int]) -> None:
    from h3render.kernels.vsa import vsa_attention_naive
    from h3render.kernels.vsa.naive import coarse_attention_naive
    from h3render.kernels.vsa.quant_triton import key_tiles_int8
    from h3render.kernels.vsa.tiles import gather_tiles
    from h3render.kernels.vsa.triton_hopper import launch_fine_tma
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton

    case = bench.released_vsa_case(args.vsa_sparsity, canvas)
    plan, q, k, v, gate, sel, k_mean, flop = (case.plan, case.q, case.k, case.v, case.gate, case.sel, case.k_mean,
                                              case.flop)
    coarse = coarse_attention_naive(case.scores, pool_tiles_triton(v, plan)).contiguous()  # [H, n, D] fp32
    sub = slice(0, 4)
    ref = vsa_attention_naive(*(x[:, sub].contiguous() for x in (q, k, v, gate)), plan, args.vsa_sparsity)
    vt = gather_tiles(v, plan)
    keys = {True: key_tiles_int8(k, plan, k_mean), False: (gather_tiles(k, plan),) * 2}
    out = torch.empty_like(q)
    where = "x".join(map(str, canvas))
    for int8 in (True, False):
        kt, ks = keys[int8]
        for stages in [int(x) for x in args.vsa_tune_stages.split(",")]:
            for cap in [None] + [int(x) for x in args.vsa_tune_maxnreg.split(",") if x]:
                for long_first in (False, True):
                    launch = {"num_warps": 4, "num_stages": stages, **({"maxnreg": cap} if cap else {})}

                    def fn(launch=launch, kt=kt, ks=ks, int8=int8, long_first=long_first):
                        return launch_fine_tma(q, out, kt, vt, ks, gate, coarse, plan, sel, plan.num_prefix,
                                               case.k_kept, gate=True, upcast=False, launch=launch, qk_int8=int8,
                                               long_first=long_first)

                    label = (f"VSA fine+gate TMA {where} {'int8' if int8 else 'bf16'} QK 4w/{stages}st"
                             f"{f' maxnreg={cap}' if cap else ''}{', dense tiles first' if long_first else ''}")
                    timed = _timed(bench, label, fn, reps=5, warm=2)
                    if timed is None:
                        continue
                    handle, t = timed
                    fn()
                    bench.rec(stage="vsa-tune", what=label, ours_s=round(t, 4), tflops=round(flop / t / 1e12, 1),
                              rel_err=bench.rel_err(out[:, sub], ref), n_regs=getattr(handle, "n_regs", None),
                              n_spills=getattr(handle, "n_spills", None),
                              shared=getattr(getattr(handle, "metadata", None), "shared", None))
