"""The stages of scripts/bench.py that run the real Engine or compare its outputs: queue throughput (batch) and
1 GPU vs N GPUs (compare), with `released_engine`, the Engine over random real-size components."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench_common import PROMPT, build_on_gpu, gb, parse_canvas, random_, rec, released_dit


def released_engine(args, ctx):
    """The real Engine over random real-size components (text encoder 50 layers, DiT, both VAEs), all resident."""
    from h3render.checkpoint.builtin import tiny_tokenizer
    from h3render.checkpoint.info import CheckpointInfo
    from h3render.checkpoint.load import Components
    from h3render.checkpoint.releases import QWEN3VL_RELEASED, RELEASES
    from h3render.engine import Engine
    from h3render.models.audio_vae import AudioVAE
    from h3render.settings import RunSettings
    from h3render.models.text_encoder import TextEncoder
    from h3render.models.video_vae import VideoVAE

    release = RELEASES["released"]
    t0 = time.perf_counter()
    dit = released_dit(50)
    dit.offload_adaln_("cpu")  # where the loader puts them on CUDA (`checkpoint.load._adaln_home`): off the GPU
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
    settings = RunSettings(checkpoint="random-released", device=ctx.device.type, dtype="bf16",
                           vae_batch=args.vae_batches[-1], attention=args.attention, progress=False,
                           save_latents=getattr(args, "save_latents", False))  # <e2e-dir>/e2e-<canvas>-w<N>.latents.pt
    return Engine(comps, ctx, settings, load_seconds=build_s)


def stage_compare(args) -> None:
    """1 GPU vs N GPUs, same seed: the e2e stage's saved latents and MP4s in `--e2e-dir`, per stem (precision and
    canvas): e2e-<canvas>-w1.* against e2e-<canvas>-w<N>.* for bf16, e2e-fp8-<canvas>-w1.* against
    e2e-fp8-<canvas>-w<N>.* for fp8."""
    import av
    import numpy as np

    stems: dict[str, list[Path]] = {}
    for path in sorted(Path(getattr(args, "e2e_dir", "/tmp")).glob("e2e*-w*.latents.pt")):
        stems.setdefault(path.name.rsplit("-w", 1)[0], []).append(path)
    pairs = [(runs[0], other) for runs in stems.values() if runs[0].name.endswith("-w1.latents.pt")
             for other in runs[1:]]
    if not pairs:
        raise RuntimeError("run the e2e stage with --save-latents on 1 GPU and under torchrun first")
    for one, other in pairs:
        base, b = torch.load(one), torch.load(other)
        for key in ("video", "audio"):
            d = (base[key] - b[key]).double()
            rec(stage="compare", what=f"{one.name} vs {other.name}: {key} latents", max_abs=d.abs().max().item(),
                rel_err=float(d.norm() / base[key].double().norm()), max_ref=base[key].abs().max().item())

        def frames(path):
            with av.open(str(path)) as c:
                return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.int16)

        x = frames(one.with_name(one.name.replace(".latents.pt", ".mp4")))
        y = frames(other.with_name(other.name.replace(".latents.pt", ".mp4")))
        diff = np.abs(x - y)
        rec(stage="compare", what=f"{one.name} vs {other.name}: decoded frames (8-bit RGB)", frames=len(x),
            max_abs=int(diff.max()), mean_abs=float(diff.mean()), frac_equal=float((diff == 0).mean()))


def stage_batch(args) -> None:
    """Queue throughput on one GPU: `run_batch` over --batch-jobs jobs with one Engine (prepared and warmed once).
    Each job's MP4 tail (flush, trailer, fsync, rename, sidecar) runs on the writer's thread beside the next job's
    start; `tail_hidden_s` is the wall time the queue saved by that (the tails' seconds that ran beside the next
    job)."""
    import shutil

    from h3render.batch import run_batch
    from h3render.engine import Engine
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel
    from h3render.settings import RunSettings

    width, height, frames = parse_canvas(args.batch_canvas)
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
        settings = RunSettings(checkpoint=args.batch_model, device=device, vae_batch=args.vae_batches[-1],
                               attention=args.attention, progress=False)  # bf16 on CUDA, fp32 on the CPU
        engine = Engine.load(settings, ctx)
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


def _dynamo_graphs() -> int:
    """Graphs torch.compile has built so far in this process (a change between runs would be a recompile)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
