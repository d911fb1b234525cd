"""The FP8 stages of scripts/bench.py (issue #18); bf16 measured in the same process, on the same weights and inputs,
as the fp8 it is compared with. Random weights at `--fp8-model`'s shapes (released by default).

  fp8-gemm    the DiT's four block GEMMs at S = 73,642 rows (1344x768x243 + 256 text rows; `--fp8-canvas`,
              `--fp8-text`): qkv 5376 -> 21504 (3 x 56 heads x 128), out 7168 -> 5376, fc1 5376 -> 28672 (gate and
              value, 2 x 14336), fc2 14336 -> 5376, from the DiTConfig. bf16 `F.linear` vs `Fp8Linear` on
              pre-quantized `Fp8Rows` (what the fused producers hand it) vs `Fp8Linear` on the bf16 input
              (`quantize_rows` inside: the out-projection's path), `quantize_rows` alone; CUDA-event medians, TFLOP/s,
              rel. error vs the bf16 result and vs an fp32 GEMM of the same bf16 operands.
  fp8-quant   the fused producers at the same S: modulate (C = hidden) and swiglu (F = ffn) in bf16 and with
              `fp8=True`, and `quantize_rows` on the attention output [S, heads x head_dim] (7168 wide at release:
              the out-projection's input); GB/s of the bytes each one reads and writes; the fp8 outputs against
              their torch references with tests/unit/test_fp8_kernels.py's bounds; on CUDA also modulate at the
              one-row, 16-warp launch and at (rows, warps) = (1, 8), (1, 4), (2, 4), (2, 8) (`launch=`, §28.5).
  fp8-dit     one DiT forward at `--fp8-canvas`, dense and VSA (`--vsa-sparsity`, random gates), then the 4-forward
              FastH3 chain (release positions, shifts 12/3; `--fp8-chain` attention): bf16 first, then the same DiT
              quantized in place (`quantize_dit_fp8_`) and the same again in fp8; times, rel. error of the video and
              audio outputs and of the chain's latents, resident weights and the forward's peak.

fp8-memory and e2e (bf16 and fp8 engines one after the other) are in scripts/bench_e2e.py. CPU smoke
(tests/unit/test_bench_fp8.py): `--fp8-model tiny --fp8-device cpu --fp8-canvas 160x128x22 --fp8-text 6`.
"""

from __future__ import annotations

import contextlib

import gc
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench_common import parse_canvas, sync  # noqa: F401 (bench_e2e imports them from here too)

# tests/unit/test_fp8_kernels.py's bounds for a fused producer against its torch reference: scales within 1e-6
# relative, e4m3 codes at most one step apart, at most 1e-3 of them off at all (quantize_rows: bit-exact).
SCALE_RTOL = 1e-6
MAX_OFF_FRACTION = 1e-3


def add_arguments(p) -> None:
    """This module's flags on scripts/bench.py's parser."""
    p.add_argument("--fp8-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--fp8-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--fp8-canvas", default="1344x768x243", help="fp8 stages: WxHxFRAMES of the packed sequence")
    p.add_argument("--fp8-text", type=int, default=256, help="fp8 stages: text rows (256: S = 73,642 at release)")
    p.add_argument("--fp8-gemm-reps", type=int, default=20, help="fp8-gemm / fp8-quant: timed calls (median)")
    p.add_argument("--fp8-reps", type=int, default=2, help="fp8-dit: timed forwards per variant after one warm-up")
    p.add_argument("--fp8-dit-dense", type=int, default=1,
                   help="fp8-dit: 0 skips the dense forwards (bf16 and fp8: ≈ 100 s of the stage at 1344x768x243)")
    p.add_argument("--fp8-chain", default="vsa", choices=["vsa", "dense"],
                   help="fp8-dit: attention of the 4-forward FastH3 chain (FastH3 is a VSA student)")


# ---------------------------------------------------------------------------------------------------------------------
# helpers


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def time_call(fn, device: torch.device, reps: int, warm: int = 1) -> dict:
    """Median and min seconds of `reps` calls of `fn()` after `warm` untimed ones: CUDA events around each call on
    a GPU (launch gaps and host syncs inside count), `perf_counter` on the CPU."""
    for _ in range(warm):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 6), "min_s": round(min(times), 6), "reps": reps}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(bench, device: torch.device) -> float | None:
    return bench.gb(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def allocated_gb(bench, device: torch.device) -> float | None:
    return bench.gb(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


def tensor_bytes(module: nn.Module, device: torch.device | None = None) -> int:
    """Bytes of `module`'s parameters and buffers (each storage once), only those on `device`'s type when given:
    what the module keeps resident there (AdaLN projections offloaded to the host are not counted)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if device is not None and t.device.type != device.type:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def code_distance(data: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|signed e4m3 code difference| per element (neighbouring finite values differ by 1; +0 and -0 both 0)."""
    def signed(d):
        b = d.view(torch.uint8).to(torch.int16)  # int16: a [73642, 14336] code array costs 2.1 GB, not 8.4
        return torch.where(b >= 128, -(b - 128), b)

    return (signed(data) - signed(ref)).abs()


def fp8_agreement(got, ref) -> dict:
    """An `Fp8Rows` against its reference: the largest relative scale difference, the largest code distance, the
    fraction of codes off, whether both are bit-exact, and whether the fused-producer bound holds."""
    scale_rel = float(((got.scale - ref.scale).abs() / ref.scale).max())
    off = code_distance(got.data, ref.data)
    frac = float((off > 0).float().mean())
    return {"scale_max_rel_diff": scale_rel, "code_max_steps": int(off.max()), "codes_off_fraction": frac,
            "bit_exact": bool(torch.equal(got.scale, ref.scale) and frac == 0.0),
            "within_bound": scale_rel <= SCALE_RTOL and int(off.max()) <= 1 and frac <= MAX_OFF_FRACTION}


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":  # a collection costs ~0.4 s with transformers imported: only where memory is tight
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# VSA gates on a bf16 or an FP8 DiT


@torch.no_grad()
def fill_random_gates_(dit, seed: int = 1) -> None:
    """Random VSA gates `N(0, 0.25 / fan_in)` in every block (a student's gates stand-in). On a bf16 DiT the values
    are copied into `gate_proj.weight`; on an FP8 DiT (`Fp8Linear` gates: an e4m3 buffer and per-channel scales) the
    same values, rounded to the gate's dtype, are quantized with `models.fp8.quantize_weight`."""
    from h3render.models.fp8 import Fp8Linear, quantize_weight

    device = dit.blocks[0].attn.qkv_proj.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for block in dit.blocks:
        gate = block.attn.gate_proj
        shape = (gate.out_features, gate.in_features)
        w = torch.randn(shape, device=device, generator=gen) * (0.5 / shape[1] ** 0.5)
        if isinstance(gate, Fp8Linear):
            gate.weight, gate.weight_scale = quantize_weight(w.to(gate.out_dtype))
        else:
            gate.weight.copy_(w)


@torch.no_grad()
def enable_random_vsa_(dit, sparsity: float, seed: int = 1) -> None:
    """VSA at `sparsity` with random gates, on a bf16 DiT (`DiT.enable_vsa`) or an already quantized one.
    `DiT.enable_vsa` refuses an FP8 DiT without gates (its gates would be bf16 linears reading FP8 rows), so
    there this adds `Fp8Linear` gates itself and sets `vsa_sparsity` as `enable_vsa` does: a benchmark of random
    gates only (a student's gates stream in before the quantization, `checkpoint.students`); their accumulation is
    the one `quantize_dit_fp8_` gives a student's gates (`models.fp8.DIT_FAST_ACCUM`)."""
    from h3render.models.attention import check_vsa_settings, gate_projection
    from h3render.models.fp8 import DIT_FAST_ACCUM, Fp8Linear

    if not isinstance(dit.blocks[0].attn.qkv_proj, Fp8Linear):
        dit.enable_vsa(sparsity)
    else:
        for block in dit.blocks:
            attn = block.attn
            if attn.gate_proj is None:
                like = torch.empty(1, attn.qkv_proj.in_features, device=attn.qkv_proj.weight.device, dtype=dit.dtype)
                attn.gate_proj = Fp8Linear.from_linear(gate_projection(like, attn.heads * attn.head_dim))
                attn.gate_proj.fast_accum = "attn.gate_proj" in DIT_FAST_ACCUM
        dit.vsa_sparsity = check_vsa_settings(sparsity, 64)
    fill_random_gates_(dit, seed)


# ---------------------------------------------------------------------------------------------------------------------
# fp8-gemm and fp8-quant


@contextlib.contextmanager
def accumulation(module: nn.Module, fast: bool | None):
    """Inside the block every `Fp8Linear` of `module` (itself included) runs with cuBLASLt's fast accumulation
    (`fast`), or without; None leaves them as they are (`Fp8Linear.fast_accum`)."""
    from h3render.models.fp8 import Fp8Linear

    linears = [m for m in module.modules() if isinstance(m, Fp8Linear)]
    saved = [m.fast_accum for m in linears]
    try:
        for m in linears:
            m.fast_accum = m.fast_accum if fast is None else fast
        yield
    finally:
        for m, was in zip(linears, saved):
            m.fast_accum = was


def _rows_and_config(args):
    from h3render.checkpoint.releases import RELEASES
    from h3render.packing import t2va_layout

    width, height, frames = parse_canvas(args.fp8_canvas)
    cfg = RELEASES[args.fp8_model].dit
    seq = t2va_layout(args.fp8_text, height, width, frames).seq_len
    return cfg, seq, dict(model=args.fp8_model, canvas=args.fp8_canvas, rows=seq)


def gemm_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, K, N) of a DiT block's five linears: qkv hidden -> 3 x heads x head_dim (q/k/v interleaved per head),
    out heads x head_dim -> hidden, fc1 hidden -> 2 x ffn (gate and value), fc2 ffn -> hidden, and a VSA student's
    gate hidden -> heads x head_dim (`attn.gate_proj`)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    return [("qkv", cfg.hidden_size, 3 * inner), ("out", inner, cfg.hidden_size),
            ("fc1", cfg.hidden_size, 2 * cfg.ffn_dim), ("fc2", cfg.ffn_dim, cfg.hidden_size),
            ("gate", cfg.hidden_size, inner)]


@torch.no_grad()
def stage_gemm(args, bench) -> None:
    from h3render.kernels.fp8 import quantize_rows
    from h3render.models.fp8 import Fp8Linear

    device = pick_device(args.fp8_device)
    cfg, seq, row = _rows_and_config(args)
    g = torch.Generator(device=device).manual_seed(0)
    for name, k, n in gemm_shapes(cfg):
        x = torch.randn(seq, k, device=device, generator=g).bfloat16()
        linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        linear.weight.copy_(torch.randn(n, k, device=device, generator=g) / k ** 0.5)
        fp8 = Fp8Linear.from_linear(linear)
        rows = quantize_rows(x)
        exact = F.linear(x.float(), linear.weight.float())  # fp32 GEMM of the same bf16 operands
        flop = 2 * seq * k * n
        label = f"{name} GEMM {k}->{n}, S={seq}"
        y16 = F.linear(x, linear.weight)
        t16 = time_call(lambda: F.linear(x, linear.weight), device, args.fp8_gemm_reps, warm=3)["median_s"]
        bench.rec(stage="fp8-gemm", what=f"{label}: bf16 F.linear", **row, ours_s=t16,
                  tflops=round(flop / t16 / 1e12, 1), rel_err=bench.rel_err(y16, exact), vs="fp32 GEMM")
        for variant, fn, fast in (("Fp8Linear, Fp8Rows input", lambda: fp8(rows), False),
                                  ("Fp8Linear, Fp8Rows input, fast accumulation", lambda: fp8(rows), True),
                                  ("Fp8Linear, bf16 input (quantize_rows inside)", lambda: fp8(x), False)):
            with accumulation(fp8, fast):
                y8 = fn()
                t8 = time_call(fn, device, args.fp8_gemm_reps, warm=3)["median_s"]
            bench.rec(stage="fp8-gemm", what=f"{label}: {variant}", **row, ours_s=t8, ref_s=t16,
                      speedup=round(t16 / t8, 3), tflops=round(flop / t8 / 1e12, 1), rel_err=bench.rel_err(y8, y16),
                      vs="bf16 F.linear", rel_err_vs_fp32=bench.rel_err(y8, exact))
            del y8
        tq = time_call(lambda: quantize_rows(x), device, args.fp8_gemm_reps, warm=3)["median_s"]
        bench.rec(stage="fp8-gemm", what=f"{label}: quantize_rows of the input alone", **row, ours_s=tq,
                  gb_per_s=round(x.numel() * 3 / tq / 1e9, 3))
        del x, linear, fp8, rows, exact, y16
        free_memory(device)


@torch.no_grad()
def stage_quant(args, bench) -> None:
    from h3render.kernels.fp8 import Fp8Rows, quantize_rows, quantize_rows_naive
    from h3render.kernels.modulate import modulate, modulate_naive
    from h3render.kernels.swiglu import swiglu, swiglu_naive

    device = pick_device(args.fp8_device)
    cfg, seq, row = _rows_and_config(args)
    g = torch.Generator(device=device).manual_seed(1)
    c, ffn, inner = cfg.hidden_size, cfg.ffn_dim, cfg.num_attention_heads * cfg.attention_head_dim
    reps = args.fp8_gemm_reps

    def report(name, bf16_fn, fp8_fn, ref_bf16, ref_fp8, exact, in_bytes, out_elems):
        """bf16 and fp8 variants of one producer: time, GB/s, error vs the torch reference; fp8 agreement."""
        t16 = time_call(bf16_fn, device, reps, warm=3)["median_s"]
        bench.rec(stage="fp8-quant", what=f"{name}: bf16", **row, ours_s=t16,
                  gb_per_s=round((in_bytes + 2 * out_elems) / t16 / 1e9, 3),
                  rel_err=bench.rel_err(bf16_fn(), ref_bf16), vs="torch reference (fp32 math, bf16 out)")
        t8 = time_call(fp8_fn, device, reps, warm=3)["median_s"]
        got = fp8_fn()
        bench.rec(stage="fp8-quant", what=f"{name}: fp8=True", **row, ours_s=t8, ref_s=t16,
                  speedup=round(t16 / t8, 3), gb_per_s=round((in_bytes + out_elems + 4 * seq) / t8 / 1e9, 3),
                  rel_err=bench.rel_err(got.dequantize(), exact), vs="fp32 result before rounding",
                  **fp8_agreement(got, Fp8Rows(*ref_fp8)))

    x = torch.randn(seq, c, device=device, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(c, device=device, generator=g)).bfloat16()
    table = (0.1 * torch.randn(6, 6, c, device=device, generator=g)).bfloat16()  # 2 timesteps x 3 modalities
    index = torch.randint(0, 6, (seq,), device=device, generator=g)
    shift, scale = table[:, 0], table[:, 1]
    report(f"modulate [{seq}, {c}]", lambda: modulate(x, weight, shift, scale, index),
           lambda: modulate(x, weight, shift, scale, index, fp8=True),
           modulate_naive(x, weight, shift, scale, index, 1e-5),
           modulate_naive(x, weight, shift, scale, index, 1e-5, fp8=True),
           modulate_naive(x.float(), weight.float(), shift.float(), scale.float(), index, 1e-5), 2 * x.numel(),
           x.numel())
    if device.type == "cuda":  # docs/performance.md §28.5's launch shapes: one row x 16 warps (before), 2 x 4
        from h3render.kernels.modulate.triton_impl import modulate_fp8_triton, modulate_triton

        ref_fp8 = Fp8Rows(*modulate_naive(x, weight, shift, scale, index, 1e-5, fp8=True))
        for launch in ((1, 16), (1, 8), (1, 4), (2, 4), (2, 8)):
            def bf16_fn():
                return modulate_triton(x, weight, shift, scale, index, 1e-5, launch=launch)

            def fp8_fn():
                return Fp8Rows(*modulate_fp8_triton(x, weight, shift, scale, index, 1e-5, launch=launch))

            what = f"modulate [{seq}, {c}]: %s, launch rows x warps = {launch[0]} x {launch[1]}"
            t16 = time_call(bf16_fn, device, reps, warm=3)["median_s"]
            bench.rec(stage="fp8-quant", what=what % "bf16", **row, ours_s=t16,
                      gb_per_s=round(4 * x.numel() / t16 / 1e9, 3))
            t8 = time_call(fp8_fn, device, reps, warm=3)["median_s"]
            bench.rec(stage="fp8-quant", what=what % "fp8=True", **row, ours_s=t8,
                      gb_per_s=round((3 * x.numel() + 4 * seq) / t8 / 1e9, 3), **fp8_agreement(fp8_fn(), ref_fp8))
        del ref_fp8
    del x, weight, table, index
    free_memory(device)

    h = torch.randn(seq, 2 * ffn, device=device, generator=g).bfloat16()
    report(f"swiglu [{seq}, {2 * ffn}] -> [{seq}, {ffn}]", lambda: swiglu(h), lambda: swiglu(h, fp8=True),
           swiglu_naive(h), swiglu_naive(h, fp8=True), swiglu_naive(h.float()), 2 * h.numel(), h.numel() // 2)
    del h
    free_memory(device)

    y = torch.randn(seq, inner, device=device, generator=g).bfloat16()  # the attention output, out_proj's input
    t = time_call(lambda: quantize_rows(y), device, reps, warm=3)["median_s"]
    got = quantize_rows(y)
    bench.rec(stage="fp8-quant", what=f"quantize_rows, attention output [{seq}, {inner}]", **row, ours_s=t,
              gb_per_s=round((3 * y.numel() + 4 * seq) / t / 1e9, 3), rel_err=bench.rel_err(got.dequantize(), y),
              vs="bf16 input", **fp8_agreement(got, Fp8Rows(*quantize_rows_naive(y))))
    del y, got
    free_memory(device)


# ---------------------------------------------------------------------------------------------------------------------
# fp8-dit


@torch.no_grad()
def stage_dit(args, bench) -> None:
    """bf16 dense / VSA forwards and the 4-forward chain, then the same DiT quantized in place, the same in fp8."""
    import bench_fl2va

    from h3render import sampling
    from h3render.checkpoint.contract import fasth3_schedule
    from h3render.checkpoint.releases import RELEASES
    from h3render.models.dit import DiT
    from h3render.models.fp8 import quantize_dit_fp8_
    from h3render.packing import patchify_video, t2va_layout

    device = pick_device(args.fp8_device)
    cuda = device.type == "cuda"
    release = RELEASES[args.fp8_model]
    width, height, frames = parse_canvas(args.fp8_canvas)
    s = args.vsa_sparsity
    shape = f"{width}x{height}x{frames}"
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU: fp32 as the CLI runs there (FP8 linears then write fp32)
    dit = bench.random_(bench_fl2va.build(lambda: DiT(release.dit), device, dtype), 0).apply_precision_(dtype)
    backend = "sdpa (CPU)"
    if cuda:
        from h3render.models.attention import attention, select_backend

        backend = select_backend(args.attention)
        dit.set_attention(attention, refiner=True)
    layout = t2va_layout(args.fp8_text, height, width, frames).to(device)
    g = torch.Generator().manual_seed(0)
    text = torch.randn(args.fp8_text, dit.cfg.text_dim, generator=g).to(device, dtype)
    video0, audio0 = sampling.draw_noise(0, layout)
    video_rows, audio_rows = patchify_video(video0[0]).to(device), audio0.to(device)
    schedule = fasth3_schedule()  # release positions (0.999, 0.749, 0.5, 0.25, 0), shifts 12 / 3
    tables = dit.modulation_tables(schedule.timesteps)
    dit.drop_adaln_weights_()  # as the Engine runs it: tables only
    free_memory(device)
    vt, at = 1 - schedule.video[1], 1 - schedule.audio[1]  # the second step: video and audio timesteps differ
    index = layout.row_timestep_index(tables.index_of(vt), tables.index_of(at))
    rope = dit.rope_tables(layout.positions)
    model_fn = sampling.dit_model_fn(dit, text, layout, tables, rope)
    row = dict(stage="fp8-dit", model=release.name, canvas=shape, seq=layout.seq_len, attention_backend=backend,
               vsa_sparsity=s, layers=dit.cfg.num_layers, float_dtype=str(dtype))
    att, lin = bench.dit_flops(layout.seq_len, dit.cfg, dit.cfg.num_layers)
    w16 = tensor_bytes(dit, device)

    def forward():
        return dit(video_rows, audio_rows, text, layout, tables, index, rope)

    def run(precision: str, attention: str, ref=None):
        """One forward kept (also the warm-up: Triton JIT, the VSA tile plan), then `--fp8-reps` timed ones."""
        dit.vsa_sparsity = s if attention == "vsa" else None  # the gates, once made, stay; dense ignores them
        reset_peak(device)
        out = forward()
        t = time_call(forward, device, args.fp8_reps, warm=0)["median_s"]
        extra = {} if attention == "vsa" else {"tflops": round((att + lin) / t / 1e12, 1)}
        if ref is not None:
            extra.update(ref_s=ref[2], speedup=round(ref[2] / t, 3), rel_err_video=bench.rel_err(out[0], ref[0]),
                         rel_err_audio=bench.rel_err(out[1], ref[1]), vs="bf16, same weights and inputs")
        bench.rec(**row, what=f"DiT forward {shape} {precision} {attention}", precision=precision, ours_s=t,
                  peak_gb=peak_gb(bench, device), **extra)
        return out[0], out[1], t

    def chain(precision: str, ref=None):
        dit.vsa_sparsity = s if args.fp8_chain == "vsa" else None
        sync(device)
        t0 = time.perf_counter()
        video, audio = sampling.denoise(model_fn, video_rows, audio_rows, schedule.video, schedule.audio)
        sync(device)
        t = round(time.perf_counter() - t0, 4)
        extra = {} if ref is None else dict(ref_s=ref[2], speedup=round(ref[2] / t, 3), vs="bf16 chain latents",
                                            rel_err_video=bench.rel_err(video, ref[0]),
                                            rel_err_audio=bench.rel_err(audio, ref[1]))
        bench.rec(**row, what=f"4-forward FastH3 chain {shape} {precision} {args.fp8_chain} (latents)",
                  precision=precision, ours_s=t, forwards=schedule.forwards, positions=list(schedule.positions),
                  **extra)
        return video, audio, t

    dense16 = run("bf16", "dense") if args.fp8_dit_dense else None
    enable_random_vsa_(dit, s, seed=1)  # bf16 gates now, so quantize_dit_fp8_ quantizes them with the rest
    vsa16 = run("bf16", "vsa")
    chain16 = chain("bf16")
    w16_gates = tensor_bytes(dit, device)
    before = allocated_gb(bench, device)
    t0 = time.perf_counter()
    replaced = quantize_dit_fp8_(dit)
    sync(device)
    quant_s = time.perf_counter() - t0
    free_memory(device)
    w8_gates, gates8 = tensor_bytes(dit, device), sum(tensor_bytes(b.attn.gate_proj) for b in dit.blocks)
    bench.rec(**row, what="DiT resident weights bf16 vs fp8 (AdaLN dropped)", gb=bench.gb(w8_gates - gates8),
              bf16_gb=bench.gb(w16), fp8_gb=bench.gb(w8_gates - gates8), bf16_with_gates_gb=bench.gb(w16_gates),
              fp8_with_gates_gb=bench.gb(w8_gates), bytes={"bf16": w16, "fp8": w8_gates - gates8,
                                                          "bf16_with_gates": w16_gates, "fp8_with_gates": w8_gates},
              allocated_before_quantize_gb=before,
              allocated_after_quantize_gb=allocated_gb(bench, device), fp8_linears=replaced,
              quantize_s=round(quant_s, 3))
    if dense16 is not None:
        run("fp8", "dense", dense16)
    run("fp8", "vsa", vsa16)
    chain("fp8", chain16)
    with accumulation(dit, False):  # every FP8 GEMM promoting to fp32 (models.fp8.DIT_FAST_ACCUM: before)
        run("fp8 exact-accum", "vsa", vsa16)
        chain("fp8 exact-accum", chain16)
    del dit, tables, model_fn, dense16, vsa16, chain16
    free_memory(device)
