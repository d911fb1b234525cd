"""The longclip stage of scripts/bench.py (issue #24): a clip longer than one pass, rendered as windowed continuation
(`h3render.windows`, `tasks/continuation.py`) by the real Engine into one MP4.

Default: 30 s at 1344x768 on a FastH3 VSA student in FP8 with random weights: an fp8 engine of random released-size
components (scripts/bench_e2e.py `_build`), VSA at --vsa-sparsity with random gates (`enable_random_vsa_`), the
FastH3 release schedule (4 forwards) as the engine's student schedule. A FastH3 clip renders plain t2va windows
(students are t2va-only), joined by the cross-fade. `--longclip-conditioned` instead renders base-mode windows
conditioned on the previous window's tail (dense attention, `--forwards` forwards).

Rows: the plan; one row per window (seconds from its start to its latents, to its frames in the writer, and its peak
device memory, which must not grow with the window count); the overlap's overhead (frames rendered twice, and its
share of the window times); the complete MP4 (wall time from `render` to the sidecar, the sidecar's stages, peak).
Warm-up (prepare, one forward per window shape for the VSA tile plan and Triton specializations) is untimed.

CPU smoke (tests/unit/test_bench_longclip.py): `--longclip-model tiny --longclip-device cpu --longclip-canvas 160x128
--longclip-duration 1.8 --longclip-window 39 --longclip-overlap 5 --vsa-sparsity 0.75`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench_fp8 import enable_random_vsa_, peak_gb, reset_peak


def add_arguments(p) -> None:
    """This module's flags on scripts/bench.py's parser."""
    p.add_argument("--longclip-duration", type=float, default=30.0, help="longclip: seconds of the clip")
    p.add_argument("--longclip-canvas", default="1344x768", help="longclip: WxH")
    p.add_argument("--longclip-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--longclip-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--longclip-precision", default="fp8", choices=["bf16", "fp8"])
    p.add_argument("--longclip-window", type=int, default=None,
                   help="longclip: longest window in frames (17n+5; default h3render.windows.default_window: 345)")
    p.add_argument("--longclip-overlap", type=int, default=None, help="longclip: overlap frames (17j+5; default 22)")
    p.add_argument("--longclip-conditioned", action="store_true",
                   help="longclip: base-mode windows conditioned on the previous tail (dense) instead of FastH3 VSA")
    p.add_argument("--longclip-dir", default="/tmp/h3render-longclip", help="longclip: where the MP4 is written")


@torch.no_grad()
def run(args, bench) -> None:
    import bench_e2e
    from bench_common import parse_canvas

    from h3render.checkpoint.contract import fasth3_schedule
    from h3render.jobs import Job, Requested
    from h3render.parallel.groups import init_parallel
    from h3render.spec import FPS
    from h3render.tasks import windows_of
    from h3render.windows import DEFAULT_OVERLAP, default_window

    ctx = init_parallel(args.longclip_device)
    device = ctx.device
    width, height, _ = parse_canvas(f"{args.longclip_canvas}x22")
    build = SimpleNamespace(e2e_checkpoint=None, e2e_model=args.longclip_model, vae_batches=args.vae_batches,
                            attention=args.attention, save_latents=False)
    engine = bench_e2e._build(build, bench, ctx, args.longclip_precision, "longclip")
    info = engine.c.info
    frames = round(args.longclip_duration * FPS)
    window = args.longclip_window or default_window(info.limits())
    overlap = args.longclip_overlap or DEFAULT_OVERLAP
    if args.longclip_conditioned:
        mode, steps, attention = "t2va", args.forwards + 1, "dense"
    else:  # a FastH3 VSA student: its schedule and random VSA gates on the random weights
        engine.fasth3 = fasth3_schedule(None, info.video_shift, info.audio_shift)
        enable_random_vsa_(engine.c.dit, args.vsa_sparsity, seed=1)
        mode, steps, attention = "fasth3", None, f"vsa {args.vsa_sparsity}"
    job = Job(id="longclip", prompt=bench.PROMPT, width=width, height=height, frames=frames, seed=0, steps=steps,
              mode=mode, output="longclip", window=window, overlap=overlap,
              requested=Requested(duration=args.longclip_duration))
    windows, plan = windows_of(job)
    bench.rec(stage="longclip", what=f"plan: {job.time_note()}", frames=frames, window=window, overlap=overlap,
              windows=[w.to_dict() | {"frames": w.frames} for w in plan], attention=attention,
              precision=args.longclip_precision, schedule=engine.schedule(windows[0]).to_dict()["source"])
    t0 = time.perf_counter()
    engine.prepare([job])
    for shape in {w.frames: w for w in windows[:1] + windows[-1:]}.values():  # the window shapes: untimed forwards
        bench_e2e._warm_forward(engine, shape)
    bench.rec(stage="longclip", what="warm-up (outside the timings)", seconds=round(time.perf_counter() - t0, 2),
              warmup={k: v for k, v in engine.warmup.items() if k.endswith("_s") or k.endswith("failed")})
    out = Path(args.longclip_dir) / "longclip.mp4"
    out.parent.mkdir(parents=True, exist_ok=True)
    reset_peak(device)
    t0 = time.perf_counter()
    engine.render(job, out, out.with_suffix(".json"))
    wall = time.perf_counter() - t0
    if not ctx.is_main:
        return
    side = json.loads(out.with_suffix(".json").read_text())
    listed = side["extra"]["windows"]
    shared = 0.0
    for w, entry in zip(plan, listed):
        seconds = entry["delivered_s"] - entry["started_s"]
        shared += seconds * w.overlap / w.frames  # the overlap's share of this window's work
        bench.rec(stage="longclip", what=f"window {w.index}: {w.frames} frames ({w.overlap} overlap)",
                  seconds=round(seconds, 3), generate_s=round(entry["generated_s"] - entry["started_s"], 3),
                  deliver_s=round(entry["delivered_s"] - entry["generated_s"], 3),
                  peak_gb=bench.gb(entry["peak_memory_bytes"]) if entry["peak_memory_bytes"] else None,
                  task=entry["task"], seed=entry["seed"])
    peaks = [e["peak_memory_bytes"] for e in listed if e["peak_memory_bytes"]]
    rendered = sum(w.frames for w in plan)
    bench.rec(stage="longclip", what="overlap overhead", extra_frames=rendered - frames,
              extra_fraction=round(rendered / frames - 1, 4), overlap_s=round(shared, 3),
              overlap_share=round(shared / max(wall, 1e-9), 4),
              peak_growth_gb=bench.gb(peaks[-2] - peaks[0]) if len(peaks) > 2 else None)
    timings = side["timings"]
    bench.rec(stage="longclip", what=f"complete MP4 {width}x{height}, {frames} frames ({args.longclip_duration:g} s), "
                                     f"{len(plan)} windows, {args.longclip_precision}, {attention}",
              wall_s=round(wall, 2), seconds_per_video_second=round(wall / args.longclip_duration, 3),
              stages={k: round(v["seconds"], 3) for k, v in timings["stages"].items()},
              peak_gb=bench.gb(timings["peak_memory_bytes"]) if timings.get("peak_memory_bytes")
              else peak_gb(bench, device), frames_written=side["extra"]["frames_written"],
              mp4_bytes=out.stat().st_size)
