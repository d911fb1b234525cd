"""The memplans stage of scripts/bench.py (issue #27): the memory plans on one GPU capped with
`torch.cuda.set_per_process_memory_fraction`, the allocator's peak as the figure, against the uncapped resident run
of the same precision in the same call.

  memplans  for each run of `--memplans` (`PLAN:PRECISION[@GB]`, default the issue's rows: resident:bf16,
            phased:bf16@75, resident:fp8, phased:fp8@44, streamed:fp8@22, streamed:fp8@14): the text phase (phased,
            streamed: the text encoder alone, the job's prompt encoded into host memory, the encoder freed; its
            peak and seconds), then the complete MP4 of `--memplan-canvas` (default the 10.125 s 1344x768 clip) with
            `--forwards` DiT forwards and VSA at `--vsa-sparsity` (random gates: a FastH3 VSA render). Each row: wall
            and sidecar stage times, the job's allocator peak (sidecar `timings.peak_memory_bytes`) and per-stage
            peaks, the chooser's expected peak of that plan (`memplan.expected_phases`), the wall ratio to the
            uncapped run of its precision (run `resident:<precision>` first), whether the final latents equal the
            uncapped run's, the streamer's copies and the time one forward's block transfers take alone (with the
            host-to-device GB/s: what the side stream must hide); an OOM is a row saying so. Each run renders
            once per `--e2e-content` kind (scripts/bench_e2e.py), on the same engine, compared with the uncapped
            run of the same precision and content. Then
            `--memplan-queue` distinct prompts (default 16) through the text phase at each precision: seconds per
            prompt and the host memory the store holds.

Random components as in scripts/bench_e2e.py (made on the GPU, streamed through the loader at `precision`); the cap
is set after the components are built and placed (a streamed plan's blocks copied to pinned host memory), so it
covers the text phase and the render, not the bench's random-weight construction (a checkpoint load streams to the
host directly: `Engine.load`). CPU smoke (tests/unit/test_bench_memplans.py): `--memplan-model tiny
--memplan-device cpu --memplan-canvas 128x64x22 --forwards 1` (no cap off CUDA).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from bench_content import content
from bench_e2e import content_scenes, decode_alone, media_record, random_components
from bench_fp8 import enable_random_vsa_, free_memory, parse_canvas, peak_gb, reset_peak, sync

DEFAULT_RUNS = "resident:bf16,phased:bf16@75,resident:fp8,phased:fp8@44,streamed:fp8@22,streamed:fp8@14"


def add_arguments(p) -> None:
    """This module's flags on scripts/bench.py's parser."""
    p.add_argument("--memplans", default=DEFAULT_RUNS, help="memplans: comma-separated PLAN:PRECISION[@GB] runs")
    p.add_argument("--memplan-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--memplan-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--memplan-canvas", default="1344x768x243", help="memplans: WxHxFRAMES of the rendered job")
    p.add_argument("--memplan-queue", type=int, default=16,
                   help="memplans: prompts of the queue's text phase (0: none)")
    p.add_argument("--memplan-dir", default="/tmp/h3render-memplans", help="memplans: MP4s and sidecars")
    p.add_argument("--memplan-oom-sites", type=int, default=0,
                   help="memplans: on CUDA, record the allocator's history (slower) and, when a run runs out of "
                        "memory, list its N largest live allocation sites in the row")


def parse_runs(text: str) -> list[tuple[str, str, float | None]]:
    """`"phased:fp8@44,resident:bf16"` -> [("phased", "fp8", 44.0), ("resident", "bf16", None)]."""
    from h3render.memplan import PLANS

    runs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        head, _, cap = item.partition("@")
        plan, _, precision = head.partition(":")
        if plan not in PLANS or precision not in ("bf16", "fp8"):
            raise ValueError(f"--memplans: {item!r} is not PLAN:PRECISION[@GB] (plans {', '.join(PLANS)})")
        runs.append((plan, precision, float(cap) if cap else None))
    return runs


def live_sites(snapshot: dict, top: int) -> list[dict]:
    """The `top` allocation sites holding the most live device memory in an allocator snapshot
    (`torch.cuda.memory._snapshot()` taken with history on): a site is the innermost two frames of h3render's or the
    bench's own code in the block's allocation stack; bytes (GB) and block count each."""
    totals: dict[str, list] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            ours = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in block.get("frames", [])
                    if "/h3render/" in f["filename"] or "/scripts/" in f["filename"]]
            site = " < ".join(ours[:2]) or "(no h3render frame)"
            entry = totals.setdefault(site, [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": site, "gb": round(size / 1e9, 3), "blocks": count} for site, (size, count) in ranked]


def _cap(device: torch.device, gb: float | None) -> None:
    """Cap the allocator at `gb` (None: the whole card)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gb is None else min(1.0, gb * 1e9 / total), device)


def _text_phase(args, bench, ctx, precision: str, jobs, streamed: bool, cap: float | None):
    """The text phase as `text_phase.run_text_phase` runs it, on random text-encoder weights: (store, record)."""
    from h3render.block_stream import stream_layers_
    from h3render.text_phase import TextHost, TextStore, encode_jobs

    device = ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    components = random_components(args.memplan_model, device, dtype, precision, parts=("text_encoder",))
    record = {"load_s": round(time.perf_counter() - t0, 2)}
    if streamed:
        record["streamed"] = stream_layers_(components.text_encoder, components.text_encoder.layers, device).record()
    free_memory(device)
    _cap(device, cap)
    reset_peak(device)
    host = TextHost(components, device)
    store = encode_jobs(host, jobs, TextStore())
    record.update(store.record(), peak_gb=peak_gb(bench, device),
                  dtype=str(components.text_encoder.embed_tokens.weight.dtype).removeprefix("torch."))
    from h3render.models.fp8 import precision_report

    record["precision"] = precision_report(components)["text_encoder"]
    del host, components
    _cap(device, None)
    free_memory(device)
    return store, record


def _expected(args, plan: str, precision: str, canvas, vsa: bool) -> dict:
    from h3render import memplan
    from h3render.checkpoint.releases import RELEASES
    from h3render.checkpoint.sizes import part_sizes

    release = RELEASES[args.memplan_model]
    sizes = part_sizes(release, precision, vsa=vsa)
    text = release.text_config
    phases = memplan.expected_phases(sizes, plan, memplan.Canvas(*canvas), release.dit.hidden_size,
                                     text_hidden=text.hidden_size, text_intermediate=text.intermediate_size,
                                     vae_batch=args.vae_batches[-1])
    return {k: round(v / 1e9, 2) for k, v in phases.items()}


@torch.no_grad()
def _render(args, bench, ctx, plan: str, precision: str, cap: float | None, job, out: Path, contents,
            scenes) -> list[dict]:
    """One capped run: text phase (phased, streamed), components, VSA, engine, warm-up, then the timed render once
    per `--e2e-content` kind in `contents` (painted from `scenes`): a row each (one row saying so on an OOM)."""
    from h3render.engine import Engine
    from h3render.settings import RunSettings

    device = ctx.device
    renders: list[dict] = []
    settings = RunSettings(checkpoint=f"random-{args.memplan_model}", precision=precision, device=device.type,
                           dtype="bf16" if device.type == "cuda" else "fp32", vae_batch=args.vae_batches[-1],
                           attention=args.attention, progress=False, save_latents=True, memory_plan=plan,
                           max_gpu_memory=cap)
    row: dict = {}
    from h3render.engine import fit_allocator

    row["allocator"] = fit_allocator(device, plan, capped=cap is not None)  # as `Engine.load` sets it, first
    texts = text_record = None
    if plan != "resident":
        texts, text_record = _text_phase(args, bench, ctx, precision, [job], plan == "streamed", cap)
        row["text_phase"] = text_record
    parts = ("dit", "video_vae", "audio_vae") + (("text_encoder",) if plan == "resident" else ())
    t0 = time.perf_counter()
    components = random_components(args.memplan_model, device, settings.torch_dtype, precision, parts=parts)
    enable_random_vsa_(components.dit, args.vsa_sparsity, seed=1)
    engine = Engine(components, ctx, settings)
    engine.use_memory_plan(plan, texts, text_record)
    sync(device)
    free_memory(device)
    row["build_s"] = round(time.perf_counter() - t0, 1)
    _cap(device, cap)
    sites = args.memplan_oom_sites if device.type == "cuda" else 0
    if sites:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    try:
        engine.prepare([job])
        from bench_e2e import _warm_forward

        _warm_forward(engine, job)  # the VSA tile plan and Triton specializations, untimed
        floor = decode_alone(engine, job) if scenes is not None else None
        for kind in contents:
            reset_peak(device)
            t0 = time.perf_counter()
            with content(engine, kind, scenes) as shown:
                engine.render(job, out, out.with_suffix(".json"))
            rendered = {**shown, "wall_s": round(time.perf_counter() - t0, 2)}
            side = json.loads(out.with_suffix(".json").read_text())
            timings = side["timings"]
            rendered["stages"] = {k: round(v["seconds"], 3) for k, v in timings["stages"].items()}
            rendered["peak_gb"] = bench.gb(timings["peak_memory_bytes"]) if timings.get("peak_memory_bytes") else None
            rendered["stage_peak_gb"] = {k: bench.gb(v) for k, v in
                                         (timings.get("stage_peak_memory_bytes") or {}).items()}
            rendered["memory"] = side["run"]["memory"]
            rendered.update(media_record(side, out, floor))
            rendered["latents"] = torch.load(out.with_name(out.stem + ".latents.pt"))
            renders.append(rendered)
        if engine.streamer is not None:
            streamer = engine.streamer
            row["streamer"] = {"copies": streamer.copies, "issue_s": round(streamer.copy_seconds, 3),
                               **streamer.record()}
            # The transfer a forward needs, alone (every block into one slot, nothing computing): what streaming
            # has to hide behind the blocks' compute (compare the denoise step with the uncapped run's).
            sync(device)
            t0 = time.perf_counter()
            for i in range(len(streamer.layers)):
                streamer._fetch(i, 0)
            sync(device)
            copy_s = time.perf_counter() - t0
            row["streamer"].update(copy_s_per_forward=round(copy_s, 4),
                                   h2d_gb_s=round(streamer.slot_bytes * len(streamer.layers) / copy_s / 1e9, 2))
    except torch.cuda.OutOfMemoryError as exc:
        row["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:200]}"
        if sites:
            row["oom_sites"] = live_sites(torch.cuda.memory._snapshot(), sites)
    finally:
        if sites:
            torch.cuda.memory._record_memory_history(enabled=None)
        if row["allocator"]:  # the next run starts as its own plan would
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        del engine, components, texts
        gc.collect()
        torch._dynamo.reset()
        _cap(device, None)
        free_memory(device)
    base = {k: v for k, v in row.items() if k not in ("error", "oom_sites")}
    rows = [{**base, **r} for r in renders]
    if "error" in row:  # the render that was running when it failed (None: before or after them)
        rows.append({**row, "content": contents[len(renders)] if len(renders) < len(contents) else None})
    return rows


def stage_memplans(args, bench) -> None:
    """Every run of --memplans, then the queue's text phase (module docstring)."""
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel

    ctx = init_parallel(args.memplan_device)
    device = ctx.device
    w, h, f = canvas = parse_canvas(args.memplan_canvas)
    job = Job(id="memplan", prompt=bench.PROMPT, width=w, height=h, frames=f, seed=0, steps=args.forwards + 1,
              mode="t2va", output="memplan")
    folder = Path(args.memplan_dir)
    folder.mkdir(parents=True, exist_ok=True)
    contents, scenes = content_scenes(args, device, [canvas])
    uncapped: dict[tuple[str, str], dict] = {}  # (precision, content) -> the uncapped resident run's wall, latents
    for plan, precision, cap in parse_runs(args.memplans):
        name = f"{plan}-{precision}" + (f"-{cap:g}GB" if cap else "")
        out = folder / f"{name}.mp4"
        for row in _render(args, bench, ctx, plan, precision, cap, job, out, contents, scenes):
            latents = row.pop("latents", None)
            key = (precision, row["content"])
            if plan == "resident" and cap is None and "wall_s" in row:
                uncapped[key] = {"wall_s": row["wall_s"], "latents": latents}
            base = uncapped.get(key)
            if base is not None and "wall_s" in row:
                row["vs_uncapped"] = round(row["wall_s"] / base["wall_s"], 3)
                row["latents_equal_uncapped"] = bool(torch.equal(latents["video"], base["latents"]["video"]) and
                                                     torch.equal(latents["audio"], base["latents"]["audio"]))
            bench.rec(stage="memplans", what=f"{plan} {precision}, cap {cap or 'none'} GB, {w}x{h}x{f}, "
                                            f"{args.forwards} forwards, VSA {args.vsa_sparsity}, {row['content']}",
                      plan=plan, precision=precision, cap_gb=cap,
                      expected_gb=_expected(args, plan, precision, canvas, True), **row)
    if args.memplan_queue > 0:
        jobs = [Job(id=f"q{i}", prompt=f"{bench.PROMPT} Take {i + 1}.", width=w, height=h, frames=f, seed=i,
                    steps=args.forwards + 1, mode="t2va", output=f"q{i}") for i in range(args.memplan_queue)]
        for precision in sorted({p for _, p, _ in parse_runs(args.memplans)}):
            store, record = _text_phase(args, bench, ctx, precision, jobs, False, None)
            bench.rec(stage="memplans", what=f"text phase of a {len(jobs)}-job queue, {precision}",
                      precision=precision, text_phase=record)
            store.close()
    sync(device)
