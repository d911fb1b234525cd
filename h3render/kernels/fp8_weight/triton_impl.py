"""Triton weight-only FP8 GEMM for few rows (a prompt's 64-256 tokens): bf16/fp16 activations x e4m3 weight
(per-output-channel fp32 scale), fp32 accumulation, the scale and bias in the epilogue.

Computed as y^T = w x^T: the weight's rows are the warpgroup MMA's M side (64 or 128 a program) and the tokens its
N side (16-256), so the weight is read once, as bytes (half a bf16 GEMM's weight bytes), decoded in registers and fed
to the MMA from there as its A operand, and a 64-row prompt wastes no MMA rows. When the weight's rows alone give
too few programs to fill the GPU (the k / v projections: 1024 rows), SPLIT_K programs share one tile's K and write
fp32 partial sums that a second launch adds in split order (the same bits every run). Three decodes (`DECODE`):
integer operations, exact on any GPU and in the CPU interpreter (the e4m3 code's low 7 bits shifted left by 7, the
sign moved to bit 15, are the fp16 bits of `code_value * 2**-8`, subnormals included; the epilogue multiplies the
scale by 2**8); on sm_89+ the conversion instruction `cvt.rn.f16x2.e4m3x2` to bf16 (two codes an instruction); or to
fp16 with the product in fp16, the activations' rows first brought to fp16 exactly by a power of two each
(`_rows_to_f16_kernel`). On sm_90+ the tiles arrive by tensor descriptors (TMA: no per-thread address arithmetic,
zeros past the edges). NaN codes (0x7F / 0xFF) never occur: the weights are clamped to +-448 when quantized.

Measured on an H200 (docs/performance.md §32-33; every setting of `CANDIDATES` at the released text encoder's shapes
within 1.66e-3 of the fp32 product, the bf16 output rounding): per GEMM 0.007-0.123 ms, 0.69-1.2x a bf16 cuBLAS
GEMM's time; the 50-layer encode replayed from a CUDA graph 0.0175 / 0.0229 / 0.0312 / 0.0327 s at 64 / 128 / 192 /
256 rows against bf16's 0.0213 / 0.0228 / 0.0316 / 0.0320 and the row-tiled kernel this replaced (the decoded weight
as the MMA's shared-memory B operand, M tiled by 64-128 rows) 0.0456 / 0.0466 / - / 0.051 s (its dequantize +
cuBLAS above 128 rows). Triton 3.6 lets up to seven of an iteration's MMAs run into the next, whose decode then
overwrote their A registers (seen in the SASS; sums of 1e13 on the H200): `_wgmma_drain` waits for them at the top of
each K step (sm_90).

`dequantize_triton` is the large-row path: one pass writes the bf16 weight bit for bit as the torch expression
(`(code * 2**-8) * (scale * 2**8)`: both factors exact, one fp32 rounding), then cuBLAS multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting, next_power_of_2

# The integer decode's fp16 values are the codes times 2**-8: the epilogue multiplies the scale back by 2**8.
DECODE_FACTOR = 256.0


@triton.jit
def _e4m3x2_to_bf16(code):
    """e4m3 codes (uint8) -> their bf16 values, two a call: `cvt.rn.f16x2.e4m3x2` (sm_89+; exact: every e4m3 value is
    an fp16), then fp16 -> fp32 -> bf16x2 (exact: 3 mantissa bits). The pair reaches the asm as one 16-bit load."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 h;
        .reg .f16 a0, a1;
        .reg .f32 f0, f1;
        cvt.rn.f16x2.e4m3x2 h, $1;
        mov.b32 {a0, a1}, h;
        cvt.f32.f16 f0, a0;
        cvt.f32.f16 f1, a1;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        }""",
        "=r,h", [code], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _e4m3x2_to_f16(code):
    """e4m3 codes (uint8) -> their fp16 values, two an instruction (sm_89+, exact)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [code], dtype=tl.float16, is_pure=True,
                                     pack=2)


@triton.jit
def _wgmma_drain():
    """`wgmma.wait_group 0`: every pending warpgroup MMA has read its operands. Triton 3.6 (torch 2.11's) leaves up to
    7 of an iteration's MMAs in flight into the next, whose decode then writes the registers they read their A
    operand from (the SASS loads the next codes into an in-flight HGMMA's A registers; wrong sums of 1e13 on an H200
    for some settings); Triton 3.9 waits correctly, and there this costs one wait a K step.
    tests/unit/test_wgmma_hazards.py checks the compiled loop."""
    tl.inline_asm_elementwise("wgmma.wait_group.sync.aligned 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows_to_f16_kernel(
    x_ptr,  # [M, K] bf16, unit stride over K
    out_ptr,  # [M, K] fp16
    rs_ptr,  # [M] fp32: out[m] * rs[m] == x[m]
    K, stride_xm,
    BLOCK: tl.constexpr,
):
    """One row: its largest magnitude picks the power of two 2**e that brings it into [2**14, 2**15), and the row
    divided by it is written in fp16: exact for every bf16 value from 2**-28 of the row's largest up (bf16's 8
    significant bits fit fp16's 11, and a power of two only moves the exponent); smaller ones round to fp16's
    subnormal grid, far below the sum's own rounding. e stays in [-126, 113]: 2**e and 2**-e are normal fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    exponent = (tl.max(amax, 0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased: amax in [2**(e-127), 2**(e-126))
    shift = tl.minimum(tl.maximum(exponent - 127 - 14, -126), 113)
    inv = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    tl.store(rs_ptr + row, ((127 + shift) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, K, BLOCK):
        ok = k0 + offs < K
        v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * K + k0 + offs, (v * inv).to(tl.float16), mask=ok)


@triton.jit
def _wfp8_kernel(
    x_ptr,  # [M, K] bf16 / fp16, unit stride over K (DECODE 2: `_rows_to_f16_kernel`'s fp16 rows)
    w_ptr,  # [N, K] uint8 (the e4m3 codes), row-major
    s_ptr,  # [N] fp32 per-channel scale (DECODE 0: times DECODE_FACTOR)
    b_ptr,  # [N] bias (HAS_BIAS)
    rs_ptr,  # [M] fp32 row scale (DECODE 2)
    y_ptr,  # [M, N] out, unit stride over N (PARTIAL: unused)
    part_ptr,  # [SPLIT_K, M, N] fp32 partial sums (PARTIAL)
    desc_x, desc_w,  # TMA: TensorDescriptors of x (block [BLOCK_T, BLOCK_K]) and of the codes ([BLOCK_N, BLOCK_K])
    M, N, K, SPLIT_K,
    K_SPLIT,  # the K range of one split: a multiple of BLOCK_K
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # SPLIT_K > 1: write fp32 partials, `_split_sum_kernel` finishes
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DECODE: tl.constexpr,  # 0 integer operations, 1 `cvt` to bf16, 2 `cvt` to fp16 (fp16 dot): `CANDIDATES`
    TMA: tl.constexpr,  # tiles by bulk tensor copies (sm_90+): no per-thread addresses or masks, zeros past the edges
    DRAIN: tl.constexpr,  # sm_90+ (warpgroup MMAs): `_wgmma_drain` at the top of each K step
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, an fp32 dot of the same values is exact
):
    """y^T tile [BLOCK_N, BLOCK_T] = decoded w [BLOCK_N, K range] @ x^T: the weight rows are the dot's M side (64 or
    128: a full wgmma) and the few tokens its N side, so a 64-row prompt wastes nothing, the decoded weight stays in
    registers as the dot's A operand (no shared-memory round trip), and SPLIT_K programs share one weight tile's K
    when N alone gives too few programs to fill the GPU (the k / v projections: 1024 rows)."""
    pid = tl.program_id(0)
    t_tiles = tl.cdiv(M, BLOCK_T)
    pid_t = pid % t_tiles  # the token tiles of one weight tile run side by side: its bytes come from L2 after the first
    pid_k = (pid // t_tiles) % SPLIT_K
    pid_n = pid // (t_tiles * SPLIT_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    n_ok = offs_n < N
    t_ok = offs_t < M
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if DRAIN:
            _wgmma_drain()
        if TMA:  # a split's K range is whole blocks but for the last split, which ends at K: the copy zero-fills
            x = desc_x.load([pid_t * BLOCK_T, k0])
            code = desc_w.load([pid_n * BLOCK_N, k0])
        else:
            k_ok = (k0 + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            code = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        if DECODE == 1:
            w = _e4m3x2_to_bf16(code)
        elif DECODE == 2:
            w = _e4m3x2_to_f16(code)
        else:
            bits = ((code.to(tl.uint16) & 0x7F) << 7) | ((code.to(tl.uint16) & 0x80) << 8)
            w = bits.to(tl.float16, bitcast=True).to(x.dtype)  # exact: code value * 2**-8
        if UPCAST:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if DECODE == 2:  # a power of two a token: exact, and the same factor for every split
        acc = acc * tl.load(rs_ptr + offs_t, mask=t_ok, other=1.0)[None, :]
    if PARTIAL:
        p_ptrs = part_ptr + (pid_k * M + offs_t.to(tl.int64))[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=n_ok[:, None] & t_ok[None, :])
    else:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_t.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


@triton.jit
def _split_sum_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32
    s_ptr, b_ptr, y_ptr,
    M, N, stride_ym,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[m, :] = (sum over the splits, in split order: the same bits every run) * scale + bias, in y's dtype."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    row = part_ptr + m.to(tl.int64) * N + offs
    acc = tl.load(row, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(row + s * M.to(tl.int64) * N, mask=ok, other=0.0)
    acc = acc * tl.load(s_ptr + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(
    w_ptr,  # [N, K] uint8 e4m3 codes
    s_ptr,  # [N] fp32 scale times DECODE_FACTOR
    out_ptr,  # [N, K] bf16 / fp16
    N, K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RTNE_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates; round to nearest even by hand
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    where = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    code = tl.load(w_ptr + where, mask=ok, other=0).to(tl.uint16)
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    # (code * 2**-8) * (scale * 2**8): both factors exact, one fp32 rounding = fl(code * scale), the reference's
    # `data.float() * scale`; then one rounding to the output dtype, as the reference's `.to(dtype)`.
    w = bits.to(tl.float16, bitcast=True).to(tl.float32) * scale[:, None]
    if RTNE_BF16:  # finite values only (the codes have no NaN): add half an ulp (ties to even), drop the low half
        u = w.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        w = u.to(tl.float32, bitcast=True)
    tl.store(out_ptr + where, w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_triton(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`(weight.float() * scale.t()).to(dtype)` in one pass (1 byte read, 2 written per weight), bit for bit: weight
    `[N, K]` float8_e4m3fn contiguous, scale `[1, N]` fp32 -> `[N, K]` in `dtype`."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    s = (scale.reshape(-1).float() * DECODE_FACTOR).contiguous()
    block_n, block_k = 16, 256
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.view(torch.uint8), s, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        RTNE_BF16=interpreting() and dtype == torch.bfloat16, num_warps=4)
    return out


# The launch settings (BLOCK_N, T_MAX, BLOCK_K, SPLIT_K, num_warps, num_stages, DECODE, TMA): BLOCK_T is the smallest
# power of two >= M (at least 16: the MMA's least N), capped at T_MAX. DECODE 0 integer operations (any GPU, the
# interpreter), 1 `cvt` to bf16, 2 `cvt` to fp16 and the product in fp16 (1 and 2: bf16 activations on sm_89+,
# elsewhere 0 runs); TMA 1 tensor descriptors (sm_90+, K a multiple of 16; elsewhere pointers). `CONFIGS`: the
# fastest setting per `config_key` for the released Qwen3-VL-32B text encoder's linears (q, k / v, o, gate / up, down)
# at the padded prompt lengths of 64, 128, 192 and 256 rows, measured on an H200 (2026-12-04, scripts/bench_te_small.py,
# CUDA-graph replays) over `CANDIDATES`: 192 and 256 rows in docs/performance.md §33, 64 and 128 rows in §34.4 (split 3
# won q at 64 rows and o and down at 128, split 6 down at 64); other shapes get `_default_config`.
CONFIGS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (8192, 5120, 64): (64, 64, 128, 3, 4, 3, 1, 1),
    (8192, 5120, 128): (64, 128, 128, 2, 4, 3, 1, 1),
    (8192, 5120, 192): (64, 64, 128, 1, 4, 3, 2, 1),
    (8192, 5120, 256): (64, 256, 128, 1, 4, 3, 1, 1),
    (1024, 5120, 64): (64, 64, 128, 8, 4, 3, 1, 1),
    (1024, 5120, 128): (64, 128, 128, 8, 4, 3, 1, 1),
    (1024, 5120, 192): (64, 64, 128, 8, 4, 3, 1, 1),
    (1024, 5120, 256): (64, 128, 128, 4, 4, 3, 1, 1),
    (5120, 8192, 64): (64, 64, 128, 4, 4, 3, 1, 1),
    (5120, 8192, 128): (64, 128, 128, 3, 4, 3, 1, 1),
    (5120, 8192, 192): (128, 64, 128, 2, 8, 3, 1, 1),
    (5120, 8192, 256): (128, 256, 128, 3, 8, 3, 1, 1),
    (25600, 5120, 64): (128, 64, 128, 1, 8, 3, 2, 1),
    (25600, 5120, 128): (64, 128, 128, 1, 4, 3, 2, 1),
    (25600, 5120, 192): (64, 64, 64, 1, 4, 3, 2, 1),
    (25600, 5120, 256): (64, 256, 64, 1, 4, 3, 1, 1),
    (5120, 25600, 64): (128, 64, 128, 6, 8, 3, 1, 1),
    (5120, 25600, 128): (64, 128, 128, 3, 4, 3, 1, 1),
    (5120, 25600, 192): (128, 256, 128, 3, 8, 3, 1, 1),
    (5120, 25600, 256): (128, 256, 128, 3, 8, 3, 1, 1),
}
# What the benchmark (scripts/bench_te_small.py) sweeps per linear shape and row count. TMA only: the pointer form won
# no shape in the sweep that had both; 3 stages only: with pointers 4 stages won 3 of 15 shapes, by at most 1 %
# (§32). SPLIT_K is a runtime argument: one compiled kernel per (BLOCK_N, BLOCK_T, BLOCK_K, warps, DECODE, split or
# not).
CANDIDATES = tuple(
    (bn, tmax, bk, split, warps, 3, decode, 1)
    for bn, bk, warps in ((64, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8))
    for tmax in (64, 128, 256) for split in (1, 2, 3, 4, 6, 8) for decode in (1, 2))


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any count gives the same values; an H200's
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_config(m: int, n: int, k: int, sms: int) -> tuple[int, ...]:
    """64 weight rows a program; K split in two, four or eight while the programs number under two per
    multiprocessor and each split keeps at least 512 of K."""
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, 128)
    split = 1
    while split < 8 and tiles * split < 2 * sms and k // (2 * split) >= 512:
        split *= 2
    return (64, 128, 128 if m <= 64 else 64, split, 4, 3, 2, 1)


def block_t(m: int, t_max: int) -> int:
    return min(t_max, max(16, next_power_of_2(m)))


def config_key(m: int, n: int, k: int) -> tuple[int, int, int]:
    """`CONFIGS`' key: (N, K, rows bucketed) -- up to 64 rows the next power of two (16, 32, 64: BLOCK_T's own
    steps), above it the next multiple of 64 (`text_graph.TOKEN_BUCKET`: a t2va prompt's padded lengths 128, 192,
    256 each get their own measured setting)."""
    return (n, k, next_power_of_2(max(m, 16)) if m <= 64 else -(-m // 64) * 64)


def pick_config(m: int, n: int, k: int, device: torch.device) -> tuple[int, ...]:
    return CONFIGS.get(config_key(m, n, k)) or _default_config(m, n, k, _multiprocessors(device))


def drain_for(major: int) -> bool:
    """`_wgmma_drain` where the MMAs are warpgroup MMAs: sm_90 only (sm_100 / sm_120 have no `wgmma`: ptxas refuses
    it there; 0 = no GPU compile)."""
    return major == 9


def _dense(t: torch.Tensor) -> torch.Tensor:
    """`t` `[R, K]` as a tensor descriptor wants it: rows K apart and a 16-byte aligned base (a fresh copy otherwise;
    torch calls a one-row view contiguous whatever its row stride)."""
    if t.stride(0) == t.shape[1] and t.stride(1) == 1 and t.data_ptr() % 16 == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def rows_to_f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` bf16 (unit stride over K) -> (`[M, K]` fp16, `[M]` fp32 powers of two) with `out * rs[:, None] ==
    x` for every element from 2**-28 of its row's largest up (`_rows_to_f16_kernel`)."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=torch.float16, device=x.device)
    rs = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _rows_to_f16_kernel[(m,)](x, out, rs, k, x.stride(0), BLOCK=1024, num_warps=4)
    return out, rs


def fp8_weight_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None, *, config=None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight-only FP8 product for few rows (a prompt's 64-256 tokens), computed as y^T = w x^T: x `[M, K]`
    bf16/fp16 (unit stride over K), weight `[N, K]` float8_e4m3fn contiguous, scale `[1, N]` fp32, bias `[N]` or None
    -> `[M, N]` in x's dtype (into `out` when given). With SPLIT_K > 1 each split writes fp32 partial sums
    (`[SPLIT_K, M, N]`, M * N * 4 bytes a split) and one more launch adds them in split order, so the result is the
    same bits on every run. `config`: a `CANDIDATES` entry (the benchmark's sweep); default `pick_config`."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    bn, t_max, bk, split, warps, stages, decode, tma = config or pick_config(m, n, k, x.device)
    # (0, 0): no GPU compile (CPU tensors, the interpreter): the integer decode by pointers
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda and not interpreting() else (0, 0)
    # `cvt.rn.f16x2.e4m3x2` exists from sm_89 (Ada, Hopper); DECODE 1 and 2 take bf16 activations
    decode = decode if cap >= (8, 9) and x.dtype == torch.bfloat16 else 0
    major = cap[0]
    # TMA: 16-byte aligned rows and base (K % 16: the codes' row stride) on an sm_90+ GPU
    tma = tma and k % 16 == 0 and major >= 9
    codes = _dense(weight.view(torch.uint8)) if tma else weight.view(torch.uint8)
    bt = block_t(m, t_max)
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)  # a split that would start past K is dropped
    if interpreting():
        warps, stages = 4, 1
    s = scale.reshape(-1)
    if decode == 0 or s.dtype != torch.float32 or not s.is_contiguous():  # the cvt decodes: no launch for the scale
        s = (s.float() * (DECODE_FACTOR if decode == 0 else 1.0)).contiguous()
    xk, rs = rows_to_f16(x) if decode == 2 else (x, s)
    b = bias if bias is not None else s
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else s
    desc_x, desc_w = xk, codes
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xk = _dense(xk)
        desc_x = TensorDescriptor.from_tensor(xk, [bt, bk])
        desc_w = TensorDescriptor.from_tensor(codes, [bn, bk])
    grid = (triton.cdiv(n, bn) * split * triton.cdiv(m, bt),)
    _wfp8_kernel[grid](
        xk, codes, s, b, rs, y, part, desc_x, desc_w, m, n, k, split, k_split, xk.stride(0), codes.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, PARTIAL=split > 1, BLOCK_N=bn, BLOCK_T=bt, BLOCK_K=bk, DECODE=decode,
        TMA=bool(tma), DRAIN=drain_for(major), UPCAST=not x.is_cuda and interpreting(), num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        block = 1024
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            part, s, b, y, m, n, y.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y
