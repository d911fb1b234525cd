"""Issue 26's stages of scripts/bench.py: the AdaLN table cache, a second run's prepare and the FP8 text encoder's
fused GEMM. Random weights at the released shapes, before and after measured in the same process on the same weights
and inputs.

  tables   the AdaLN tables of the released DiT (50 blocks, random bf16 weights on the GPU) for K = `--tables-k`
           timesteps: built with the projections on the GPU, the copy of the projections to host memory (what
           `Engine.prepare` paid on CUDA for a bf16 load before the loader put them there), built again with the
           projections in host memory (every engine's case on CUDA now), then through `adaln_cache.cached_tables`
           into a fresh folder (`--tables-dir`): the first call builds and writes, the second reads and verifies (a
           second run's prepare); tables equal bit for bit.
  prepare  per `--precision` (one engine at a time), the Engine over random components (`bench_e2e._build`, or
           `Engine.load` of `--e2e-checkpoint`), then `Engine.prepare` twice for one job of the first
           `--e2e-canvases` canvas and `--prepare-steps` steps (default the release's schedule), with
           `H3RENDER_ADALN_CACHE` at a fresh folder (under `--tables-dir`) per precision: the first prepare
           builds the tables from the projections in host memory and writes them (a first run), the second, with
           the engine's in-memory tables dropped, reads them back (a second run's tables). Rows: the load (random
           weights are made on the GPU, so their AdaLN projections cross to host memory in the load: a
           checkpoint's load reads them there directly), each prepare's wall and warm-up record (`adaln_tables_s`,
           the cache's records), and whether the read tables equal the built ones bit for bit. The second prepare
           runs in the warm process (kernels compiled, tokenizer loaded): its other warm-up parts are lower bounds
           of a second process's. CPU smoke: `--e2e-model tiny --e2e-device cpu --e2e-canvases 160x128x22
           --prepare-steps 3`.
  te-fp8   the text encoder (50 of 64 Qwen3-VL-32B layers) at `--te-tokens` tokens, eager (unpadded, no graph):
           bf16, then quantized in place to FP8 (`quantize_text_encoder_fp8_`) in each `Fp8WeightLinear.mode`: the
           old per-call torch dequantize, the Triton weight-only GEMM, the Triton dequantize + cuBLAS, "auto", and
           "rows" (activations quantized per row too, one `_scaled_mm`: w8a8); rel. error of the read states against
           bf16. The GEMM's launch settings per linear shape, and the encode as the engine replays it: te-small
           (scripts/bench_te_small.py).
"""

from __future__ import annotations

import tempfile
import time

import torch


def add_arguments(p) -> None:
    p.add_argument("--tables-k", default="5,50", help="tables stage: comma-separated timestep counts")
    p.add_argument("--tables-dir", default=None,
                   help="tables / prepare stages: where the fresh cache folder is made (default: the temp folder)")
    p.add_argument("--prepare-cache", default=None,
                   help="prepare stage: the AdaLN cache's root (per precision below it), kept for a later process; "
                        "default a fresh folder under --tables-dir")
    p.add_argument("--prepare-steps", type=int, default=None,
                   help="prepare stage: the job's steps (default: the release's schedule, 50 sigma points)")
    p.add_argument("--no-compile-prefetch", action="store_true",
                   help="prepare / e2e: do not import the compile stack beside the load (h3render.compile_prefetch): "
                        "the before row of a new process's prepare")
    p.add_argument("--prepare-profile", action="store_true",
                   help="prepare stage: the first run's host time under cProfile (top functions by cumulative time)")
    p.add_argument("--te-tokens", default="77,256,2000", help="te-fp8 stage: comma-separated prompt lengths")


def _sync_time(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@torch.no_grad()
def stage_tables(args, bench) -> None:
    from h3render.adaln_cache import cached_tables

    rec = bench.rec
    dit = bench.released_dit(50)
    adaln = sum(p.numel() for b in dit.blocks for p in b.adaln_proj.parameters())
    adaln += sum(p.numel() for p in dit.final_layer.adaln_proj.parameters())
    rec(stage="tables", what="AdaLN projections", params_b=round(adaln / 1e9, 2), gb=bench.gb(adaln * 2))
    ks = [int(k) for k in args.tables_k.split(",")]
    steps = {k: torch.linspace(0.02, 0.999, k) for k in ks}
    for k in ks:
        t, _ = _sync_time(lambda: dit.modulation_tables(steps[k], device="cuda"))
        rec(stage="tables", what=f"build, projections on the GPU, K={k}", seconds=round(t, 3))
    t, _ = _sync_time(lambda: dit.offload_adaln_("cpu"))
    rec(stage="tables", what="copy the AdaLN projections to host memory (bf16 Engine.prepare on CUDA before the "
        "loader put them there)", seconds=round(t, 3))
    t, _ = _sync_time(lambda: dit.modulation_tables(steps[ks[0]], device="cuda"))
    rec(stage="tables", what=f"build, projections in host memory (every engine on CUDA), K={ks[0]} (a first run)",
        seconds=round(t, 3))
    root = tempfile.mkdtemp(prefix="h3render-tables-", dir=args.tables_dir)
    from pathlib import Path

    ident = {"path": "bench-random", "layout": "bench", "config": "released", "adapter": None}
    for k in ks:
        t_built, (built, r1) = _sync_time(lambda: cached_tables(dit, steps[k], "cuda", ident, root=Path(root)))
        t_hit, (hit, r2) = _sync_time(lambda: cached_tables(dit, steps[k], "cuda", ident, root=Path(root)))
        same = torch.equal(built.final, hit.final) and all(torch.equal(a, b) for a, b in zip(built.blocks, hit.blocks))
        size = Path(r1["file"]).stat().st_size
        rec(stage="tables", what=f"cache K={k}: first run (build from host + write) / second run (read + verify)",
            first_s=round(t_built, 3), write_s=r1["seconds"], second_s=round(t_hit, 3), read_verify_s=r2["seconds"],
            states=[r1["cache"], r2["cache"]], bit_equal=same, file_mb=round(size / 2**20, 1))
    del dit
    bench.peak_reset()


@torch.no_grad()
def stage_prepare(args, bench) -> None:
    """A first and a second run's `Engine.prepare` per `--precision` against one table-cache folder (module
    docstring)."""
    import os

    import bench_e2e
    from bench_fp8 import parse_canvas, peak_gb, reset_peak, sync

    from h3render.adaln_cache import ENV
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel
    from h3render.tasks import task_of

    ctx = init_parallel(args.e2e_device)
    device = ctx.device
    width, height, frames = parse_canvas(args.e2e_canvases.split(",")[0])
    job = Job(id="bench", prompt=bench.PROMPT, width=width, height=height, frames=frames, seed=0,
              steps=args.prepare_steps, mode="t2va", output="bench")
    # --prepare-cache: one folder a later process reuses, so that its first prepare is a new process's second run
    # (AdaLN tables read from the cache, Inductor and Triton from their own disk caches).
    root = args.prepare_cache or tempfile.mkdtemp(prefix="h3render-prepare-", dir=args.tables_dir)
    saved = os.environ.get(ENV)
    try:
        for precision in bench_e2e._precisions(args):
            # A folder per precision: both engines' projections are the same bf16 random weights, so the second
            # engine's first prepare would read the first engine's tables (a correct hit, not a first run).
            cache = os.path.join(root, precision)
            os.environ[ENV] = cache  # read by `adaln_cache.cache_root` at each table request
            engine = bench_e2e._build(args, bench, ctx, precision, "prepare")
            dit = engine.c.dit
            homes = sorted({p.device.type for m in [*dit.blocks, dit.final_layer] for p in m.adaln_proj.parameters()})
            bench.rec(stage="prepare", what=f"{precision}: where the AdaLN projections are after the load",
                      precision=precision, adaln_on=homes, cache_dir=cache)
            built: dict = {}
            for run in ("first", "second"):
                engine._tables.clear()  # a second run starts without the tables in memory, as a new process would
                engine.warmup.pop("adaln_cache", None)
                reset_peak(device)
                torch._dynamo.utils.compilation_time_metrics.clear()  # per run: where a new process's compile goes
                profiler = _host_profile(args.prepare_profile and run == "first")
                t0 = time.perf_counter()
                with profiler:
                    engine.prepare([job])
                    sync(device)
                wall = time.perf_counter() - t0
                caches = engine.warmup.get("adaln_cache", [])
                row = dict(stage="prepare", precision=precision, seconds=round(wall, 2),
                           compile_prefetch=bench_e2e.compile_prefetch_for(args, device, precision),
                           adaln_tables_s=round(engine.warmup["adaln_tables_s"], 3),
                           cache=[r["cache"] for r in caches], cache_io_s=[r.get("seconds") for r in caches],
                           peak_gb=peak_gb(bench, device), warmup=dict(engine.warmup),
                           dynamo_compile_times=_compile_times(), **profiler.record())
                if run == "first":
                    built = dict(engine._tables)
                else:
                    same = [torch.equal(a.final, b.final) and all(torch.equal(x, y) for x, y in zip(a.blocks, b.blocks))
                            for key, b in engine._tables.items() for a in [built.get(key)] if a is not None]
                    row["bit_equal"] = bool(same) and all(same)
                k = task_of(job).timesteps(engine.schedule(job)).numel()  # the tables' timesteps
                bench.rec(what=f"{precision}: Engine.prepare, {run} run ({width}x{height}x{frames}, K={k})", **row)
            del engine, dit, built
            bench_e2e._teardown(bench, device, "prepare", precision)
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


class _host_profile:
    """cProfile around a block when `on` (else a no-op): where a new process's warm-up spends host time."""

    def __init__(self, on: bool):
        import cProfile

        self.profile = cProfile.Profile() if on else None

    def __enter__(self):
        if self.profile is not None:
            self.profile.enable()

    def __exit__(self, *exc):
        if self.profile is not None:
            self.profile.disable()

    def record(self, n: int = 40) -> dict:
        if self.profile is None:
            return {}
        import pstats

        stats = pstats.Stats(self.profile).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
        top = sorted(stats.items(), key=lambda kv: kv[1][3], reverse=True)[:n]
        by_self = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
        name = lambda key: f"{key[0].rsplit('site-packages/', 1)[-1]}:{key[1]} {key[2]}"  # noqa: E731
        return {"host_profile_cumulative": [[name(k), round(v[3], 3), v[1]] for k, v in top],
                "host_profile_self": [[name(k), round(v[2], 3), v[1]] for k, v in by_self]}


def _compile_times() -> dict:
    """torch.compile's own phase totals so far in this process (seconds by phase), then reset."""
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    torch._dynamo.utils.compilation_time_metrics.clear()
    return {n: round(float(v), 3) for n, v in zip(names, values) if float(v) >= 0.05}


def _te_linear_shapes(cfg) -> list[tuple[str, int, int]]:
    h, inner, kv, ffn = (cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"],
                         cfg["num_key_value_heads"] * cfg["head_dim"], cfg["intermediate_size"])
    return [("q", h, inner), ("k/v", h, kv), ("o", inner, h), ("gate/up", h, ffn), ("down", ffn, h)]


@torch.no_grad()
def stage_te_fp8(args, bench) -> None:
    from h3render.checkpoint.releases import QWEN3VL_RELEASED
    from h3render.models.fp8 import Fp8WeightLinear, quantize_text_encoder_fp8_
    from h3render.models.text_encoder import TextEncoder

    rec = bench.rec
    tokens = [int(n) for n in args.te_tokens.split(",")]
    cfg = dict(QWEN3VL_RELEASED["text_config"])
    te = bench.build_on_gpu(lambda: TextEncoder(cfg, read_layer=50))
    bench.random_(te, 4)
    ids = {n: torch.randint(0, 150000, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
           for n in tokens}

    def encode(n):
        out = te(ids[n][None])
        return out[0] if isinstance(out, tuple) else out

    ref = {}
    for n in tokens:
        t = bench.cuda_time(lambda: encode(n), reps=5)
        ref[n] = encode(n)
        rec(stage="te-fp8", what=f"text encoder {n} tokens, bf16", seconds=round(t, 4))
    t, count = _sync_time(lambda: quantize_text_encoder_fp8_(te))
    rec(stage="te-fp8", what="quantize the text encoder in place", seconds=round(t, 2), linears=count)
    labels = {"dequant": "torch dequantize per call (before)", "gemm": "Triton weight-only GEMM",
              "dequant-fused": "Triton dequantize + cuBLAS", "auto": f"auto (GEMM up to "
              f"{Fp8WeightLinear.GEMM_MAX_ROWS} rows, else dequantize + cuBLAS)",
              "rows": "FP8 activations per row x FP8 weight, one _scaled_mm (w8a8)"}
    try:
        for mode, label in labels.items():
            Fp8WeightLinear.mode = mode
            for n in tokens:
                t = bench.cuda_time(lambda: encode(n), reps=5)
                rec(stage="te-fp8", what=f"text encoder {n} tokens, fp8, {label}", seconds=round(t, 4),
                    rel_err_vs_bf16=bench.rel_err(encode(n), ref[n]))
    finally:
        Fp8WeightLinear.mode = "auto"  # a class setting: a mode that raised must not leak into later stages
    del te, ref
    bench.peak_reset()

