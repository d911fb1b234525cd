"""Build, check and time h3render at the released shapes on the GPU machine, beside diffusers 0.42.1.

No checkpoint needed: real-size components get random bf16 weights created directly on the GPU (no fp32 host copy).
Every comparison runs ours and the reference on the SAME weights and inputs in the same process, and checks
||ours - ref|| / ||ref|| <= 1e-2 (bf16), so a fast wrong kernel cannot pass. Prints one JSON line per measurement
and a table at the end; `--out FILE` also writes them all as JSON.

Stages (`--stages`, comma-separated):
  ceil      bf16 matmul and device copy ceilings
  attn      attention backends at S = 73,642 (one layer, 56 heads x 128)
  kernels   Triton kernels vs their torch references at the released shapes
  dit       DiT forward: ours vs diffusers at --ref-blocks blocks (same weights; scaled to 50), then ours at 50
            blocks alone (tables, AdaLN weights dropped), 1344x768x243 and 960x544x124
  vae       video VAE decode of 72 (and 32) latent frames: ours vs diffusers, same weights
  audio     audio VAE decode (fp32), 2 x 405 latents: eager, CUDA graph (the Engine's path), cudnn TF32 off, and
            torch.compile (--audio-compile-modes) with and without a graph; each vs our eager and vs diffusers;
            medians of --audio-reps calls timed with CUDA events
  te        text encoder, 50 of 64 Qwen3-VL-32B layers, 256- and 2,000-token prompts
  ulysses   DiT forward at 1344x768x243 sharded over the torchrun ranks, per head-chunk count (--ulysses-chunks)
  vsa       FastH3 video sparse attention at 1344x768x243 (300 text + 810 audio rows), s = --vsa-sparsity: dense
            attention vs the VSA layer (coarse + fine + gate) per fine backend, the coarse stage and each Triton
            launch variant alone, rel. error vs the torch reference on 4 heads; then a 50-block DiT forward dense
            vs VSA (random gates)
  prof      top device kernels of an 8-block DiT forward (sharded under torchrun) and a compiled VAE decode batch
  compare   1 GPU vs N GPUs: latents and frames saved by `e2e --save-latents` runs on this machine
  e2e       complete MP4 of --e2e-canvases clips (default a 10.125 s 1344x768) with --forwards DiT forwards (4 = FastH3
            length; --e2e-vsa: then again with VSA at --vsa-sparsity, random gates), all
            components resident, for each of --precision (bf16,fp8: one engine after the other), --e2e-attention
            to pick dense / vsa; scripts/bench_e2e.py; run under torchrun for several GPUs
  fp8-gemm, fp8-quant, fp8-dit
            issue 18 (scripts/bench_fp8.py): the DiT's block GEMMs bf16 vs FP8, the fused FP8 producers, a DiT
            forward and the 4-forward FastH3 chain bf16 vs FP8 (errors, memory); `--fp8-model tiny --fp8-device cpu
            --fp8-canvas 160x128x22` is the CPU smoke run
  fp8-memory
            resident memory per component and load peak, per --precision (scripts/bench_e2e.py)
  fl2va     fl2va's extra cost over t2va at --fl2va-canvas (scripts/bench_fl2va.py): vision tower + processor for 2
            keyframes, their VAE encode, the text encoder's longer presentation, one DiT forward with the +2,016
            condition rows vs without, summed for --fl2va-forwards forwards; `--fl2va-model tiny --fl2va-device
            cpu --fl2va-canvas 224x128x39` is the CPU smoke run
  batch     queue throughput on 1 GPU: --batch-jobs jobs of --forwards DiT forwards at --batch-canvas through
            `run_batch` with one resident Engine (each job's MP4 tail beside the next job's start). Warm-up
            (prepare, and one untimed job of the queue's shape for Triton JIT / first-call costs) is outside the
            timings. `--batch-model tiny` runs it on the built-in tiny model (also on CPU: `--batch-device cpu`), a
            smoke test of the stage.

Usage (device): python scripts/bench.py --stages ceil,attn,kernels,dit,vae,audio,te
                torchrun --nproc-per-node 2 scripts/bench.py --stages e2e
                python scripts/bench.py --stages batch --batch-canvas 960x544x124 --out batch.json
Usage (CPU smoke): python scripts/bench.py --stages batch --batch-model tiny --batch-device cpu \
                       --batch-canvas 128x64x22
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: list[dict] = []
PEAK_TFLOPS = [None]


def rec(**row) -> None:
    RESULTS.append(row)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row, default=str), flush=True)


def cuda_time(fn, reps: int = 3, warm: int = 1) -> float:
    """Median wall seconds of `fn()` with device synchronization."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())


def gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 2)


def peak_reset() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return gb(torch.cuda.max_memory_allocated())


# ---------------------------------------------------------------------------------------------------------------------
# random real-size components, built on the GPU


@torch.no_grad()
def random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """O(1)-scaled random weights in place (norm weights ~1, matrices ~1/sqrt(fan_in), small biases): keeps 50 random
    blocks finite, which default initialisations do not guarantee in bf16."""
    torch.manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
        elif p.ndim == 1:
            p.copy_(0.02 * torch.randn_like(p, dtype=torch.float32))
        else:
            fan_in = p[0].numel()
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.5 / fan_in ** 0.5))
    return module


def build_on_gpu(factory, dtype=torch.bfloat16):
    """Construct a module directly on the GPU in `dtype` (no host copy of the weights)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            return factory().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)


def released_dit(num_layers: int = 50, seed: int = 0):
    from h3render.models.dit import DiT, DiTConfig

    cfg = dataclasses.replace(DiTConfig(), num_layers=num_layers)
    dit = build_on_gpu(lambda: DiT(cfg))
    random_(dit, seed)
    return dit.apply_precision_(torch.bfloat16)


def dit_inputs(dit, height: int, width: int, frames: int, text_len: int = 256, seed: int = 0):
    from h3render import sampling
    from h3render.packing import patchify_video, t2va_layout

    layout = t2va_layout(text_len, height, width, frames).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    text = torch.randn(text_len, dit.cfg.text_dim, device="cuda", generator=g).bfloat16()
    video, audio = sampling.draw_noise(seed, layout)
    return layout, text, patchify_video(video[0]).cuda(), audio.cuda()


def dit_flops(seq: int, cfg, layers: int) -> tuple[float, float]:
    """(attention, linear) FLOP of one forward (DESIGN.md §3 accounting)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    lin = 2 * seq * (3 * cfg.hidden_size * inner + inner * cfg.hidden_size + 3 * cfg.hidden_size * cfg.ffn_dim)
    att = 4 * seq * seq * inner
    return att * layers, lin * layers


# ---------------------------------------------------------------------------------------------------------------------
# stages


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

    from h3render.checkpoint import dit_state_dict_to_diffusers

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


@torch.no_grad()
def stage_vae(args) -> None:
    try:
        from diffusers import AutoencoderKLMiniMaxH3
    except ImportError:  # a call that carries PyAV instead of diffusers (64 MiB wheel budget)
        AutoencoderKLMiniMaxH3 = None

    from h3render.models.attention import select_backend
    from h3render.models.video_vae import VideoVAE, VideoVAEConfig

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
    for t_lat, h, w in ((72, 48, 84),):
        g = torch.Generator(device="cuda").manual_seed(2)
        z = torch.randn(24, t_lat, h, w, device="cuda", generator=g)
        for vb in args.vae_batches:
            peak_reset()
            t_ours = cuda_time(lambda: ours.decode(z, batch_size=vb), reps=1, warm=1)
            rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * 16}x{h * 16} (ours, batch {vb})",
                ours_s=round(t_ours, 3), peak_gb=peak_gb())
        out = ours.decode(z, batch_size=args.vae_batches[-1])
        ref_rgb, t_ref = None, None
        if ref is not None:
            ref_rgb, t_ref = ref_vae_decode(ref, cfg, z)
            err = rel_err(out, ref_rgb)
            rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * 16}x{h * 16} (reference, bf16)",
                ref_s=round(t_ref, 3), ref_peak_gb=peak_gb(), rel_err=err, ok=err <= 1e-2, frames=out.shape[1])
        if not compiled:
            t0 = time.perf_counter()
            ours.compile_blocks_(dynamic=False)
            ours.decode_items(z, ours.plan_decode(*z.shape[1:]).items[: args.vae_batches[-1]], args.vae_batches[-1])
            torch.cuda.synchronize()
            rec(stage="vae", what="video VAE compile warm-up", seconds=round(time.perf_counter() - t0, 1))
            compiled = True
        peak_reset()
        vb = args.vae_batches[-1]
        t_c = cuda_time(lambda: ours.decode(z, batch_size=vb), reps=1, warm=0)
        out_c = ours.decode(z, batch_size=vb)
        err_c = rel_err(out_c, ref_rgb if ref_rgb is not None else out)
        rec(stage="vae", what=f"video VAE decode {t_lat} latents {w * 16}x{h * 16} (ours compiled, batch {vb})",
            ours_s=round(t_c, 3), ref_s=None if t_ref is None else round(t_ref, 3),
            speedup=None if t_ref is None else round(t_ref / t_c, 2), rel_err=err_c,
            vs="reference" if ref_rgb is not None else "ours eager", ok=err_c <= 1e-2, peak_gb=peak_gb())
        del out_c, out, ref_rgb
    del ours, ref
    peak_reset()


def vae_attention(vae, batch: int, stage: str) -> None:
    """The decoder's attention backend, measured at its own shape (as `Engine.prepare` does)."""
    from h3render.models.attention import fastest_for, runner
    from h3render.engine import _heads_first

    shape = vae.attention_shape(vae.plan_decode(vae.config.geometry.window_latents, 48, 84), batch)
    name, probe = fastest_for(shape)
    vae.set_attention(_heads_first(runner(name)))
    rec(stage=stage, what=f"VAE attention backend at {list(shape)}", backend=name,
        probe_ms={k: round(v * 1e3, 3) for k, v in probe.items()})


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
    from h3render.models.audio_vae import AudioVAE, AudioVAEConfig
    from h3render.engine import EngineSettings

    cfg = AudioVAEConfig()
    ours = build_on_gpu(lambda: AudioVAE(cfg), torch.float32)
    random_(ours, 3)
    z = torch.randn(2, 32, args.audio_latents, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    label = f"audio VAE decode 2x{args.audio_latents} latents (fp32"
    rec(stage="audio", what="audio VAE settings", cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        cudnn_benchmark=torch.backends.cudnn.benchmark, reps=args.audio_reps,
        renderer_uses=("CUDA graph" if EngineSettings().graph_audio else "eager")
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
    from h3render.checkpoint import QWEN3VL_RELEASED
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


def released_engine(args, ctx):
    """The real Engine over random real-size components (text encoder 50 layers, DiT, both VAEs), all resident."""
    from h3render.checkpoint import QWEN3VL_RELEASED, RELEASES, CheckpointInfo, Components
    from h3render.make_checkpoint import tiny_tokenizer
    from h3render.models.audio_vae import AudioVAE
    from h3render.models.text_encoder import TextEncoder
    from h3render.models.video_vae import VideoVAE
    from h3render.engine import Engine, EngineSettings

    release = RELEASES["released"]
    t0 = time.perf_counter()
    dit = released_dit(50)
    dit.offload_adaln_("cpu")  # tables are built block by block in prepare(); keeps the build under the GPU's memory
    torch.cuda.empty_cache()
    vae = build_on_gpu(lambda: VideoVAE(release.video_vae, release.vae_tiling), torch.float32)
    random_(vae, 1).apply_precision_(torch.bfloat16)
    avae = random_(build_on_gpu(lambda: AudioVAE(release.audio_vae), torch.float32), 3)
    te = build_on_gpu(lambda: TextEncoder(dict(QWEN3VL_RELEASED["text_config"]), read_layer=50,
                                          tokenizer=tiny_tokenizer(512)))
    random_(te, 4)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    info = CheckpointInfo(path="random-released", layout="builtin", release=release)
    comps = Components(dit, vae, avae, te, info)
    settings = EngineSettings(vae_batch=args.vae_batches[-1], attention=args.attention, progress=False,
                              save_latents=getattr(args, "save_latents", False))  # /tmp/e2e-w<N>.latents.pt
    return Engine(comps, ctx, settings, load_seconds=build_s)


PROMPT = ("A lighthouse keeper climbs the spiral stairs at dusk, camera tracking upward; wind, waves, the creak of "
          "iron steps. [Speaker 1]: \"Storm's coming.\"")


def stage_e2e(args) -> None:
    """Complete MP4s through the real Engine, per --precision (scripts/bench_e2e.py)."""
    import bench_e2e

    bench_e2e.stage_e2e(args, sys.modules[__name__])


def stage_fp8_gemm(args) -> None:
    import bench_fp8

    bench_fp8.stage_gemm(args, sys.modules[__name__])


def stage_fp8_quant(args) -> None:
    import bench_fp8

    bench_fp8.stage_quant(args, sys.modules[__name__])


def stage_fp8_dit(args) -> None:
    import bench_fp8

    bench_fp8.stage_dit(args, sys.modules[__name__])


def stage_fp8_memory(args) -> None:
    import bench_e2e

    bench_e2e.stage_memory(args, sys.modules[__name__])


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
    from h3render.kernels.vsa.triton_impl import fine_attention_triton, pool_tiles_triton
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
    for fine in ("triton", "flex"):
        fn = lambda: vsa_attention(q, k, v, gate, plan, s, fine=fine)  # noqa: E731
        peak_reset()
        t = cuda_time(fn, reps=5, warm=2)
        rec(stage="vsa", what=f"VSA layer coarse+fine+gate ({fine})", ours_s=round(t, 4),
            tflops=round(flop_dense * density / t / 1e12, 1), rel_err=rel_err(fn()[:, sub], ref), peak_gb=peak_gb())

    def coarse():
        scores = tile_scores(pool_tiles_triton(q, plan), pool_tiles_triton(k, plan))
        return scores, select_tiles(scores, plan, s), coarse_attention_naive(scores, pool_tiles_triton(v, plan))

    rec(stage="vsa", what="VSA coarse stage (pool, scores, top-k, coarse out)", ours_s=round(cuda_time(coarse), 4))
    _, sel, out_c = coarse()
    for warps, stages in ((4, 2), (4, 3), (8, 2)):
        fn = lambda: fine_attention_triton(q, k, v, plan, sel, gate, out_c, num_warps=warps,  # noqa: E731
                                           num_stages=stages)
        t = cuda_time(fn, reps=5, warm=2)
        rec(stage="vsa", what=f"VSA fine+gate Triton num_warps={warps} num_stages={stages}",
            ours_s=round(t, 4), tflops=round(flop_dense * density / t / 1e12, 1), rel_err=rel_err(fn()[:, sub], ref))
    del q, k, v, gate, ref, sel, out_c
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
    GPU one compiled video-VAE decode batch. Prints the top kernels by self device time."""
    from torch.profiler import ProfilerActivity, profile

    from h3render.models.attention import attention, select_backend
    from h3render.parallel.dit import sharded_forward
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel("cuda")
    select_backend(args.attention)
    dit = released_dit(8)
    dit.set_attention(attention, refiner=True)
    layout, inputs = _dit_step(dit, 768, 1344, 243)
    fn = (lambda: sharded_forward(dit, ctx, *inputs)) if ctx.distributed else (lambda: dit(*inputs))
    cuda_time(fn, reps=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rec(stage="prof", what=f"DiT 8 blocks, {ctx.world_size} GPU(s), top kernels", kernels=_top_kernels(prof))
    del dit, inputs
    peak_reset()
    if ctx.distributed:
        return
    from h3render.models.video_vae import VideoVAE
    from h3render.checkpoint import RELEASES

    release = RELEASES["released"]
    vae = build_on_gpu(lambda: VideoVAE(release.video_vae, release.vae_tiling), torch.float32)
    random_(vae, 1).apply_precision_(torch.bfloat16)
    vae.fuse_qkv_()
    vae_attention(vae, args.vae_batches[-1], "prof")
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
    rec(stage="prof", what=f"video VAE compiled, one batch of {vb} items", seconds=round(t, 4),
        kernels=_top_kernels(prof, 25))


def stage_compare(args) -> None:
    """1 GPU vs N GPUs, same seed: the e2e stage's saved latents and MP4s (/tmp/e2e-w1.* and /tmp/e2e-w<N>.*)."""
    import av
    import numpy as np

    runs = sorted(Path("/tmp").glob("e2e-w*.latents.pt"))
    if len(runs) < 2:
        raise RuntimeError("run the e2e stage with --save-latents on 1 GPU and under torchrun first")
    base = torch.load(runs[0])
    for other in runs[1:]:
        b = torch.load(other)
        for key in ("video", "audio"):
            d = (base[key] - b[key]).double()
            rec(stage="compare", what=f"{runs[0].name} vs {other.name}: {key} latents", max_abs=d.abs().max().item(),
                rel_err=float(d.norm() / base[key].double().norm()), max_ref=base[key].abs().max().item())

        def frames(path):
            with av.open(str(path)) as c:
                return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.int16)

        x = frames(runs[0].with_name(runs[0].name.replace(".latents.pt", ".mp4")))
        y = frames(other.with_name(other.name.replace(".latents.pt", ".mp4")))
        diff = np.abs(x - y)
        rec(stage="compare", what=f"{runs[0].name} vs {other.name}: decoded frames (8-bit RGB)", frames=len(x),
            max_abs=int(diff.max()), mean_abs=float(diff.mean()), frac_equal=float((diff == 0).mean()))


def stage_batch(args) -> None:
    """Queue throughput on one GPU: `run_batch` over --batch-jobs jobs with one Engine (prepared and warmed once).
    Each job's MP4 tail (flush, trailer, fsync, rename, sidecar) runs on the writer's thread beside the next job's
    start; `tail_hidden_s` is the wall time the queue saved by that (the tails' seconds that ran beside the next
    job)."""
    import shutil

    from h3render.batch import run_batch
    from h3render.engine import Engine, EngineSettings
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel

    width, height, frames = (int(x) for x in args.batch_canvas.lower().split("x"))
    device = args.batch_device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    ctx = init_parallel(device)
    if ctx.world_size != 1:
        raise RuntimeError("the batch stage measures one GPU: run it without torchrun")
    if args.batch_model == "released":
        engine = released_engine(args, ctx)
    else:
        if not cuda:
            torch.set_flush_denormal(True)  # as the CLI does on CPU
        settings = EngineSettings(vae_batch=args.vae_batches[-1], attention=args.attention, progress=False)
        engine = Engine.load(args.batch_model, ctx, torch.bfloat16 if cuda else torch.float32, settings)
    jobs = [Job(id=f"q{i}", prompt=f"{PROMPT} Take {i}.", width=width, height=height, frames=frames, seed=i,
                steps=args.forwards + 1, mode="t2va", output=f"q{i}") for i in range(args.batch_jobs)]
    shape = f"{args.batch_jobs} jobs x {width}x{height}x{frames}, {args.forwards} forwards"
    root = Path(args.batch_out)
    shutil.rmtree(root, ignore_errors=True)  # random weights encode as noise: large files, never brought back

    root.mkdir(parents=True)
    t0 = time.perf_counter()
    engine.prepare(jobs[:1])  # every job shares the schedule and canvas
    for k in range(args.batch_warmup):  # Triton JIT at this shape, first-call library set-up, x264 start-up
        engine.render(jobs[0], root / f"warmup{k}.mp4", root / f"warmup{k}.json")
    rec(stage="batch", what="warm-up (outside the queue timings)", seconds=round(time.perf_counter() - t0, 1),
        warmup=engine.warmup, resident_gb=gb(torch.cuda.memory_allocated()) if cuda else None)

    out = root / "queue"
    graphs = _dynamo_graphs()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    report = run_batch(jobs, lambda: engine, out, overwrite=True, quiet=True, progress=False)
    wall = time.perf_counter() - t0
    data = json.loads(report.path.read_text())
    sides = [json.loads((out / f"{j.output}.json").read_text()) for j in jobs if (out / f"{j.output}.json").is_file()]
    tails = [s["timings"]["stages"]["mp4_close_after_decode"]["seconds"] for s in sides]
    rec(stage="batch", what=f"queue, {shape}, 1 {device.upper()}", queue_s=round(data["queue_seconds"], 2),
        wall_s=round(wall, 2), statuses=[j["status"] for j in data["jobs"]], job_s=[j["seconds"] for j in data["jobs"]],
        tail_s=[round(t, 3) for t in tails], tail_hidden_s=round(sum(tails[:-1]), 3),
        new_compiled_graphs=_dynamo_graphs() - graphs,
        peak_gb=gb(max(s["timings"]["peak_memory_bytes"] or 0 for s in sides)) if sides else None)
    if report.exit_code != 0:
        raise RuntimeError(f"queue exit code {report.exit_code}: {[j['error'] for j in data['jobs']]}")


def stage_fl2va(args) -> None:
    """fl2va's extra cost over t2va (scripts/bench_fl2va.py)."""
    import bench_fl2va

    bench_fl2va.run(args, sys.modules[__name__])


def _dynamo_graphs() -> int:
    """Graphs torch.compile has built so far in this process (a change between runs would be a recompile)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------------------------------
# media: the MP4 writer against a simulated decode, no model


def synthetic_video(first: int, n: int, height: int, width: int, kind: str, device, grain: float = 0.01,
                    seed: int = 0) -> torch.Tensor:
    """Frames `first .. first+n-1` of a synthetic clip: float [3, n, H, W] in [0, 1] on `device`.

    kind "moving": a slowly panning colour gradient, a fine drifting texture, six soft-edged discs on smooth
    paths and fresh Gaussian grain of std `grain` per frame (a stand-in for decoded footage: motion, edges and
    some noise for x264 to spend bits on). kind "noise": independent uniform noise per pixel (what random
    weights decode to; x264's worst case).
    """
    g = torch.Generator(device=device).manual_seed(seed * 100_003 + first)
    if kind == "noise":
        return torch.rand(3, n, height, width, device=device, generator=g)
    if kind != "moving":
        raise ValueError(f"synthetic_video: kind must be moving or noise, got {kind!r}")
    t = ((first + torch.arange(n, device=device, dtype=torch.float32)) / 24).view(n, 1, 1)  # seconds
    y = torch.linspace(0, 1, height, device=device).view(1, height, 1)
    x = torch.linspace(0, width / height, width, device=device).view(1, 1, width)
    two_pi = 2 * torch.pi
    video = torch.stack([
        0.45 + 0.25 * torch.sin(two_pi * (0.6 * x + 0.3 * y - 0.05 * t)),
        0.45 + 0.25 * torch.sin(two_pi * (0.4 * x - 0.5 * y + 0.04 * t) + 1.0),
        0.45 + 0.25 * torch.cos(two_pi * (0.3 * x + 0.2 * y + 0.03 * t)),
    ])  # [3, n, H, W]
    video = video + 0.04 * torch.sin(two_pi * (9 * x + 0.5 * t)) * torch.sin(two_pi * (7 * y - 0.4 * t))
    aspect = width / height
    for k in range(6):
        cx = aspect * (0.5 + 0.4 * torch.sin(0.35 * (k + 1) * t + k))  # [n, 1, 1]
        cy = 0.5 + 0.35 * torch.cos(0.25 * (k + 2) * t + 2 * k)
        radius = 0.06 + 0.02 * k
        inside = torch.sigmoid((radius - torch.sqrt((x - cx) ** 2 + (y - cy) ** 2)) * 300)  # [n, H, W]
        colour = torch.tensor([(k * 0.37) % 1, (k * 0.61 + 0.2) % 1, (k * 0.13 + 0.5) % 1],
                              device=device).view(3, 1, 1, 1)
        video = video * (1 - inside) + colour * inside
    video = video + grain * torch.randn(3, n, height, width, device=device, generator=g)
    return video.clamp(0, 1)


def synthetic_audio(frames: int, device) -> torch.Tensor:
    """[2, samples] float32 in [-1, 1] for `frames` video frames at 32 kHz: a few tones and a little noise."""
    from h3render.media import SAMPLE_RATE, audio_samples_for

    n = audio_samples_for(frames)
    t = torch.arange(n, device=device, dtype=torch.float32) / SAMPLE_RATE
    g = torch.Generator(device=device).manual_seed(7)
    tones = [0.2 * torch.sin(2 * torch.pi * f * t) for f in (220.0, 331.0, 440.0, 1210.0)]
    left, right = tones[0] + tones[2], tones[1] + tones[3]
    return torch.stack([left, right]) + 0.02 * torch.randn(2, n, device=device, generator=g)


def vae_chunk_sizes(frames: int, height: int, width: int) -> list[int]:
    """Frames per chunk as the released video VAE's stream emits them (one temporal window's clip each, the last
    window's tail after it: 14 x 17 + 5 for 243 frames)."""
    from h3render.models.vae_tiling import RELEASED_TILING, plan_decode
    from h3render.models.video_vae import VideoVAEConfig
    from h3render.packing import latent_frames_for

    cfg = VideoVAEConfig()
    plan = plan_decode(latent_frames_for(frames), height // 16, width // 16, geometry=cfg.geometry,
                       spatial_ratio=cfg.spatial_ratio, tiling=RELEASED_TILING)
    clip = cfg.geometry.clip_length  # as `assemble_frames` yields them
    bounds = [(w * clip, (w + 1) * clip) for w in range(plan.num_windows)]
    bounds.append((plan.num_windows * clip, plan.num_windows * clip + cfg.geometry.tail_frames))
    return [min(stop, plan.num_frames) - first for first, stop in bounds if min(stop, plan.num_frames) > first]


def stream_mp4(path: Path, kind: str, frames: int, width: int, height: int, decode_s: float, device,
               audio_first: bool, grain: float = 0.01, **writer_options) -> dict:
    """One clip through the renderer's media path, paced like a decode that takes `decode_s` for all frames.

    Chunks are generated before the clock starts (on `device`); chunk i is handed over once its share of
    `decode_s` has passed, the way `render._write_chunk` does it: `rgb_to_i420` on the device, a
    `PinnedFrameStager` copy to the host, `Mp4Writer.write_frames`. On a CPU device the chunks are converted to
    I420 before the clock starts (the GPU does that in 0.04 s per clip; a CPU would steal the encoder's cores).
    The soundtrack goes in before the first chunk (`audio_first`) or after the last, then `close()`.
    """
    from h3render.colour import rgb_to_i420
    from h3render.media import Mp4Writer, PinnedFrameStager
    from h3render.engine import EngineSettings

    settings = EngineSettings()
    on_gpu = torch.device(device).type == "cuda"
    sizes = vae_chunk_sizes(frames, height, width)
    chunks, first = [], 0
    for n in sizes:
        video = synthetic_video(first, n, height, width, kind, device, grain=grain)
        chunks.append(video if on_gpu else rgb_to_i420(video))
        first += n
    wave = synthetic_audio(frames, device)
    if on_gpu:
        torch.cuda.synchronize()
    stager = PinnedFrameStager(num_buffers=8)  # as the Engine's
    options = {"crf": settings.crf, "preset": settings.x264_preset, **writer_options}
    writer = Mp4Writer(path, width, height, frames, **options)
    try:
        if audio_first:
            writer.write_audio(wave.cpu())
        t_start = time.perf_counter()
        done, convert_s = 0, 0.0
        for n, chunk in zip(sizes, chunks):
            done += n
            time.sleep(max(0.0, t_start + decode_s * done / frames - time.perf_counter()))
            t0 = time.perf_counter()
            i420 = rgb_to_i420(chunk) if on_gpu else chunk  # [n, H*3/2, W] uint8
            writer.write_frames(stager.stage(i420))
            convert_s += time.perf_counter() - t0
        t_last = time.perf_counter()
        if not audio_first:
            writer.write_audio(wave.cpu())
        t_close = time.perf_counter()
        writer.close()
        t_end = time.perf_counter()
    except BaseException:
        writer.abort()
        raise
    st = writer.stats
    size = path.stat().st_size
    return {
        "kind": kind, "decode_s": decode_s, "decode_span_s": round(t_last - t_start, 3),
        "audio": "first" if audio_first else "last", "x264_params": writer_options.get("x264_params"),
        "close_latency_s": round(t_end - t_last, 3), "mp4_close_after_decode_s": round(t_end - t_close, 3),
        "backlog_at_last_frame_s": round(max(0.0, writer.marks.get("frames_done", t_last) - t_last), 3),
        "flush_s": round(st["flush_s"], 3), "trailer_s": round(st["trailer_s"], 3), "sync_s": round(st["sync_s"], 3),
        "encode_s": round(st["encode_s"], 3), "audio_s": round(st["audio_s"], 3),
        "blocked_s": round(st["blocked_s"], 3), "to_i420_stage_write_s": round(convert_s, 3),
        "bytes": size, "mbit_s": round(8 * size / (frames / 24) / 1e6, 1), "chunks": len(sizes),
    }


def probe_mp4(path: Path) -> dict:
    import av

    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        return {"probe_video": f"{v.codec_context.name} {v.codec_context.profile} {v.format.name} "
                               f"primaries={v.codec_context.color_primaries} range={v.codec_context.color_range}",
                "probe_audio": f"{a.codec_context.name} {a.rate} Hz {a.channels} ch"}


def stage_media(args) -> None:
    """Close latency of the MP4 writer on synthetic moving content and on noise at 1344x768x243, paced to the
    measured decode rates (split decode on 2 GPUs 4.08 s, 1 GPU compiled 7.07 s); no model needed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(args.media_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec(stage="media", what="media setup", device=device, cpus=os.cpu_count(),
        chunks=vae_chunk_sizes(args.media_frames, 768, 1344), audio=args.media_audio)
    variants = [None if v in ("", "default") else v for v in args.media_x264_params.split(";")]
    for kind in args.media_kinds.split(","):
        for decode_s in args.media_decode_s:
            for params in variants:
                path = out_dir / f"media-{kind}-{decode_s:g}s.mp4"
                row = stream_mp4(path, kind, args.media_frames, 1344, 768, decode_s, device,
                                 audio_first=args.media_audio == "first", grain=args.media_grain,
                                 **({"x264_params": params} if params else {}))
                row.update(probe_mp4(path))
                rec(stage="media", what=f"MP4 {kind} 1344x768x{args.media_frames}, decode {decode_s:g} s",
                    ours_s=row["close_latency_s"], ok=row["close_latency_s"] <= 0.3, **row)
                path.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="ceil,attn,kernels,dit,vae,audio,te")
    p.add_argument("--ref-blocks", type=int, default=8)
    p.add_argument("--attention", default=None)
    p.add_argument("--vae-batches", default="8", help="comma-separated decode batch sizes to time")
    p.add_argument("--forwards", type=int, default=4)
    p.add_argument("--e2e-reps", type=int, default=1)
    p.add_argument("--e2e-canvases", default="1344x768x243", help="e2e: comma-separated WxHxFRAMES")
    p.add_argument("--e2e-vsa", action="store_true", help="e2e: also render with VSA (random gates) after dense")
    p.add_argument("--save-latents", action="store_true", help="e2e: also write the final latents beside the MP4")
    p.add_argument("--ulysses-chunks", default="1,2,4", help="head chunks per rank to time in the ulysses stage")
    p.add_argument("--batch-canvas", default="1344x768x243", help="WxHxFRAMES of every queued job (batch stage)")
    p.add_argument("--batch-jobs", type=int, default=4)
    p.add_argument("--batch-model", default="released", choices=["released", "tiny", "small"],
                   help="released: random real-size components on the GPU; tiny/small: the built-in random models")
    p.add_argument("--batch-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--batch-warmup", type=int, default=1, help="untimed jobs rendered before the two queues")
    p.add_argument("--batch-out", default="/tmp/h3render-bench-batch")
    p.add_argument("--audio-latents", type=int, default=405, help="audio stage: latents per channel (405 = 10.125 s)")
    p.add_argument("--audio-reps", type=int, default=25, help="audio stage: timed calls per variant (median)")
    p.add_argument("--audio-compile-modes", default="none",
                   help="audio stage: comma-separated torch.compile modes to try after eager and CUDA graph, e.g. "
                        "max-autotune-no-cudagraphs (its autotuning can take minutes); 'none' skips")
    p.add_argument("--media-kinds", default="moving,noise", help="media stage: content kinds (moving, noise)")
    p.add_argument("--media-decode-s", default="4.08,7.07",
                   help="media stage: simulated decode seconds for the whole clip (2-GPU split 4.08, 1 GPU 7.07)")
    p.add_argument("--media-frames", type=int, default=243)
    p.add_argument("--media-audio", choices=("first", "last"), default="first",
                   help="media stage: hand the soundtrack to the writer before the first frame (what the Engine "
                        "does) or after the last (what it did before: AAC then runs inside the close)")
    p.add_argument("--media-grain", type=float, default=0.01, help="media stage: grain std of 'moving' content")
    p.add_argument("--media-x264-params", default="default",
                   help="media stage: ';'-separated x264-params variants to compare ('default' = the writer's)")
    p.add_argument("--media-dir", default="/tmp/h3render-media", help="media stage: where the MP4s are written")
    p.add_argument("--vsa-layer-only", action="store_true", help="vsa stage: one layer only, no DiT forward")
    p.add_argument("--vsa-sparsity", type=float, default=0.9, help="vsa stage: sparsity (FastH3 v1 0.9, V2 0.8)")
    p.add_argument("--fl2va-canvas", default="1344x768x243", help="fl2va stage: WxHxFRAMES")
    p.add_argument("--fl2va-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--fl2va-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--fl2va-forwards", type=int, default=49, help="fl2va stage: DiT forwards of the job (49 = base)")
    p.add_argument("--fl2va-reps", type=int, default=3, help="fl2va stage: timed calls per measurement (median)")
    p.add_argument("--fl2va-te", type=int, default=1, help="fl2va stage: 0 skips the text encoder (≈ 50 GB)")
    p.add_argument("--out", default=None)
    import bench_e2e  # scripts/ is sys.path[0] when run as a script
    import bench_fp8

    bench_fp8.add_arguments(p)
    bench_e2e.add_arguments(p)
    args = p.parse_args()
    args.vae_batches = [int(x) for x in args.vae_batches.split(",")]
    args.ulysses_chunks = [int(x) for x in args.ulysses_chunks.split(",")]
    args.audio_compile_modes = args.audio_compile_modes.split(",")
    args.media_decode_s = [float(x) for x in args.media_decode_s.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available()
    rec(stage="env", gpu=torch.cuda.get_device_name(0) if cuda else None, torch=torch.__version__,
        gpus=torch.cuda.device_count() if cuda else 0, cpus=os.cpu_count())
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            globals()[f"stage_{name.replace('-', '_')}"](args)
        except Exception as exc:  # keep the other stages' numbers
            import traceback

            traceback.print_exc()
            rec(stage=name, error=f"{type(exc).__name__}: {exc}"[:400])
        rec(stage=name, what="stage wall", seconds=round(time.perf_counter() - t0, 1))
        if cuda:
            torch.cuda.empty_cache()
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    if int(os.environ.get("RANK", "0")) == 0:
        print_table()


def print_table() -> None:
    print("\n| stage | what | ours (s) | ref (s) | speedup | TFLOP/s | rel err | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in RESULTS:
        what = r.get("what") or r.get("kernel") or r.get("backend")
        if what is None or what == "stage wall":
            continue
        err = r.get("rel_err", r.get("rel_err_video"))
        err = f"{err:.1e}" if isinstance(err, float) else (err or "")
        ours = r.get("ours_s", r.get("wall_s", r.get("triton_ms", r.get("seconds", ""))))
        print(f"| {r['stage']} | {what} | {ours} | {r.get('ref_s', r.get('naive_ms', ''))} | "
              f"{r.get('speedup', '')} | {r.get('tflops', r.get('TFLOPs', ''))} | {err} | "
              f"{r.get('peak_gb', r.get('peak_gb_ours', r.get('gb', '')))} |")


if __name__ == "__main__":
    main()
