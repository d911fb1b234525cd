"""The VAE and text-encoder stages of scripts/bench.py: video VAE decode vs diffusers (vae), audio VAE decode
variants (audio) and the 50-layer text encoder (te)."""

from __future__ import annotations

import dataclasses
import time

import torch

from bench_common import build_on_gpu, cuda_time, gb, peak_gb, peak_reset, random_, rec, rel_err


@torch.no_grad()
def stage_vae(args) -> None:
    try:
        from diffusers import AutoencoderKLMiniMaxH3
    except ImportError:  # a call that carries PyAV instead of diffusers (64 MiB wheel budget)
        AutoencoderKLMiniMaxH3 = None

    from h3render.models.attention import select_backend
    from h3render.models.video_vae import VideoVAE
    from h3render.models.video_vae_config import VideoVAEConfig

    select_backend(args.attention)
    cfg = VideoVAEConfig()
    ours = build_on_gpu(lambda: VideoVAE(cfg), torch.float32)
    random_(ours, 1)
    ref = None
    if AutoencoderKLMiniMaxH3 is not None:
        ref = build_on_gpu(lambda: AutoencoderKLMiniMaxH3(**dataclasses.asdict(cfg)), torch.float32)
        ref.load_state_dict(ours.state_dict(), strict=True)
        ref.to(torch.bfloat16)  # all-bf16, as the anchor runs it (DESIGN.md §3)
        ref.enable_tiling()
    ours.apply_precision_(torch.bfloat16)
    ours.fuse_qkv_()  # as the Engine runs it
    vae_attention(ours, args.vae_batches[-1], "vae")
    rec(stage="vae", what="video VAE params", params=sum(p.numel() for p in ours.parameters()))
    compiled = False
    r = cfg.spatial_ratio  # pixels per latent along each spatial axis
    for t_lat, h, w in ((72, 48, 84),):
        g = torch.Generator(device="cuda").manual_seed(2)
        z = torch.randn(24, t_lat, h, w, device="cuda", generator=g)
        for vb in args.vae_batches:
            peak_reset()
            t_ours = cuda_time(lambda: ours.decode(z, batch_size=vb), reps=1, warm=1)
            rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * r}x{h * r} (ours, batch {vb})",
                ours_s=round(t_ours, 3), peak_gb=peak_gb())
        out = ours.decode(z, batch_size=args.vae_batches[-1])
        ref_rgb, t_ref = None, None
        if ref is not None:
            ref_rgb, t_ref = ref_vae_decode(ref, cfg, z)
            err = rel_err(out, ref_rgb)
            rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * r}x{h * r} (reference, bf16)",
                ref_s=round(t_ref, 3), ref_peak_gb=peak_gb(), rel_err=err, ok=err <= 1e-2, frames=out.shape[1])
        if not compiled:
            t0 = time.perf_counter()
            ours.compile_blocks_(dynamic=False)
            items = ours.plan_decode(*z.shape[1:]).items
            size = ours.batch_for(len(items), args.vae_batches[-1])  # the size `decode` then runs
            ours.decode_items(z, items[:size], size)
            torch.cuda.synchronize()
            rec(stage="vae", what="video VAE compile warm-up", seconds=round(time.perf_counter() - t0, 1))
            compiled = True
        peak_reset()
        vb = args.vae_batches[-1]
        t_c = cuda_time(lambda: ours.decode(z, batch_size=vb), reps=1, warm=0)
        out_c = ours.decode(z, batch_size=vb)
        err_c = rel_err(out_c, ref_rgb if ref_rgb is not None else out)
        rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * r}x{h * r} (ours compiled, batch {vb})",
            ours_s=round(t_c, 3), ref_s=None if t_ref is None else round(t_ref, 3),
            speedup=None if t_ref is None else round(t_ref / t_c, 2), rel_err=err_c,
            vs="reference" if ref_rgb is not None else "ours eager", ok=err_c <= 1e-2, peak_gb=peak_gb())
        del out_c, out, ref_rgb
    del ours, ref
    peak_reset()


def vae_attention(vae, batch: int, stage: str) -> None:
    """The decoder's attention backend, checked at its own shape (as `Engine.prepare` does)."""
    from h3render.models.attention import preferred_for, runner
    from h3render.warmup import heads_first

    shape = vae.attention_shape(vae.plan_decode(vae.config.geometry.window_latents, 48, 84), batch)
    name, probe = preferred_for(shape)
    vae.set_attention(heads_first(runner(name)))
    rec(stage=stage, what=f"VAE attention backend at {list(shape)}", backend=name, probe_rel_err=probe)


def ref_vae_decode(ref, cfg, z):
    """diffusers' decode as its pipeline runs it: de-normalize, decode, ImageNet -> RGB. Returns (rgb, seconds)."""
    peak_reset()
    t0 = time.perf_counter()
    mean = torch.tensor(cfg.latents_mean, device="cuda").view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device="cuda").view(1, -1, 1, 1, 1)
    out = ref.decode((z[None] * std + mean).bfloat16(), return_dict=False)[0][0].float()
    torch.cuda.synchronize()
    return ref_pixels(out), time.perf_counter() - t0


def ref_pixels(decoded: torch.Tensor) -> torch.Tensor:
    """diffusers' decoder output (ImageNet-normalized) -> RGB [0, 1], as its pipeline post-processes it."""
    from h3render.models.video_vae import PIXEL_MEAN, PIXEL_STD

    mean = torch.tensor(PIXEL_MEAN, device=decoded.device).view(3, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=decoded.device).view(3, 1, 1, 1)
    return (decoded * std + mean).clamp(0, 1)


def event_times(fn, reps: int = 25, warm: int = 3) -> dict:
    """Per-call device time between CUDA events around `fn()` (launch gaps included: the device waits for the
    host) and host wall time with synchronization; medians (and min) over `reps` calls after `warm` calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    device, wall = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        wall.append(time.perf_counter() - t0)
        device.append(start.elapsed_time(end) / 1e3)
    device.sort()
    wall.sort()
    return {"median_s": round(device[len(device) // 2], 5), "min_s": round(device[0], 5),
            "wall_median_s": round(wall[len(wall) // 2], 5), "reps": reps}


@torch.no_grad()
def stage_audio(args) -> None:
    """Audio VAE decode, 2 x 405 latents (10.125 s stereo) -> [2, 324000] fp32: eager and CUDA graph (what the
    Engine runs), each with the Triton anti-aliased activations (default on CUDA) and with the torch ones,
    torch.compile variants; every output checked against our default eager decode and diffusers' (same weights)."""
    from h3render.graphs import ShapeGraphs
    from h3render.models.audio_vae import AudioVAE
    from h3render.models.audio_vae_config import AudioVAEConfig
    from h3render.settings import RunSettings

    cfg = AudioVAEConfig()
    ours = build_on_gpu(lambda: AudioVAE(cfg), torch.float32)
    random_(ours, 3)
    z = torch.randn(2, 32, args.audio_latents, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    label = f"audio VAE decode 2x{args.audio_latents} latents (fp32"
    rec(stage="audio", what="audio VAE settings", cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        cudnn_benchmark=torch.backends.cudnn.benchmark, reps=args.audio_reps,
        renderer_uses=("CUDA graph" if RunSettings().graph_audio else "eager")
        + " + Triton activations (kept by prepare when within 1e-3 of the torch ones on a 1 s probe)")

    ref_out, ref_times = None, None
    try:
        from diffusers import AutoencoderKLMiniMaxH3Audio
    except ImportError:
        AutoencoderKLMiniMaxH3Audio = None
    if AutoencoderKLMiniMaxH3Audio is not None:
        ref = build_on_gpu(lambda: AutoencoderKLMiniMaxH3Audio(**dataclasses.asdict(cfg)), torch.float32)
        ref.load_state_dict(ours.state_dict(), strict=True)
        mean = torch.tensor(cfg.latents_mean or [0.0] * 32, device="cuda").view(1, -1, 1)
        std = torch.tensor(cfg.latents_std or [1.0] * 32, device="cuda").view(1, -1, 1)
        ref_fn = lambda: ref.decode(z * std + mean, return_dict=False)[0][:, 0]  # noqa: E731
        ref_times = event_times(ref_fn, reps=args.audio_reps)
        ref_out = ref_fn()
        rec(stage="audio", what=f"{label}, diffusers 0.42.1)", ref_s=ref_times["median_s"], **ref_times)

    eager_out = ours.decode(z)

    def report(name: str, fn, extra: dict | None = None) -> None:
        times = event_times(fn, reps=args.audio_reps)
        out = fn()
        row = dict(stage="audio", what=f"{label}, {name})", ours_s=times["median_s"], **times,
                   rel_err_vs_eager=rel_err(out, eager_out), bitwise_eager=bool(torch.equal(out, eager_out)),
                   **(extra or {}))
        if ref_out is not None:
            err = rel_err(out, ref_out)
            row.update(ref_s=ref_times["median_s"], speedup=round(ref_times["median_s"] / times["median_s"], 2),
                       rel_err=err)
        row["ok"] = row["rel_err_vs_eager"] <= 1e-4 and times["median_s"] <= 0.05
        rec(**row)

    def reference_forms():  # grad mode on: the per-call weight norm and out-of-place activations (the old code)
        with torch.enable_grad():
            return ours.decoder(ours.dec_in_proj(z * ours.latents_std + ours.latents_mean))[:, 0]

    report("eager, reference forms: no inference caches, torch activations", reference_forms)
    ours.set_fused_activations(False)
    report("eager, torch activations", lambda: ours.decode(z))
    torch_graph = ShapeGraphs(ours.decode, name="audio torch")
    torch_graph.capture(z)
    report("CUDA graph, torch activations", lambda: torch_graph(z))
    ours.set_fused_activations(None)  # back to the default: Triton on CUDA
    report("eager, Triton activations", lambda: ours.decode(z))
    graphed = ShapeGraphs(ours.decode, name="audio")
    capture_s = graphed.capture(z)
    report("CUDA graph, Triton activations: Engine default", lambda: graphed(z),
           {"capture_s": round(capture_s, 3), "graphed": graphed.graphs_on(z.device)})

    # What true fp32 convolutions cost, how far cuDNN's TF32 default is from them, and the Triton activations' own
    # error with TF32 out of the way (fp32 Triton vs fp32 torch activations).
    torch.backends.cudnn.allow_tf32 = False
    try:
        fp32_out = ours.decode(z)
        fp32_torch = ours.set_fused_activations(False).decode(z)
        ours.set_fused_activations(None)
        fp32_graph = ShapeGraphs(ours.decode, name="audio fp32")
        fp32_graph.capture(z)
        times = event_times(lambda: fp32_graph(z), reps=args.audio_reps)
        rec(stage="audio", what=f"{label}, CUDA graph, Triton activations, cudnn.allow_tf32=False)",
            ours_s=times["median_s"], **times, rel_err_tf32_vs_fp32=rel_err(eager_out, fp32_out),
            rel_err_triton_vs_torch_activations_fp32=rel_err(fp32_out, fp32_torch),
            rel_err_vs_ref=None if ref_out is None else rel_err(fp32_out, ref_out))
    finally:
        torch.backends.cudnn.allow_tf32 = True
        ours.set_fused_activations(None)

    for mode in args.audio_compile_modes:
        if mode == "none":
            continue
        torch._dynamo.reset()
        decoder = ours.decoder
        compiled = torch.compile(decoder, mode=mode, dynamic=False)

        def compiled_decode(x, compiled=compiled):
            return compiled(ours.dec_in_proj(x.float() * ours.latents_std + ours.latents_mean))[:, 0]

        try:
            t0 = time.perf_counter()
            compiled_decode(z)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            report(f"torch.compile {mode}", lambda: compiled_decode(z), {"compile_s": round(compile_s, 1)})
            if mode != "reduce-overhead":
                both = ShapeGraphs(compiled_decode, name="audio compiled")
                both.capture(z)
                report(f"torch.compile {mode} + CUDA graph", lambda: both(z))
        except Exception as exc:  # keep the other variants' numbers
            rec(stage="audio", what=f"{label}, torch.compile {mode})", error=f"{type(exc).__name__}: {exc}"[:400])
    peak_reset()


@torch.no_grad()
def stage_te(args) -> None:
    from h3render.checkpoint.releases import QWEN3VL_RELEASED
    from h3render.models.text_encoder import TextEncoder

    te = build_on_gpu(lambda: TextEncoder(dict(QWEN3VL_RELEASED["text_config"]), read_layer=50))
    random_(te, 4)
    rec(stage="te", what="text encoder weights (50 layers)", gb=gb(sum(p.numel() * 2 for p in te.parameters())))
    for n in (256, 2000):
        ids = torch.randint(0, 150000, (n,), device="cuda")
        t = cuda_time(lambda: te(ids[None]), reps=3)
        rec(stage="te", what=f"text encoder {n} tokens", ours_s=round(t, 4))
    del te
    peak_reset()
