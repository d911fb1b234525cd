"""The LoRA stage of scripts/bench.py (issue #25): what per-job LoRAs cost on a resident DiT, measured at
`--lora-canvas` (1344x768x243 by default; S = 73,642 rows with 256 text rows) on random weights of `--lora-model`.

  lora   rows, each for bf16 and then for the same DiT quantized to FP8 (`--lora-precisions`):
         * `forward base`: one DiT forward without LoRAs;
         * `forward side N x rank R`: the same forward with N (1, 2, 4: `--lora-counts`) un-fused LoRAs of rank R
           (32, 128: `--lora-ranks`) on every block's qkv / out / fc1 / fc2 (`checkpoint.lora_apply` side path),
           with `overhead` = side / base - 1;
         * bf16 only, `fuse` / `unfuse` N x rank R: the time of an exact fuse (base copies to host memory, one rank-R
           GEMM per weight) and of the restore;
         * `queue`: 4 jobs of `--lora-queue-forwards` forwards (1) each, alternating two 1-LoRA sets (X, Y, X, Y) in
           the engine's mode (fuse for bf16, side for fp8), against the same 4 jobs without LoRAs: total seconds
           and the ratio.

A dense forward takes ≈ 15.7 s at the default canvas on one H200: run one `--lora-precisions` per call (docs/lora.md),
or both with `--lora-vsa 0.9` (FastH3's attention, ≈ 8 s a forward).
CPU smoke (tests/unit/test_bench_lora.py): `--stages lora --lora-model tiny --lora-device cpu --lora-canvas
160x128x22 --lora-text 6 --lora-ranks 4 --lora-counts 1,2 --lora-reps 1 --lora-queue-forwards 1`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench_common import parse_canvas


def add_arguments(p) -> None:
    """This module's flags on scripts/bench.py's parser."""
    p.add_argument("--lora-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--lora-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--lora-canvas", default="1344x768x243", help="lora stage: WxHxFRAMES of the packed sequence")
    p.add_argument("--lora-text", type=int, default=256, help="lora stage: text rows")
    p.add_argument("--lora-ranks", default="32,128")
    p.add_argument("--lora-counts", default="1,2,4")
    p.add_argument("--lora-precisions", default="bf16,fp8")
    p.add_argument("--lora-reps", type=int, default=1,
                   help="lora stage: timed forwards per row (the base row has one warm-up before them)")
    p.add_argument("--lora-queue-forwards", type=int, default=1, help="lora stage: forwards per queued job")
    p.add_argument("--lora-dir", default=None, help="where the synthetic LoRA files go (default: a temp folder)")
    p.add_argument("--lora-vsa", type=float, default=None,
                   help="lora stage: VSA at this sparsity with random gates, as FastH3 students run (default: dense "
                        "attention, the base model's); LoRAs never touch the gates")


def stage_lora(args, bench) -> None:
    import bench_fl2va
    from bench_fp8 import pick_device, time_call

    from h3render import sampling
    from h3render.checkpoint.contract import fasth3_schedule
    from h3render.checkpoint.lora import read_lora
    from h3render.checkpoint.lora_apply import LoraState
    from h3render.checkpoint.releases import RELEASES
    from h3render.make_checkpoint.synthetic_lora import write_synthetic_lora
    from h3render.models.dit import DiT
    from h3render.models.fp8 import quantize_dit_fp8_
    from h3render.packing import patchify_video, t2va_layout

    device = pick_device(args.lora_device)
    cuda = device.type == "cuda"
    cfg = RELEASES[args.lora_model].dit
    width, height, frames = parse_canvas(args.lora_canvas)
    ranks = [int(r) for r in args.lora_ranks.split(",")]
    counts = [int(n) for n in args.lora_counts.split(",")]
    folder = Path(args.lora_dir or tempfile.mkdtemp(prefix="h3render-bench-lora-"))
    folder.mkdir(parents=True, exist_ok=True)  # a named --lora-dir may not exist yet (it failed a device call)
    files = {}
    t0 = time.perf_counter()
    for rank in ranks:
        for i in range(max(max(counts), 2)):
            path = folder / f"r{rank}-{i}.safetensors"
            if not path.exists():
                write_synthetic_lora(path, cfg, "diffusers", seed=100 + i, rank=rank, adaln=False,
                                     dtype=torch.bfloat16)
            files[rank, i] = read_lora(path)
    bench.rec(stage="lora", what="synthetic LoRA files written", seconds=round(time.perf_counter() - t0, 6),
              folder=str(folder))

    dtype = torch.bfloat16 if cuda else torch.float32
    dit = bench.random_(bench_fl2va.build(lambda: DiT(cfg), device, dtype), 0).apply_precision_(dtype)
    if cuda:
        from h3render.models.attention import attention, select_backend

        select_backend(args.attention)
        dit.set_attention(attention, refiner=True)
    if args.lora_vsa is not None:
        from bench_fp8 import enable_random_vsa_

        enable_random_vsa_(dit, args.lora_vsa)  # bf16 gates, quantized with the rest for the fp8 rows
    layout = t2va_layout(args.lora_text, height, width, frames).to(device)
    g = torch.Generator().manual_seed(0)
    text = torch.randn(args.lora_text, cfg.text_dim, generator=g).to(device, dtype)
    video0, audio0 = sampling.draw_noise(0, layout)
    video_rows, audio_rows = patchify_video(video0[0]).to(device), audio0.to(device)
    schedule = fasth3_schedule()
    tables = dit.modulation_tables(schedule.timesteps)
    dit.drop_adaln_weights_()  # as the Engine runs: tables only (the benchmark's LoRAs leave AdaLN alone)
    t = 1 - schedule.video[1]
    index = layout.row_timestep_index(tables.index_of(t), tables.index_of(1 - schedule.audio[1]))
    rope = dit.rope_tables(layout.positions)
    shape = f"{width}x{height}x{frames}"
    row = dict(stage="lora", model=args.lora_model, canvas=shape, seq=layout.seq_len, layers=cfg.num_layers,
               attention="dense" if args.lora_vsa is None else f"vsa {args.lora_vsa}")

    def forward():
        return dit(video_rows, audio_rows, text, layout, tables, index, rope)

    def timed(warm: int = 0) -> float:  # a side path adds no first-call cost of its own: the base row warms up
        return time_call(forward, device, args.lora_reps, warm=warm)["median_s"]

    for precision in args.lora_precisions.split(","):
        if precision == "fp8":
            quantize_dit_fp8_(dit)
        mode = "side" if precision == "fp8" else "fuse"
        base = timed(warm=1)
        bench.rec(**row, what=f"forward base {precision}", precision=precision, seconds=base)
        side = LoraState(dit, cfg, "side")
        for rank in ranks:
            for n in counts:
                side.switch([(files[rank, i], 1.0) for i in range(n)])
                s = timed()
                bench.rec(**row, what=f"forward side {n} x rank {rank} {precision}", precision=precision, loras=n,
                          rank=rank, seconds=s, overhead=round(s / base - 1, 4))
                side.clear()
        if mode == "fuse":
            fuse = LoraState(dit, cfg, "fuse")
            for rank in ranks:
                for n in counts:
                    t0 = time.perf_counter()
                    fuse.switch([(files[rank, i], 1.0) for i in range(n)])
                    _sync(device)
                    t_fuse = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    fuse.clear()
                    _sync(device)
                    bench.rec(**row, what=f"fuse / unfuse {n} x rank {rank}", fuse_s=round(t_fuse, 6),
                              unfuse_s=round(time.perf_counter() - t0, 6), loras=n, rank=rank)
        # The 4-job queue: X, Y, X, Y (one LoRA each, the largest rank) against the same 4 jobs without LoRAs.
        rank = max(ranks)
        # One fuse state per DiT, as the Engine holds: a second one pinned another copy of every base weight (39 GB
        # of host memory at release beside the first's); the bf16 call of 2026-12-02 was SIGKILLed right after its
        # fuse rows, most likely for that (128 GB host).
        state = fuse if mode == "fuse" else LoraState(dit, cfg, mode)

        def queue(sets) -> float:
            _sync(device)
            t0 = time.perf_counter()
            for entries in sets:
                state.switch(entries)
                for _ in range(args.lora_queue_forwards):
                    forward()
            state.clear()
            _sync(device)
            return time.perf_counter() - t0

        x, y = [(files[rank, 0], 1.0)], [(files[rank, 1], 1.0)]
        plain = queue([[]] * 4)
        alternating = queue([x, y, x, y])
        bench.rec(**row, what=f"queue 4 jobs x {args.lora_queue_forwards} forwards {precision}", mode=mode,
                  rank=rank, no_lora_s=round(plain, 6), alternating_s=round(alternating, 6),
                  ratio=round(alternating / plain, 4))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
