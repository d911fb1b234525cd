"""The DiT-side stages of scripts/bench.py: ceilings (ceil), attention backends (attn), Triton kernels (kernels),
the DiT forward vs diffusers (dit), Ulysses sharding (ulysses), video sparse attention (vsa) and the profiler's top
kernels (prof)."""

from __future__ import annotations

import dataclasses

import torch

from bench_common import (build_on_gpu, cuda_time, dit_flops, dit_inputs, gb, parse_canvas, peak_gb, peak_reset,
                          random_, rec, rel_err, released_dit)
from bench_vae import vae_attention

PEAK_TFLOPS = [None]


def stage_ceil(args) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t = cuda_time(lambda: a @ b, reps=10, warm=3)
    PEAK_TFLOPS[0] = 2 * 8192 ** 3 / t / 1e12
    rec(stage="ceil", what="bf16 matmul 8192^3", tflops=round(PEAK_TFLOPS[0], 1))
    x = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), reps=10, warm=2)
    rec(stage="ceil", what="device copy", tb_per_s=round(2 * x.numel() / t / 1e12, 2))
    del a, b, x, y


def stage_attn(args) -> None:
    import bench_kernels

    for row in bench_kernels.bench_attention():
        rec(stage="attn", **row)


def stage_kernels(args) -> None:
    import bench_kernels

    for row in bench_kernels.check_kernels():
        rec(stage="kernel-check", **row)
    for row in bench_kernels.bench_kernels():
        rec(stage="kernels", **row)


@torch.no_grad()
def stage_dit(args) -> None:
    from h3render import sampling
    from h3render.models.attention import attention, select_backend

    backend = select_backend(args.attention)
    rec(stage="dit", what="attention backend", backend=backend)
    shapes = [(768, 1344, 243), (544, 960, 124)]

    # 1. ours vs diffusers at reduced depth, same weights
    n = args.ref_blocks
    dit = released_dit(n)
    dit.set_attention(attention, refiner=True)
    ref = diffusers_dit(dit)
    for height, width, frames in shapes:
        layout, text, video_rows, audio_rows = dit_inputs(dit, height, width, frames)
        vs, as_ = sampling.sigma_schedule(50, 12.0), sampling.sigma_schedule(50, 3.0)
        tables = dit.modulation_tables(sampling.schedule_timesteps(vs[:3], as_[:3]))
        vt, at = 1 - vs[1], 1 - as_[1]
        index = layout.row_timestep_index(tables.index_of(vt), tables.index_of(at))
        rope = dit.rope_tables(layout.positions)
        ours_fn = lambda: dit(video_rows, audio_rows, text, layout, tables, index, rope)  # noqa: E731
        ref_fn = lambda: ref_forward(ref, layout, text, video_rows, audio_rows, vt, at)  # noqa: E731
        peak_reset()
        t_ours = cuda_time(ours_fn, reps=2)
        mem_ours = peak_gb()
        peak_reset()
        t_ref = cuda_time(ref_fn, reps=2)
        mem_ref = peak_gb()
        (ov, oa), (rv, ra) = ours_fn(), ref_fn()
        ev, ea = rel_err(ov, rv), rel_err(oa, ra)
        att, lin = dit_flops(layout.seq_len, dit.cfg, 50)
        scale = 50 / n
        rec(stage="dit", what=f"DiT forward {width}x{height}x{frames} ({n} blocks, scaled to 50)",
            seq=layout.seq_len, ours_s=round(t_ours * scale, 3), ref_s=round(t_ref * scale, 3),
            speedup=round(t_ref / t_ours, 3), tflops=round((att + lin) / (t_ours * scale) / 1e12, 1),
            rel_err_video=ev, rel_err_audio=ea, ok=ev <= 1e-2 and ea <= 1e-2,
            peak_gb_ours=mem_ours, peak_gb_ref=mem_ref)
    del ref, dit
    peak_reset()

    # 2. ours alone at 50 blocks, tables only (AdaLN weights dropped)
    dit = released_dit(50)
    dit.set_attention(attention, refiner=True)
    for height, width, frames in shapes:
        layout, text, video_rows, audio_rows = dit_inputs(dit, height, width, frames)
        vs, as_ = sampling.sigma_schedule(5, 12.0), sampling.sigma_schedule(5, 3.0)
        if dit.has_adaln_weights:
            tables = dit.modulation_tables(sampling.schedule_timesteps(vs, as_))
            weights_gb = gb(sum(p.numel() * p.element_size() for p in dit.parameters()))
            dit.drop_adaln_weights_()
            torch.cuda.empty_cache()
            rec(stage="dit", what="DiT weights on GPU", with_adaln_gb=weights_gb,
                without_adaln_gb=gb(sum(p.numel() * p.element_size() for p in dit.parameters())))
        index = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]))
        rope = dit.rope_tables(layout.positions)
        peak_reset()
        t = cuda_time(lambda: dit(video_rows, audio_rows, text, layout, tables, index, rope), reps=2)
        att, lin = dit_flops(layout.seq_len, dit.cfg, 50)
        rec(stage="dit", what=f"DiT forward {width}x{height}x{frames} (50 blocks, ours)", seq=layout.seq_len,
            ours_s=round(t, 3), tflops=round((att + lin) / t / 1e12, 1),
            frac_peak=round((att + lin) / t / 1e12 / PEAK_TFLOPS[0], 3) if PEAK_TFLOPS[0] else None,
            peak_gb=peak_gb())
    del dit
    peak_reset()


def diffusers_dit(dit):
    from diffusers import MiniMaxH3Transformer3DModel

    from h3render.checkpoint.names import dit_state_dict_to_diffusers

    config = dataclasses.asdict(dit.cfg)
    config["patch_size"] = tuple(config["patch_size"])
    ref = build_on_gpu(lambda: MiniMaxH3Transformer3DModel(**config))
    sd = dit_state_dict_to_diffusers(dit.state_dict(), dit.cfg)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and all("inv_freq" in k for k in missing), (missing[:3], unexpected[:3])
    # the release's fp32 islands, as diffusers keeps them (_keep_in_fp32_modules)
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        ref.get_submodule(name).float()
    return ref


def ref_forward(ref, layout, text, video_rows, audio_rows, video_t, audio_t):
    from h3render.packing import step_timesteps

    ts, index = step_timesteps(layout, video_t, audio_t)
    out = ref(video_rows[None], audio_rows[None], text[None], ts.cuda(), index.cuda(), layout.token_tags,
              layout.positions, layout.video_index, layout.audio_index, layout.text_index, return_dict=False)
    return out[0][0], out[1][0]


def _dit_step(dit, height: int, width: int, frames: int):
    """A 50-block-style forward closure at one canvas (tables for a 4-forward schedule, AdaLN weights dropped)."""
    from h3render import sampling

    layout, text, video_rows, audio_rows = dit_inputs(dit, height, width, frames)
    vs, as_ = sampling.sigma_schedule(5, 12.0), sampling.sigma_schedule(5, 3.0)
    tables = dit.modulation_tables(sampling.schedule_timesteps(vs, as_))
    dit.drop_adaln_weights_()
    torch.cuda.empty_cache()
    index = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]))
    rope = dit.rope_tables(layout.positions)
    return layout, (video_rows, audio_rows, text, layout, tables, index, rope)


@torch.no_grad()
def stage_ulysses(args) -> None:
    """DiT forward at 1344x768x243, 50 blocks, rows sharded over the torchrun ranks: head-chunk variants."""
    from h3render.models.attention import attention, select_backend
    from h3render.parallel.dit import sharded_forward
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel("cuda")
    select_backend(args.attention)
    dit = released_dit(50)
    dit.set_attention(attention, refiner=True)
    layout, inputs = _dit_step(dit, 768, 1344, 243)
    first = None
    for chunks in args.ulysses_chunks:
        fn = lambda: sharded_forward(dit, ctx, *inputs, chunks=chunks)  # noqa: E731
        peak_reset()
        t = cuda_time(fn, reps=2)
        video, _ = fn()
        first = video if first is None else first
        att, lin = dit_flops(layout.seq_len, dit.cfg, 50)
        rec(stage="ulysses", what=f"DiT forward 1344x768x243 (50 blocks) on {ctx.world_size} GPUs, {chunks} head "
                                  f"chunk(s)", ours_s=round(t, 3), tflops=round((att + lin) / t / 1e12, 1),
            rel_err=rel_err(video, first), vs="first variant", peak_gb=peak_gb())
    del dit, inputs
    peak_reset()


# ---------------------------------------------------------------------------------------------------------------------
# vsa stage (issue 14): FastH3 video sparse attention


@torch.no_grad()
def stage_vsa(args) -> None:
    from h3render.kernels.vsa import select_tiles, topk_budget, vsa_attention, vsa_attention_naive
    from h3render.kernels.vsa.naive import coarse_attention_naive, tile_scores
    from h3render.kernels.vsa.triton_impl import (FINE_CONFIGS, fine_attention_triton, pool_tiles_triton,
                                                  tuned_fine_config)
    from h3render.models.attention import SparseAttention, attention, runner, select_backend
    from h3render.packing import t2va_layout

    s = args.vsa_sparsity
    backend = select_backend(args.attention)
    layout = t2va_layout(300, 768, 1344, 243)
    plan = SparseAttention.for_layout(layout, s, "cuda").plan
    heads, dim, n = 56, 128, plan.num_tiles
    k_tiles = topk_budget(s, plan.num_video)
    # Fine work relative to dense: prefix query tiles visit all n tiles, video ones P + k (padded 64-row tiles).
    density = (plan.num_prefix * n + plan.num_video * (plan.num_prefix + k_tiles)) / n ** 2
    rec(stage="vsa", what="geometry", seq=plan.seq_len, tiles=n, prefix_tiles=plan.num_prefix,
        video_tiles=plan.num_video, k=k_tiles, sparsity=s, block_density=round(density, 4))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, gate = (torch.randn(plan.seq_len, heads, dim, device="cuda", generator=g).bfloat16() for _ in range(4))
    flop_dense = 4 * plan.seq_len ** 2 * heads * dim

    for name in dict.fromkeys([backend, "sdpa"]):
        fn = runner(name)
        t = cuda_time(lambda: fn(q[None], k[None], v[None]), reps=5)
        rec(stage="vsa", what=f"dense attention one layer ({name})", ours_s=round(t, 4),
            tflops=round(flop_dense / t / 1e12, 1))

    # Reference on 4 heads (VSA is per head; the token-level reference is S x S per head in chunks).
    sub = slice(0, 4)
    ref = vsa_attention_naive(*(x[:, sub].contiguous() for x in (q, k, v, gate)), plan, s)
    for fine in args.vsa_fines.split(","):
        for qk_int8 in (False, True) if fine == "triton" else (False,):
            fn = lambda: vsa_attention(q, k, v, gate, plan, s, fine=fine, qk_int8=qk_int8)  # noqa: E731
            peak_reset()
            t = cuda_time(fn, reps=5, warm=2)
            rec(stage="vsa", what=f"VSA layer coarse+fine+gate ({fine}{', int8 QK' if qk_int8 else ''})",
                ours_s=round(t, 4), tflops=round(flop_dense * density / t / 1e12, 1),
                rel_err=rel_err(fn()[:, sub], ref), peak_gb=peak_gb())

    def coarse():
        scores = tile_scores(pool_tiles_triton(q, plan), pool_tiles_triton(k, plan))
        return scores, select_tiles(scores, plan, s), coarse_attention_naive(scores, pool_tiles_triton(v, plan))

    rec(stage="vsa", what="VSA coarse stage (pool, scores, top-k, coarse out)", ours_s=round(cuda_time(coarse), 4))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # where a whole layer's device time goes
        vsa_attention(q, k, v, gate, plan, s, fine="triton")
        torch.cuda.synchronize()
    rec(stage="vsa", what="VSA layer (triton fine), top kernels", kernels=_top_kernels(prof, 15))
    scores, sel, out_c = coarse()
    # The kept-set selection alone: torch topk + sort against the one-launch Triton select (issue 26).
    for use_triton in (False, True):
        t = cuda_time(lambda: select_tiles(scores, plan, s, use_triton=use_triton), reps=20)  # noqa: B023
        rec(stage="vsa", what=f"VSA tile selection ({'Triton select' if use_triton else 'torch topk + sort'})",
            ours_s=round(t, 5), same_set=bool(torch.equal(select_tiles(scores, plan, s, use_triton=use_triton), sel)))
    # Each fixed launch setting, then the autotuned pick (issue 26), of the pointer kernel (tma=False) and of the TMA
    # kernel (h3render/kernels/vsa/triton_hopper.py, the default on sm_90).
    from h3render.kernels.vsa.triton_hopper import TMA_CONFIGS

    from h3render.kernels.vsa.quant import head_mean_from_pooled
    from h3render.kernels.vsa.quant_triton import key_tiles_int8
    from h3render.kernels.vsa.tiles import gather_tiles

    k_mean = head_mean_from_pooled(pool_tiles_triton(k, plan), plan)
    rec(stage="vsa", what="K into tile order: gather_tiles (bf16) / key_tiles_int8 (smooth + quantize)",
        gather_s=round(cuda_time(lambda: gather_tiles(k, plan), reps=20), 5),
        int8_s=round(cuda_time(lambda: key_tiles_int8(k, plan, k_mean), reps=20), 5))
    for tma, configs, qk_int8 in ((False, FINE_CONFIGS, False), (True, TMA_CONFIGS, False),
                                  (True, TMA_CONFIGS, True), (False, FINE_CONFIGS, True)):
        for warps, stages, *cap in tuple(configs) + ((None, None),):
            cap = cap[0] if cap else None
            fn = lambda: fine_attention_triton(q, k, v, plan, sel, gate, out_c, num_warps=warps,  # noqa: E731
                                               num_stages=stages, maxnreg=cap, tma=tma, qk_int8=qk_int8, k_mean=k_mean)
            t = cuda_time(fn, reps=5, warm=2)
            label = (f"num_warps={warps} num_stages={stages}{f' maxnreg={cap}' if cap else ''}" if warps
                     else f"autotuned (picked {tuned_fine_config(tma=tma)})")
            rec(stage="vsa", what=f"VSA fine+gate Triton{' TMA' if tma else ''}{' int8 QK' if qk_int8 else ''} "
                f"{label}", ours_s=round(t, 4), tflops=round(flop_dense * density / t / 1e12, 1),
                rel_err=rel_err(fn()[:, sub], ref))
    del q, k, v, gate, ref, sel, out_c, scores
    torch.cuda.empty_cache()
    if args.vsa_layer_only:
        return

    # DiT forward, 50 blocks, dense then VSA with random gates (bf16, 7168 x 5376 per block).
    dit = released_dit(50)
    dit.set_attention(attention, refiner=True)
    _, step = _dit_step(dit, 768, 1344, 243)
    peak_reset()
    t_dense = cuda_time(lambda: dit(*step), reps=2)
    rec(stage="vsa", what=f"DiT forward 1344x768x243 dense ({backend})", ours_s=round(t_dense, 3), peak_gb=peak_gb())
    dense_v = dit(*step)[0]
    import bench_fp8

    bench_fp8.enable_random_vsa_(dit, s, seed=1)  # bf16 or FP8 gates (an FP8 gate is an e4m3 buffer + scales)
    peak_reset()
    t_vsa = cuda_time(lambda: dit(*step), reps=2)
    rec(stage="vsa", what=f"DiT forward 1344x768x243 VSA s={s} (Triton fine)", ours_s=round(t_vsa, 3),
        ref_s=round(t_dense, 3), speedup=round(t_dense / t_vsa, 2), peak_gb=peak_gb(),
        rel_err_vs_dense=rel_err(dit(*step)[0], dense_v))
    del dit
    torch.cuda.empty_cache()


def _top_kernels(prof, n: int = 20) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = e.self_cuda_time_total
        if device_us > 0:
            rows.append({"name": e.key[:90], "ms": round(device_us / 1e3, 2), "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return [{"total_device_ms": round(total, 1)}] + rows[:n]


@torch.no_grad()
def stage_prof(args) -> None:
    """Where device time goes: one 8-block DiT forward at 1344x768x243 (sharded when under torchrun), and on a single
    GPU one compiled video-VAE decode batch (`--prof-dit`, `--prof-vae` pick them). Prints the top kernels by self
    device time."""
    from h3render.models.attention import select_backend
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel("cuda")
    select_backend(args.attention)
    if args.prof_dit != "none":
        _prof_dit(args, ctx)
    if ctx.distributed or args.prof_dit not in ("none", "bf16-dense"):
        return
    _prof_vae(args)


def _prof_dit(args, ctx) -> None:
    """One 8-block DiT forward under the profiler (`--prof-dit`)."""
    from torch.profiler import ProfilerActivity, profile

    from h3render.models.attention import attention
    from h3render.parallel.dit import sharded_forward

    dit = released_dit(8)
    dit.set_attention(attention, refiner=True)
    what = "DiT 8 blocks"
    if args.prof_dit == "fp8-vsa":  # as a FastH3 render runs: VSA with (random) gates, then the FP8 linears
        import bench_fp8

        from h3render.models.attention import vsa_qk_int8_pays
        from h3render.models.fp8 import quantize_dit_fp8_

        bench_fp8.enable_random_vsa_(dit, args.vsa_sparsity, seed=1)
        quantize_dit_fp8_(dit)
        # The Engine's setting for fp8 on sm_90+ (`vsa_qk_int8_pays`); before 2026-12-04 this profile ran bf16 QK^T
        # (its fine kernel 53.7 ms a layer against 45.4 ms with int8 on the same GPU: docs/performance.md §28.3).
        dit.vsa_qk_int8 = vsa_qk_int8_pays("fp8", torch.device("cuda"))
        what += f" fp8 VSA s={args.vsa_sparsity}{' int8 QK' if dit.vsa_qk_int8 else ''}"
    w, h, f = parse_canvas(args.prof_canvas)
    what += f" {w}x{h}x{f}"
    layout, inputs = _dit_step(dit, h, w, f)
    fn = (lambda: sharded_forward(dit, ctx, *inputs)) if ctx.distributed else (lambda: dit(*inputs))
    t = cuda_time(fn, reps=2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rec(stage="prof", what=f"{what}, {ctx.world_size} GPU(s), top kernels", seconds=round(t, 4),
        kernels=_top_kernels(prof, 30))
    if args.prof_dit == "fp8-vsa" and not ctx.distributed:
        _fine_in_forward(fn, what)
    del dit, inputs
    peak_reset()


def _fine_in_forward(forward, what: str) -> None:
    """The fine kernel on one layer's own inputs from inside the forward (captured at its first call), autotuned as
    the forward launches it and at each `TMA_CONFIGS` setting, beside the same launches on `released_vsa_case`'s
    random q/k/v: whether a layer's fine time in the forward's profile comes from its inputs or from the launch."""
    from h3render.kernels.vsa import triton_impl
    from h3render.kernels.vsa.triton_hopper import TMA_CONFIGS

    captured: list = []
    original = triton_impl.fine_attention_triton

    def capture(*a, **kw):
        if not captured:
            captured.append((tuple(x.clone() if torch.is_tensor(x) else x for x in a),
                             {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}))
        return original(*a, **kw)

    triton_impl.fine_attention_triton = capture
    try:
        forward()
    finally:
        triton_impl.fine_attention_triton = original
    a, kw = captured[0]
    q = a[0]
    settings = [dict(num_warps=w, num_stages=st, maxnreg=r) for w, st, r in TMA_CONFIGS] + [{}]
    for setting in settings:
        t = cuda_time(lambda: original(*a, **kw, **setting), reps=5, warm=2)
        label = (f"{setting['num_warps']}w/{setting['num_stages']}st maxnreg={setting['maxnreg']}" if setting
                 else f"autotuned (picked {triton_impl.tuned_fine_config(tma=True)})")
        rec(stage="prof", what=f"{what}: fine+gate on block 0's own inputs, {label}", ours_s=round(t, 4),
            q_stride=list(q.stride()), qk_int8=kw.get("qk_int8"), kept=list(a[4].shape) if a[4] is not None else None)
    from bench_common import released_vsa_case
    from h3render.kernels.vsa.naive import coarse_attention_naive

    case = released_vsa_case(0.9)  # 1344x768x243 with 300 text rows
    coarse = coarse_attention_naive(case.scores, triton_impl.pool_tiles_triton(case.v, case.plan))
    t = cuda_time(lambda: original(case.q, case.k, case.v, case.plan, case.sel, case.gate, coarse, qk_int8=True,
                                   k_mean=case.k_mean, **settings[0]), reps=5, warm=2)
    rec(stage="prof", what=f"fine+gate on released_vsa_case's random inputs (vsa-tune's), {settings[0]}",
        ours_s=round(t, 4), kept=list(case.sel.shape), seq=case.plan.seq_len, forward_seq=q.shape[0])


def _prof_vae(args) -> None:
    """One video-VAE decode batch under the profiler (`--prof-vae`: bf16 or FP8 decoder linears), as the Engine runs
    it: bf16 blocks compiled, FP8 ones eager (`VideoVAE.compile_pays`)."""
    from torch.profiler import ProfilerActivity, profile

    from h3render.checkpoint.releases import RELEASES
    from h3render.models.video_vae import VideoVAE

    release = RELEASES["released"]
    vae = build_on_gpu(lambda: VideoVAE(release.video_vae, release.vae_tiling), torch.float32)
    random_(vae, 1).apply_precision_(torch.bfloat16)
    vae.fuse_qkv_()
    if args.prof_vae == "fp8":  # the decoder block linears as `--precision fp8` runs them
        from h3render.models.fp8 import quantize_video_decoder_fp8_

        quantize_video_decoder_fp8_(vae)
    vae_attention(vae, args.vae_batches[-1], "prof")
    mode = "compiled" if vae.compile_pays else "eager"
    if vae.compile_pays:
        vae.compile_blocks_(dynamic=False)
    z = torch.randn(24, 72, 48, 84, device="cuda")
    vb = args.vae_batches[-1]
    items = vae.plan_decode(*z.shape[1:]).items[:vb]
    for _ in range(2):
        vae.decode_items(z, items, vb)
    t = cuda_time(lambda: vae.decode_items(z, items, vb), reps=3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        vae.decode_items(z, items, vb)
        torch.cuda.synchronize()
    rec(stage="prof", what=f"video VAE {args.prof_vae} {mode}, one batch of {vb} items", seconds=round(t, 4),
        launches=sum(e.count for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0),
        kernels=_top_kernels(prof, 25))
    # Four batches in a row: the gaps between batches count (against one batch's wall and its kernels' sum).
    many = vae.plan_decode(*z.shape[1:]).items[:4 * vb]
    t_many = cuda_time(lambda: vae.decode_items(z, many, vb), reps=3)
    rec(stage="prof", what=f"video VAE {args.prof_vae} {mode}, {len(many)} items", seconds=round(t_many, 4))
    if args.prof_vae != "fp8":
        return
    from h3render.models import fp8
    from h3render.models.video_vae import FeedForward

    # Each earlier form with this tree's other parts (warm-up 2): the FP8 FFN with the SwiGLU quantization in torch
    # ops (session 13's start, when Inductor fused them; eager since session 25), the GEMMs' bias in a pass of its
    # own (before session 18).
    for owner, name, label in ((FeedForward, "fused_fp8", "the SwiGLU quantization in torch ops (no fused kernel)"),
                               (fp8, "BIAS_EPILOGUE", "the GEMMs' bias added apart (no epilogue)")):
        setattr(owner, name, False)
        try:
            t_before = cuda_time(lambda: vae.decode_items(z, many, vb), reps=3, warm=2)
        finally:
            setattr(owner, name, True)
        rec(stage="prof", what=f"video VAE fp8 {mode}, {len(many)} items, {label}", seconds=round(t_before, 4),
            current_s=round(t_many, 4))

