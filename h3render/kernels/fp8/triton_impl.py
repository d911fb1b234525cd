"""Triton per-row e4m3 quantization: the shared in-register helpers and the stand-alone `quantize_rows` launcher.

`row_scale` and `e4m3_codes` are @triton.jit helpers that the fused producers (`modulate`, `swiglu`) call on the
fp32 row they already hold in registers, so the activation is read once and written once, as e4m3.

Semantics (those of `kernels.fp8.naive.quantize_rows_naive`, bit for bit on the same fp32 row):
    scale = max(max|y| / 448, MIN_SCALE), one IEEE-rounded division;
    data  = RTNE_e4m3(clamp(y * (1 / scale), -448, 448)): one IEEE reciprocal per row, one multiply per element.
    (`tl.math.div_rn`: Triton's `/` on fp32 lowers to the approximate `div.full.f32` on NVIDIA, which would move
    scales and codes off the reference.)
    NaN anywhere in a row makes its scale NaN and the whole row NaN (as torch's amax does); an Inf makes the scale
    Inf, that element NaN (Inf * (1 / Inf) = Inf * 0) and the row's finite elements zero. Nothing non-finite
    turns finite.

Compiled, the rounding is the hardware's (`v.to(tl.float8e4nv)`: sm89+ `cvt.rn.satfinite.e4m3x2.f32`, RTNE).
Under the interpreter it is written out (`e4m3_codes`): the interpreter's fp32 -> fp8 cast rounds ties away from
zero, loses the carry into the exponent (127.7 -> 64) and maps NaN to 384 (triton 3.9 `interpreter._convert_float`),
so the CPU tests could not check the hardware form. Both give the reference's bytes (tests/unit/test_fp8_kernels.py:
interpreted on CPU, compiled on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.fp8.naive import E4M3_MAX, MIN_SCALE
from h3render.kernels.utils import calculate_settings, interpreting

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
# Biased fp32 exponent of 2**-6, e4m3's smallest normal (e4m3 bias 7): below it the grid step stays 2**-9.
_E4M3_MIN_NORMAL_EXP = tl.constexpr(127 - 6)
# Biased fp32 exponent of 256, the binade of 448 (the largest finite e4m3).
_E4M3_MAX_EXP = tl.constexpr(127 + 8)
# e4m3fn's NaN (S.1111.111); the sign bit is or-ed in separately.
_E4M3_NAN = tl.constexpr(0x7F)


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_scale(y, AXIS: tl.constexpr = 0):
    """y: [BLOCK] fp32 row (masked lanes 0) -> scalar fp32 scale = max|y| / 448 (>= MIN_SCALE, NaN propagates).

    AXIS = 1: y is [ROWS, BLOCK], one row a line -> [ROWS] scales, each that of its row alone."""
    # tl.max drops NaN on the GPU (max.f32); the reference's amax keeps it. (An explicit axis, not -1: the
    # interpreter's reduce does not wrap negative axes, triton 3.9.)
    amax = tl.reduce(tl.abs(y), AXIS, _max_propagate_nan)
    return tl.maximum(tl.math.div_rn(amax, _E4M3_MAX), _MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_codes(v):
    """v: fp32 block -> uint8 float8_e4m3fn bit patterns of clamp(v, +-448), rounded to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # the fp32 sign bit in e4m3's position (keeps -0.0 as in torch)
    a = tl.minimum(tl.abs(v), _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    is_nan = a != a
    a = tl.where(is_nan, 0.0, a)
    # Grid step of a's e4m3 binade is 2**(e - 3) (3 mantissa bits), subnormals share 2**-9. Adding and removing
    # magic = step * 2**23 rounds a onto that grid with the FPU's round-to-nearest-even (a < 16 step << magic).
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, _E4M3_MIN_NORMAL_EXP), _E4M3_MAX_EXP)
    magic = ((e + 20) << 23).to(tl.float32, bitcast=True)  # biased exponent (e - 127 - 3 + 23) + 127
    r = (a + magic) - magic  # exact e4m3 value, possibly carried into the next binade (never past 448)
    rb = r.to(tl.int32, bitcast=True)
    re = rb >> 23
    normal = ((re - (_E4M3_MIN_NORMAL_EXP - 1)) << 3) | ((rb >> 20) & 0x7)  # e4m3 exponent field, 3 mantissa bits
    subnormal = (r * 512.0).to(tl.int32)  # r = k * 2**-9, k in 0..7: exact
    code = tl.where(re >= _E4M3_MIN_NORMAL_EXP, normal, subnormal)
    code = tl.where(is_nan, _E4M3_NAN, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_codes(y, scale, HW_CVT: tl.constexpr):
    """y: fp32 block of one row, scale: its `row_scale` -> uint8 e4m3fn codes of RTNE(clamp(y * (1 / scale), +-448)).
    A [ROWS, BLOCK] block takes its [ROWS] scales as [ROWS, 1]: one reciprocal a row, broadcast along it.

    HW_CVT (compiled kernels, `not kernels.utils.interpreting()`): the hardware conversion; else `e4m3_codes` (the interpreter's cast is not RTNE)."""
    v = y * tl.math.div_rn(1.0, scale)
    if HW_CVT:
        # satfinite would clamp too; the explicit clamp keeps NaN (min/max.f32 drop it) and matches the reference.
        v = tl.minimum(tl.maximum(v, -_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), _E4M3_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return e4m3_codes(v)


@triton.jit
def _quantize_rows_kernel(
    y_ptr,  # [S, K] strides (stride_y_s, 1)
    data_ptr,  # [S, K] uint8 view of the float8_e4m3fn output, strides (stride_d_s, 1)
    scale_ptr,  # [S, 1] fp32, contiguous
    stride_y_s,
    stride_d_s,
    K,
    BLOCK_K: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    # The whole row is loaded once; the abs-max and the quantization both read it from registers.
    y = tl.load(y_ptr + s * stride_y_s + cols, mask=mask, other=0.0).to(tl.float32)
    scale = row_scale(y)
    tl.store(data_ptr + s * stride_d_s + cols, quantize_codes(y, scale, HW_CVT), mask=mask)
    tl.store(scale_ptr + s, scale)


def fp8_rows_out(out: tuple[torch.Tensor, torch.Tensor] | None, S: int, K: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (data [S, K] float8_e4m3fn, scale [S, 1] float32) a launcher writes: new (uninitialized) when `out` is
    None, else the caller's, validated (data with unit column stride, scale contiguous)."""
    if out is None:
        return (torch.empty((S, K), dtype=torch.float8_e4m3fn, device=device),
                torch.empty((S, 1), dtype=torch.float32, device=device))
    data, scale = out
    if data.shape != (S, K) or data.dtype != torch.float8_e4m3fn or (K > 1 and data.stride(1) != 1):
        raise ValueError(f"out data must be [S={S}, K={K}] float8_e4m3fn with unit column stride, got "
                         f"{tuple(data.shape)} {data.dtype} strides {tuple(data.stride())}")
    if scale.shape != (S, 1) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"out scale must be contiguous [S={S}, 1] float32, got {tuple(scale.shape)} {scale.dtype}")
    return data, scale


def quantize_rows_triton(
    y: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row: abs-max, scale and e4m3 codes from one read of the row. Validated by `quantize_rows`.

    Args:
        y: [S, K] any float dtype (bf16 on GPU), unit stride over K; K <= 65536 (one block per row;
            released widths: 5376 hidden, 7168 attention output, 14336 fc2 input).
        out: optional (data [S, K] float8_e4m3fn, scale [S, 1] float32) to write into (tests poison it).

    Returns:
        (data [S, K] float8_e4m3fn, scale [S, 1] float32), as `quantize_rows_naive`.
    """
    S, K = y.shape
    data, scale = fp8_rows_out(out, S, K, y.device)
    if S == 0:
        return data, scale
    block_k, num_warps = calculate_settings(K)
    _quantize_rows_kernel[(S,)](
        y, data.view(torch.uint8), scale, y.stride(0), data.stride(0), K, BLOCK_K=block_k, HW_CVT=not interpreting(),
        num_warps=num_warps
    )
    return data, scale
