"""The e2e and fp8-memory stages of scripts/bench.py: the real Engine per `--precision` (bf16, fp8; issue #18).

  fp8-memory  every component loaded with random weights, per `--precision`: resident GB per component, load peak.
  e2e         complete MP4s of `--e2e-canvases` for each of `--precision`, one engine at a time (a bf16 engine,
              97 GB, and an fp8 one do not fit one H200 together; the first is freed before the second loads):
              `--e2e-attention` (default dense, then VSA with random gates when `--e2e-vsa`), all components
              resident; run under torchrun for several GPUs. Each job once per `--e2e-content` kind (noise: the
              random weights' decode; moving: a moving scene painted over each decoded chunk, scripts/bench_content.py),
              and, when one paints, the decode alone at the job's canvas (`decode_alone_s`, the floor of vae_video).

Random components (`random_components`): tensors made on the target device (no host copy) with bench.random_'s
scales, streamed through `checkpoint.load.assemble_components` with `precision=`, which is how `Engine.load` loads a
checkpoint (the FP8 quantization happens in the loader, part by part). `Engine.load` itself takes a path or a built-in
tiny model: a released-size random checkpoint would need 118 GB of disk or minutes of host RNG. `--e2e-checkpoint
PATH` runs `Engine.load(RunSettings(checkpoint=PATH, precision=...), ctx)` instead. CPU smoke (tests/unit/test_bench_fp8.py): `--e2e-model
tiny --e2e-device cpu --e2e-canvases 160x128x22`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import zlib
from pathlib import Path

import torch

from bench_content import content
from bench_fp8 import (allocated_gb, enable_random_vsa_, free_memory, parse_canvas, peak_gb, reset_peak, sync,
                       tensor_bytes)


def add_arguments(p) -> None:
    """This module's flags on scripts/bench.py's parser."""
    p.add_argument("--precision", default="bf16",
                   help="e2e / fp8-memory: comma-separated precisions (bf16, fp8), run one after the other")
    p.add_argument("--e2e-model", default="released", choices=["released", "tiny", "small"],
                   help="e2e / fp8-memory: random components of this release (tiny: the CPU smoke run)")
    p.add_argument("--e2e-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--e2e-checkpoint", default=None,
                   help="e2e / fp8-memory: Engine.load of PATH (at each --precision) instead of random components")
    p.add_argument("--e2e-attention", default=None,
                   help="e2e: comma-separated dense,vsa (default: dense, then vsa with --e2e-vsa)")
    p.add_argument("--e2e-dir", default="/tmp", help="e2e: where the MP4s (noise: large) and sidecars are written")
    p.add_argument("--e2e-vsa-kernels", default="current",
                   help="e2e: comma-separated variants of the vsa rows, for a before/after in one engine: current, "
                        "bf16-qk (this tree with the fine stage's QK^T in bf16: main before issue 26's twelfth-"
                        "session work), session12 (this tree with the video VAE decoder's FP8 FFN as at the "
                        "thirteenth session's start: Inductor's own SwiGLU quantization, no fused kernel), uncapped "
                        "(this tree with the VSA TMA kernel's autotuner over the thirteenth session's uncapped "
                        "settings: 4 warps x 2, 3, 4 stages), head-order (this tree with the fine kernels' programs "
                        "head by head, not the dense query tiles first: main before the fifteenth session), "
                        "exact-accum (this tree with every FP8 GEMM of the DiT promoting to fp32: no "
                        "models.fp8.DIT_FAST_ACCUM, main before the fifteenth session), vae-exact (this tree with "
                        "the video VAE decoder's FP8 GEMMs promoting to fp32: main before the sixteenth session), "
                        "gate-exact (this tree with the VSA gates' FP8 GEMMs promoting to fp32: the same), "
                        "session16 (this tree with the seventeenth session's work off: the radix tile selection, the "
                        "coarse output GEMM in fp32, the video VAE decoder's q/k norm + RoPE and residual + norm + "
                        "FP8 quantization in torch ops (as Inductor fused them then; since the twenty-fifth "
                        "session the FP8 decoder runs eagerly, so these run unfused): main before the seventeenth "
                        "session), "
                        "session17 (this tree with the eighteenth session's work off: the FP8 GEMMs' bias added in "
                        "a pass of its own after the bf16 rounding: main before the eighteenth session), "
                        "session18 (this tree with the nineteenth session's work off: the FP8 modulate kernel's "
                        "one-row, 16-warp launch, kernels.modulate.triton_impl.LAUNCH = None, the DiT's v copied "
                        "to packed rows and gathered into tile order, models.dit.Attention.vsa_v_tiles = False, and "
                        "VSA's tile means pooled apart, models.dit.Attention.vsa_fused_prep = False), unfused-prep "
                        "(this tree with VSA's tile means pooled apart: qk_norm_rope, then three pool passes over q, "
                        "k, v instead of the one kernels.vsa.vsa_prep pass, models.dit.Attention.vsa_fused_prep = "
                        "False), eager-text (this tree with the prompt encode run eagerly, not replayed from its CUDA "
                        "graph: Engine.text_graphs disabled; the padding stays, main before the twenty-first session "
                        "but for it), padded-vae (this tree with a compiled (bf16) video decoder running --vae-batch "
                        "items a forward, the last batch padded: VideoVAE.batch_for off, main before the twenty-third "
                        "session; an eager FP8 decoder never pads)")
    p.add_argument("--e2e-prof-decode", action="store_true",
                   help="e2e (with moving content): one more decode alone of each canvas under the profiler, its top "
                        "kernels recorded (against the same VAE built alone: the prof stage's --prof-vae)")
    p.add_argument("--e2e-content", default="noise",
                   help="e2e / memplans: comma-separated pictures each job is rendered with, in this order: noise "
                        "(what the random weights decode), moving (the real decode, each chunk then painted with "
                        "a moving scene: x264 at a footage's rate; scripts/bench_content.py)")


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
    """bench.random_'s scales (norm gains 1 + N(0, 0.01), other vectors N(0, 4e-4), matrices N(0, 0.25 / fan_in))
    from a generator on `device` seeded by (seed, name), rounded to the release storage dtype."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    x = torch.randn(shape, device=device, generator=gen)
    if len(shape) <= 1:
        x = 1.0 + 0.1 * x if "norm" in name else 0.02 * x
    else:
        x = x * (0.5 / (x[0].numel() ** 0.5))
    return x.to(dtype)


def random_components(name: str, device: torch.device, dtype: torch.dtype, precision: str, seed: int = 0,
                      parts: tuple[str, ...] = ("dit", "video_vae", "audio_vae", "text_encoder"), adaln_device=None,
                      prefetch: bool = False):
    """The `parts` (default all four components) of release `name` with random weights made on `device`, loaded by
    `checkpoint.load.assemble_components` (the function `Engine.load` reaches) with `precision`; with `prefetch` the
    compile stack's import starts once the imports below are done (`h3render.compile_prefetch`, as in Engine.load)."""
    from h3render.checkpoint.builtin import STORAGE_DTYPES
    from h3render.checkpoint.builtin import tiny_vl_tokenizer
    from h3render.checkpoint.info import CheckpointInfo
    from h3render.checkpoint.load import assemble_components
    from h3render.checkpoint.releases import RELEASES
    from h3render.checkpoint.stream import Entry, parameters_on_meta
    from h3render.models.audio_vae import AudioVAE
    from h3render.models.dit import DiT
    from h3render.models.text_encoder import TextEncoder
    from h3render.models.video_vae import VideoVAE

    if prefetch:
        from h3render import compile_prefetch

        compile_prefetch.start(device)
    release = RELEASES[name]
    makers = {"dit": lambda: DiT(release.dit), "video_vae": lambda: VideoVAE(release.video_vae),
              "audio_vae": lambda: AudioVAE(release.audio_vae),
              "text_encoder": lambda: TextEncoder(release.text_config, release.text_read_layer)}

    def source(part: str):
        with parameters_on_meta():
            template = makers[part]()  # module names = the loader's names (text: the read layers only)
        where, storage = f"<random {name} {part} on {device.type}>", STORAGE_DTYPES[part]
        for key, t in template.state_dict().items():
            if t.is_meta:
                def load(key=key, shape=tuple(t.shape), d=storage(key)):
                    return _random_tensor(f"{part}.{key}", shape, d, device, seed)
            else:
                def load(t=t, d=storage(key)):
                    return t.to(device, d)
            yield Entry(where, key, load)

    info = CheckpointInfo(path=f"random-{name}", layout="builtin", release=release)
    return assemble_components(info, source, lambda part: f"<random {name} {part}>", lambda: tiny_vl_tokenizer(512),
                               device, dtype, parts=parts, precision=precision, adaln_device=adaln_device)


def component_bytes(components, device: torch.device) -> dict:
    """Resident bytes per component on `device` (AdaLN projections on the host not counted)."""
    return {part: tensor_bytes(getattr(components, part), device)
            for part in ("text_encoder", "dit", "video_vae", "audio_vae") if getattr(components, part) is not None}


def _memory_fields(bench, components, device: torch.device) -> dict:
    sizes = component_bytes(components, device)
    return {"components_gb": {k: bench.gb(v) for k, v in sizes.items()}, "components_bytes": sizes,
            "components_total_gb": bench.gb(sum(sizes.values()))}


def _precisions(args) -> list[str]:
    from h3render.spec import check_precision

    return [check_precision(p.strip()) for p in args.precision.split(",") if p.strip()]


def compile_prefetch_for(args, device, precision: str) -> bool:
    """Whether a random-weight engine starts the compile stack's import beside its load, as `Engine.load` does
    (`compile_prefetch.wanted`), unless `--no-compile-prefetch`."""
    from h3render import compile_prefetch

    return compile_prefetch.wanted(device.type, True, precision) and not getattr(args, "no_compile_prefetch", False)


def _build(args, bench, ctx, precision: str, stage: str):
    """An Engine of `precision` (random components, or `--e2e-checkpoint` through `Engine.load`), with its load
    time and peak recorded."""
    from h3render.engine import Engine
    from h3render.settings import RunSettings

    device = ctx.device
    # bf16 on CUDA; fp32 on CPU for both precisions, so the CPU smoke compares like with like (the CLI would run
    # fp8 with bf16 activations there: `settings.precision_problem`).
    settings = RunSettings(checkpoint=args.e2e_checkpoint or f"random-{args.e2e_model}", precision=precision,
                           device=device.type, dtype="bf16" if device.type == "cuda" else "fp32",
                           vae_batch=args.vae_batches[-1], attention=args.attention, progress=False,
                           save_latents=getattr(args, "save_latents", False))
    reset_peak(device)
    t0 = time.perf_counter()
    if args.e2e_checkpoint:
        engine = Engine.load(settings, ctx)
    else:
        # as Engine.load does, after the loader's imports (`random_components`), beside the weights' making; not for
        # fp8, whose decoder blocks are not compiled (`VideoVAE.compile_pays`)
        prefetch = compile_prefetch_for(args, device, precision)
        components = random_components(args.e2e_model, device, settings.torch_dtype, precision, prefetch=prefetch)
        sync(device)
        engine = Engine(components, ctx, settings, load_seconds=time.perf_counter() - t0)
    from h3render.models.fp8 import precision_report

    bench.rec(stage=stage, what=f"{precision}: components loaded", precision=precision,
              source=args.e2e_checkpoint or f"random {args.e2e_model} ({device.type})",
              seconds=round(time.perf_counter() - t0, 1), load_peak_gb=peak_gb(bench, device),
              gb=allocated_gb(bench, device), **_memory_fields(bench, engine.c, device),
              report=precision_report(engine.c))
    return engine


def _teardown(bench, device: torch.device, stage: str, precision: str) -> None:
    """After the caller dropped its engine: free it so the next precision's fits (its modules, the compiled VAE
    blocks, the audio decode's CUDA graphs) and record what is left allocated."""
    gc.collect()
    torch._dynamo.reset()  # compiled VAE blocks hold guards on the old modules
    free_memory(device)
    bench.rec(stage=stage, what=f"{precision}: engine freed", precision=precision,
              gb=allocated_gb(bench, device))


@torch.no_grad()
def stage_memory(args, bench) -> None:
    """Per `--precision`: load all components (random, through the loader) and report what stays resident."""
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel(args.e2e_device)
    for precision in _precisions(args):
        engine = _build(args, bench, ctx, precision, "fp8-memory")
        del engine
        _teardown(bench, ctx.device, "fp8-memory", precision)


@torch.no_grad()
def stage_e2e(args, bench) -> None:
    """Complete MP4s through the real Engine, per `--precision` one engine at a time: for each canvas of
    --e2e-canvases dense attention and, with --e2e-vsa, VSA at --vsa-sparsity with random gates (a FastH3 VSA
    student's attention; same engine, gates added after the dense jobs)."""
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel(args.e2e_device)
    device = ctx.device
    canvases = [parse_canvas(c) for c in args.e2e_canvases.split(",")]
    attentions = (args.e2e_attention or "dense" + (",vsa" if args.e2e_vsa else "")).split(",")
    if set(attentions) - {"dense", "vsa"}:
        raise ValueError(f"--e2e-attention: expected dense and/or vsa, got {args.e2e_attention!r}")
    jobs = [Job(id="bench", prompt=bench.PROMPT, width=w, height=h, frames=f, seed=0, steps=args.forwards + 1,
                mode="t2va", output="bench") for w, h, f in canvases]
    contents, scenes = content_scenes(args, device, canvases)
    for precision in _precisions(args):
        engine = _build(args, bench, ctx, precision, "e2e")
        engine.prepare(jobs)
        bench.rec(stage="e2e", what=f"{precision}: warm-up (outside job timings)", precision=precision,
                  warmup=engine.warmup)
        bench.rec(stage="e2e", what=f"{precision}: resident after AdaLN offload", precision=precision,
                  gb=allocated_gb(bench, device), world=ctx.world_size,
                  **_memory_fields(bench, engine.c, device))
        # random weights encode as noise: too big to bring back. `compare` pairs the files of one stem (precision
        # and canvas) across world sizes: `e2e[-fp8]-<W>x<H>x<F>-w<N>.*`, one set per canvas.
        stem = "e2e" if precision == "bf16" else f"e2e-{precision}"
        Path(args.e2e_dir).mkdir(parents=True, exist_ok=True)
        floors: dict = {}
        runs = [(a, kernels) for a in attentions for kernels in (vsa_variants(args) if a == "vsa" else ["current"])]
        for attention, kernels in runs:
            if attention == "vsa":
                enable_random_vsa_(engine.c.dit, args.vsa_sparsity, seed=1)
                with vsa_kernels(kernels, engine):
                    for job in jobs:  # the first VSA forward at a shape builds its tile plan (host syncs), and
                        _warm_forward(engine, job)  # each kernel variant autotunes there: untimed
            else:
                engine.c.dit.vsa_sparsity = None  # dense (gates, if made earlier, stay unused)
            for job in jobs:
                canvas = (job.width, job.height, job.frames)  # every job's id is "bench"
                out = Path(args.e2e_dir) / f"{stem}-{job.width}x{job.height}x{job.frames}-w{ctx.world_size}.mp4"
                if scenes is not None and (canvas, kernels) not in floors:
                    with vsa_kernels(kernels, engine):
                        # Twice: a variant's first decode may recompile the decoder blocks; the second is the floor.
                        first = decode_alone(engine, job)
                        floors[canvas, kernels] = decode_alone(engine, job)
                    bench.rec(stage="e2e", what=f"decode alone {job.width}x{job.height}x{job.frames}, {precision}"
                              + ("" if kernels == "current" else f", VSA kernels {kernels}"),
                              first_s=round(first, 3), second_s=round(floors[canvas, kernels], 3),
                              **(_profiled(lambda: decode_alone(engine, job)) if args.e2e_prof_decode else {}))
                floor = floors.get((canvas, kernels))
                for kind, rep in [(kind, rep) for kind in contents for rep in range(args.e2e_reps)]:
                    reset_peak(device)
                    t0 = time.perf_counter()
                    with content(engine, kind, scenes) as shown, vsa_kernels(kernels, engine):
                        engine.render(job, out, out.with_suffix(".json"))
                    wall = time.perf_counter() - t0
                    if not ctx.is_main:
                        continue
                    side = json.loads(out.with_suffix(".json").read_text())
                    timings = side["timings"]
                    stages = {k: round(v["seconds"], 3) for k, v in timings["stages"].items()}
                    bench.rec(stage="e2e", what=f"complete MP4 {job.width}x{job.height}x{job.frames}, {args.forwards} "
                                                f"forwards, {precision}, {attention}, {ctx.world_size} "
                                                f"{'GPU' if device.type == 'cuda' else 'CPU'}(s), {kind}, rep {rep}"
                                                + ("" if kernels == "current" else f", VSA kernels {kernels}"),
                              precision=precision, attention=attention, vsa_kernels=kernels, wall_s=round(wall, 2),
                              stages=stages,
                              **shown, **media_record(side, out, floor),
                              denoise_steps=[round(x, 3) for x in timings["stages"]["denoise"]["steps"]],
                              # the job's peak from its sidecar: the stage timer resets the device's counter at
                              # each stage, so max_memory_allocated() here is the last stage's (vae_video) alone
                              peak_gb=bench.gb(timings["peak_memory_bytes"]) if timings.get("peak_memory_bytes")
                              else peak_gb(bench, device), stage_peak_gb={
                                  k: bench.gb(v) for k, v in (timings.get("stage_peak_memory_bytes") or {}).items()},
                              mp4_bytes=out.stat().st_size)
        del engine
        _teardown(bench, device, "e2e", precision)


def vsa_variants(args) -> list[str]:
    """`--e2e-vsa-kernels`: "current" (the tree's defaults) and/or "bf16-qk" (the same with the fine stage's QK^T in
    bf16, as main before the twelfth session's int8 QK^T), for a before/after in one call."""
    variants = [v.strip() for v in args.e2e_vsa_kernels.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        raise ValueError(f"--e2e-vsa-kernels: expected some of {', '.join(VARIANTS)}, got {args.e2e_vsa_kernels!r}")
    return variants


VARIANTS = ("current", "bf16-qk", "session12", "uncapped", "head-order", "exact-accum", "vae-exact", "gate-exact",
            "session16", "session17", "session18", "unfused-prep", "eager-text", "padded-vae")
_UNCAPPED_PICKS: dict = {}  # the "uncapped" variant's autotuner picks, apart from the tree's own


@contextlib.contextmanager
def vsa_kernels(variant: str, engine):
    """Run the kernels of `variant` inside the block (the engine's settings patched and restored)."""
    from bench_fp8 import accumulation

    from h3render.kernels import vsa
    from h3render.kernels.vsa import select_triton, triton_impl
    from h3render.models import fp8
    from h3render.models.video_vae import FeedForward, VideoVAE, ViTAttention, ViTBlock

    dit = engine.c.dit
    saved = dit.vsa_qk_int8, FeedForward.fused_fp8, triton_impl.LONG_FIRST
    saved16 = select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8
    saved17 = fp8.BIAS_EPILOGUE
    # session18: the nineteenth session's switches (the FP8 modulate launch, v written in tile order, the tile means
    # from the prep pass); unfused-prep: the last alone
    from h3render.kernels.modulate import triton_impl as modulate_impl
    from h3render.models.dit import Attention

    saved18 = modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep
    saved23 = VideoVAE.batch_for
    if variant == "padded-vae":
        VideoVAE.batch_for = lambda self, num_items, batch_size: batch_size
    graphs = getattr(engine, "text_graphs", None)  # (the bench's tests pass an engine without one)
    saved21 = graphs.enabled if graphs is not None else None
    if variant == "eager-text" and graphs is not None:
        graphs.enabled = False
    dit.vsa_qk_int8 = saved[0] and variant != "bf16-qk"
    triton_impl.LONG_FIRST = saved[2] and variant != "head-order"
    # session16 and session12 switch decoder kernels off: the FP8 decoder then runs the torch forms eagerly (it is not
    # compiled since docs/performance.md §35.3), not compiled as when those sessions measured their before-rows
    if variant == "session16":
        select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8 = (
            "radix", False, False, False)
    if variant == "session17":
        fp8.BIAS_EPILOGUE = False
    if variant == "session18":  # (the DiT runs eager, no graphs: each call reads the switches)
        modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep = None, False, False
    if variant == "unfused-prep":
        Attention.vsa_fused_prep = False
    if variant == "session12":
        FeedForward.fused_fp8 = False
    tuner = tuned = None
    if variant == "uncapped":  # timed on the variant's first call (the untimed warm-up forward), then kept apart
        import triton

        from h3render.kernels.vsa.triton_hopper import _fine_tma_tuned as tuner

        tuned = tuner.configs, tuner.cache
        tuner.configs = [triton.Config({}, num_warps=4, num_stages=st) for st in (2, 3, 4)]
        tuner.cache = _UNCAPPED_PICKS
    try:
        vae = getattr(engine.c, "video_vae", None) or torch.nn.Identity()  # (the bench's tests pass a DiT alone)
        gates = torch.nn.ModuleList(b.attn.gate_proj for b in dit.blocks if b.attn.gate_proj is not None)
        with (accumulation(dit, False if variant == "exact-accum" else None),
              accumulation(gates, False if variant == "gate-exact" else None),
              accumulation(vae, False if variant == "vae-exact" else None)):  # decode_alone takes the recompile
            yield
    finally:
        dit.vsa_qk_int8, FeedForward.fused_fp8, triton_impl.LONG_FIRST = saved
        select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8 = saved16
        fp8.BIAS_EPILOGUE = saved17
        modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep = saved18
        VideoVAE.batch_for = saved23
        if graphs is not None:
            graphs.enabled = saved21
        if tuner is not None:
            tuner.configs, tuner.cache = tuned


def content_scenes(args, device: torch.device, canvases) -> tuple[list[str], "MovingScenes | None"]:
    """`--e2e-content`'s kinds and, when one paints, the moving scene of every canvas, made before any timing."""
    from bench_content import MovingScenes, parse_contents

    kinds = parse_contents(args.e2e_content)
    if kinds == ["noise"]:
        return kinds, None  # today's rows, nothing allocated
    scenes = MovingScenes(device)
    for width, height, _ in canvases:
        scenes.prepare(height, width)
    sync(device)
    return kinds, scenes


@torch.no_grad()
def _profiled(fn) -> dict:
    """`fn()` once under the CUDA profiler: its seconds, kernel launches and top kernels (`bench_dit._top_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    from bench_dit import _top_kernels

    # (a CPU run, the bench's smoke test, records no kernels: the profiler needs some activity)
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        seconds = fn()
    return {"profiled_s": round(seconds, 3), "kernels": _top_kernels(prof, 25),
            "launches": sum(e.count for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0)}


def decode_alone(engine, job) -> float:
    """Seconds to drain the engine's video decode stream at `job`'s canvas with nothing taking the chunks: the floor
    of the render's `vae_video` (what is above it is the media path's time on the critical path). The latent is
    random `[24, T, H/16, W/16]`: the decode does the same work for any values."""
    from h3render.spec import SPATIAL_COMPRESSION, latent_frames

    device, vae = engine.device, engine.c.video_vae
    latent = torch.randn(vae.config.latent_channels, latent_frames(job.frames), job.height // SPATIAL_COMPRESSION,
                         job.width // SPATIAL_COMPRESSION, device=device)
    with engine.vae_on_device():
        sync(device)
        t0 = time.perf_counter()
        for _ in engine.plan.decode_stream(vae, latent, engine.settings.vae_batch):
            pass
        sync(device)
    return time.perf_counter() - t0


def media_record(side: dict, out: Path, decode_alone_s: float | None) -> dict:
    """A render row's media fields from its sidecar: the writer's durations (`extra.writer`: `blocked_s` is the
    decode loop held by the writer's full queue), the MP4's bit rate, and, given the decode alone, how far
    `vae_video` sat above it (`media_on_critical_path_s`)."""
    from h3render.spec import FPS

    stages = side["timings"]["stages"]
    seconds = side["job"]["frames"] / FPS
    record = {"writer": {k: round(v, 3) for k, v in side["extra"]["writer"].items()},
              "mbit_s": round(8 * out.stat().st_size / seconds / 1e6, 1)}
    if decode_alone_s is not None:
        record.update(decode_alone_s=round(decode_alone_s, 3),
                      media_on_critical_path_s=round(stages["vae_video"]["seconds"] - decode_alone_s, 3))
    return record


def _warm_forward(engine, job) -> None:
    """One DiT forward of `job`'s own layout, as `render` builds it (encoded prompt length, canvas, frames): its
    first-call costs (the VSA tile plan, Triton specializations of the row count) stay out of the timed render."""
    from h3render.tasks import task_of
    from h3render.timing import StageTimer

    device = engine.device
    prepared = task_of(job).prepare(engine, job, StageTimer(device))  # the job's own rows, as render builds them
    tables = engine.tables(engine.schedule(job))
    t = tables.timesteps[0]
    engine.model_fn(prepared, tables)(prepared.video_rows, prepared.audio_rows, t, t)
    sync(device)
