"""Issue 26 item 3's stage of scripts/bench.py: the FP8 text encoder at a t2va prompt's row counts, as the engine runs
it (ids padded to h3render.text_graph.TOKEN_BUCKET, replayed from a CUDA graph). Random weights at the released shapes.

  te-small  1. Every linear shape of a released Qwen3-VL-32B layer at `--te-small-rows` rows: bf16 `F.linear`,
               Triton dequantize + cuBLAS, and the weight-only GEMM (`fp8_weight_linear_triton`) at its default
               setting, at every `CANDIDATES` setting and at the best one with the integer decode by pointers
               (medians of CUDA-graph replays, `do_bench_cudagraph`); the error of every setting, the default and
               the best against the fp32 product of the dequantized weight. The fastest setting within `MAX_ERR`
               per shape goes into `CONFIGS` for part 2 and is printed as the table to keep.
            2. The 50-layer encoder at `--te-small-tokens` tokens, padded as a t2va encode, replayed from a CUDA
               graph per mode: bf16, then FP8 "auto" (the GEMM), "dequant-fused" (dequantize + cuBLAS at every row
               count) and "rows" (w8a8); a replay's seconds (median of 9, synchronized), the read states' error
               against bf16 and against "auto", and the memory the captured graphs keep (their pool, reserved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_arguments(p) -> None:
    p.add_argument("--te-small-rows", default="64,128,256", help="te-small: row counts of the GEMM sweep")
    p.add_argument("--te-small-tokens", default="40,77,200", help="te-small: prompt lengths of the whole encode")


# A setting is kept only if its product is within this of the fp32 one: bf16 output rounding is 1.66e-3 (§32.4).
MAX_ERR = 1e-2


@torch.no_grad()
def run(args, bench) -> None:
    import triton.testing
    from bench_prepare import _te_linear_shapes

    from h3render.checkpoint.releases import QWEN3VL_RELEASED
    from h3render.kernels.fp8_weight import fp8_dequantize, fp8_weight_linear_naive
    from h3render.kernels.fp8_weight import triton_impl as ti
    from h3render.models.fp8 import quantize_weight

    rec = bench.rec
    cfg = dict(QWEN3VL_RELEASED["text_config"])
    g = torch.Generator("cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def ms(fn):
        # Replayed from a CUDA graph, as the encode runs: a few-microsecond GEMM's time, not its launch's (a
        # stream-launched sweep here measured the host and favoured fewer launches).
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")

    for name, k, n in _te_linear_shapes(cfg):
        w16 = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        w8, s = quantize_weight(w16)
        for m in [int(v) for v in args.te_small_rows.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            ref = fp8_weight_linear_naive(x.float(), w8, s)
            timings, errors, seen = {}, {}, set()

            def measure(config):
                try:
                    timings[config] = ms(lambda: ti.fp8_weight_linear_triton(x, w8, s, config=config))
                except Exception as exc:  # noqa: BLE001  (out of shared memory for one setting: skip it)
                    rec(stage="te-small", what=f"config {config} failed", error=str(exc)[:120])
                    return
                errors[config] = bench.rel_err(ti.fp8_weight_linear_triton(x, w8, s, config=config), ref)

            for config in ti.CANDIDATES:
                effective = (config[0], ti.block_t(m, config[1]), *config[2:])
                if effective not in seen:
                    seen.add(effective)
                    measure(config)
            # only settings whose product is right can be kept (a wrong one was fastest once, §32.3); NaN is wrong
            right = [c for c in timings if errors[c] <= MAX_ERR]
            if not right:
                rec(stage="te-small", what=f"GEMM {name} {k}->{n}, {m} rows: no setting within {MAX_ERR}",
                    errors={str(c): e for c, e in errors.items()})
                continue
            measure((*min(right, key=timings.get)[:6], 0, 0))  # the best with the integer decode by pointers
            right = [c for c in timings if errors[c] <= MAX_ERR]
            default = ti._default_config(m, n, k, sms)
            t_default = ms(lambda: ti.fp8_weight_linear_triton(x, w8, s, config=default))
            best = min(right, key=timings.get)
            worst = max(errors, key=lambda c: (not errors[c] <= 1e30, errors[c]))
            ti.CONFIGS[ti.config_key(m, n, k)] = best
            t_bf16 = ms(lambda: F.linear(x, w16))
            rec(stage="te-small", what=f"GEMM {name} {k}->{n}, {m} rows", bf16_ms=round(t_bf16, 4),
                dequant_cublas_ms=round(ms(lambda: F.linear(x, fp8_dequantize(w8, s))), 4),
                default=list(default), default_ms=round(t_default, 4),
                best=list(best), best_ms=round(timings[best], 4),
                best_tflops=round(2 * m * k * n / timings[best] / 1e9, 1),
                best_weight_tb_s=round(n * k / timings[best] / 1e9, 2),
                err_default=bench.rel_err(ti.fp8_weight_linear_triton(x, w8, s, config=default), ref),
                err_best=bench.rel_err(ti.fp8_weight_linear_triton(x, w8, s, config=best), ref),
                err_worst_setting=errors[worst], worst_setting=list(worst), settings_checked=len(errors),
                settings_wrong=len(errors) - len(right),
                top=[[list(c), round(t, 4)] for c, t in sorted(timings.items(), key=lambda kv: kv[1])[:6]])
        del w16, w8, s
    rec(stage="te-small", what="CONFIGS", table={str(key): list(c) for key, c in ti.CONFIGS.items()})
    bench.peak_reset()
    _whole_encoder(args, bench, cfg)


def _whole_encoder(args, bench, cfg) -> None:
    from h3render.graphs import ShapeGraphs
    from h3render.models.fp8 import Fp8WeightLinear, quantize_text_encoder_fp8_
    from h3render.models.text_encoder import TextEncoder
    from h3render.text_graph import padded_ids

    rec = bench.rec
    te = bench.build_on_gpu(lambda: TextEncoder(cfg, read_layer=50))
    bench.random_(te, 4)
    tokens = [int(v) for v in args.te_small_tokens.split(",")]
    gen = torch.Generator().manual_seed(5)
    ids = {n: padded_ids(torch.randint(0, 150000, (n,), generator=gen), "cuda") for n in tokens}

    def replayed(label):
        graphs = ShapeGraphs(te, name=f"te {label}")
        out = {}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the last mode's freed pool would hide this one's growth
        before = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        capture_s = {n: graphs.capture(ids[n]) for n in tokens}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager calls before each capture left cached blocks that the graphs do not keep
        # what the graphs keep: their shared private pool (reserved) and the static inputs / outputs (allocated)
        rec(stage="te-small", what=f"text graphs {label}: memory kept by {len(tokens)} captured lengths",
            pool_reserved_gb=round((torch.cuda.memory_reserved() - before[0]) / 1e9, 3),
            allocated_gb=round((torch.cuda.memory_allocated() - before[1]) / 1e9, 3))
        for n in tokens:
            t = bench.cuda_time(lambda: graphs(ids[n]), reps=9, warm=2)
            out[n] = graphs(ids[n])[0, :n].clone()
            rec(stage="te-small", what=f"text encoder {n} tokens (padded to {ids[n].shape[1]}), {label}, replayed",
                seconds=round(t, 4), capture_s=round(capture_s[n], 3),
                **({} if label == "bf16" else {"rel_err_vs_bf16": bench.rel_err(out[n], states["bf16"][n])}),
                **({} if "fp8 auto" not in states or label == "fp8 auto" else
                   {"rel_err_vs_auto": bench.rel_err(out[n], states["fp8 auto"][n])}))
        del graphs
        torch.cuda.synchronize()
        return out

    states = {}
    states["bf16"] = replayed("bf16")
    quantize_text_encoder_fp8_(te)
    try:
        for mode in ("auto", "dequant-fused", "rows"):
            Fp8WeightLinear.mode = mode
            states[f"fp8 {mode}"] = replayed(f"fp8 {mode}")
    finally:
        Fp8WeightLinear.mode = "auto"
    del te, states
    bench.peak_reset()
