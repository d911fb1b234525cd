"""Triton launcher + kernel for residual add + RMSNorm + bf16 rounding + e4m3 row quantization, one row per program.

The FP8 video VAE decoder block (`models.video_vae.ViTBlock`) runs this at each residual add: one read of the
fp32 residual row x [N] and the linear's output y [N] (bf16), one write of x_new (fp32) and of the next linear's
e4m3 codes + row scale. Unfused, Inductor made it two or three passes over the 118 MB residual per point
(docs/performance.md §27 profile: `x + ff*scale2` 3.0 ms, norm1 + amax + e4m3 3.45 ms, `x + attn*scale1` +
norm stats 2.07 ms, norm2 + amax + e4m3 2.82 ms per 8-item batch of 36 blocks).

Per row, the reference's operations in the reference's order (`naive.residual_norm_fp8_naive`):
    x_new = x + y * gain                               products rounded before the add (no FMA: `_times`)
    r     = 1 / sqrt(sum(x_new**2) / N + eps)          division and square root IEEE-rounded (div_rn, sqrt_rn)
    h     = bf16_rtne((x_new * r) * weight)
    codes, scale = the e4m3 row quantization of h      (`kernels.fp8.triton_impl.row_scale` / `quantize_codes`)
x_new is bit-equal to torch's. h can differ from torch's only through r: the sum of squares is a tree here and a
cascade in torch (and the CPU's `torch.rsqrt` is not the IEEE 1/sqrt: 0.6 % of fp32 inputs 1 ulp apart, torch 2.13
AVX-512); r then moves by an ulp or two, which changes a bf16 h (and maybe its e4m3 code, or the row scale when it is
the row's abs-max) only where the fp32 h lies within a few ulps of a bf16 rounding midpoint
(tests/unit/test_residual_norm_fp8.py checks codes and scales bit for bit everywhere else).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3render.kernels.fp8.triton_impl import fp8_rows_out, quantize_codes, row_scale
from h3render.kernels.utils import calculate_settings, interpreting


@triton.jit
def _times(y, g, HW_CVT: tl.constexpr):
    """y * g rounded on its own: compiled, `mul.rn` (a plain product followed by an add is contracted to an FMA,
    which would skip the rounding that torch's separate multiply and add kernels make); the interpreter (numpy)
    never contracts and has no libdevice."""
    if HW_CVT:
        return libdevice.mul_rn(y, g)
    return y * g


@triton.jit
def _round_bf16(h, HW_CVT: tl.constexpr):
    """h: fp32 block -> the same values rounded to bf16 (nearest, ties to even) and held in fp32; NaN stays NaN.

    Compiled: the hardware conversion (`cvt.rn.bf16.f32`). The interpreter's fp32 -> bf16 cast rounds ties away
    from zero (triton 3.9 `_convert_float`), so it is written out as torch's `round_to_nearest_even` on the bits."""
    if HW_CVT:
        return h.to(tl.bfloat16).to(tl.float32)
    bits = h.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # <= 0x7F800000 (Inf) unless NaN: adding <= 0x8000 stays below 2**31
    rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000: keep sign-less bf16 bits
    out = (rounded | (bits & -2147483648)).to(tl.float32, bitcast=True)  # the sign bit back
    return tl.where(h != h, h, out)  # NaN: as is (torch writes its canonical NaN; both are NaN)


@triton.jit
def _residual_norm_fp8_kernel(
    x_ptr,  # [M, N] fp32, strides (stride_x, 1)
    y_ptr,  # [M, N] strides (stride_y, 1), any float dtype (read only if HAS_RESIDUAL)
    gain_ptr,  # [N] contiguous (read only if HAS_RESIDUAL)
    weight_ptr,  # [N] contiguous RMSNorm weight
    x_out_ptr,  # [M, N] fp32, strides (stride_xo, 1) (written only if HAS_RESIDUAL)
    data_ptr,  # [M, N] uint8 view of the float8_e4m3fn output, strides (stride_d, 1)
    scale_ptr,  # [M, 1] fp32 contiguous
    stride_x,
    stride_y,
    stride_xo,
    stride_d,
    N,
    n_float,  # N as fp32: torch's mean divides the fp32 sum by it
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    # int64 row offsets: M * N is 29 M at a released 8-item batch, but nothing here bounds the batch.
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + m * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = tl.load(y_ptr + m * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gain_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x + _times(y, g, HW_CVT)
        tl.store(x_out_ptr + m * stride_xo + cols, x, mask=mask)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # fp32 as torch's norm, whatever the launcher passes: Inductor, which launched this kernel inside compiled
    # decoder blocks until 2026-12-04, passed Python floats as fp64 scalars, which promoted the sum and failed
    # libdevice's fp32 signatures (CUDA, torch 2.11).
    mean_sq = tl.math.div_rn(tl.sum(x * x, axis=0), tl.cast(n_float, tl.float32))  # masked lanes add 0
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + tl.cast(eps, tl.float32)))
    # Masked lanes must be 0 for `row_scale` (they are, unless r is NaN: then the whole row is NaN anyway).
    h = tl.where(mask, _round_bf16((x * r) * w, HW_CVT), 0.0)
    scale = row_scale(h)
    tl.store(data_ptr + m * stride_d + cols, quantize_codes(h, scale, HW_CVT), mask=mask)
    tl.store(scale_ptr + m, scale)


def _launch(x: torch.Tensor, y: torch.Tensor | None, gain: torch.Tensor | None, weight: torch.Tensor, eps: float,
            x_out: torch.Tensor | None, data: torch.Tensor, scale: torch.Tensor) -> None:
    """Run `_residual_norm_fp8_kernel` over x [M, N]: one program per row. y, gain, x_out: all three or none (the
    no-residual form)."""
    M, N = x.shape
    if M == 0:
        return
    block_n, num_warps = calculate_settings(N)
    has_residual = y is not None
    if not has_residual:
        # Placeholder tensors, never read or written without HAS_RESIDUAL: both forms keep one signature.
        y, gain, x_out = x, weight, scale
    _residual_norm_fp8_kernel[(M,)](
        x, y, gain, weight, x_out, data.view(torch.uint8), scale,
        x.stride(0), y.stride(0) if has_residual else 0, x_out.stride(0) if has_residual else 0, data.stride(0),
        N, float(N), eps, BLOCK_N=block_n, HAS_RESIDUAL=has_residual, HW_CVT=not interpreting(), num_warps=num_warps,
    )


def residual_norm_fp8_triton(
    x: torch.Tensor, y: torch.Tensor | None, gain: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One program per row. Arguments as in `kernels.residual_norm_fp8.residual_norm_fp8`, already validated.

    Args:
        x: [M, N] float32, unit column stride, N <= 65536 (released 2048); y: [M, N] or None, unit column stride;
        gain: [N] contiguous (None with y); weight: [N] contiguous; eps: RMSNorm epsilon.
        out: optional (x_new [M, N] float32 with unit column stride, ignored (may be None) without y;
            data [M, N] float8_e4m3fn; scale [M, 1] float32) to write into.

    Returns:
        (x_new [M, N] float32, x itself without y; data [M, N] float8_e4m3fn; scale [M, 1] float32).
    """
    M, N = x.shape
    x_out, data, scale = (None, None, None) if out is None else out
    data, scale = fp8_rows_out(None if out is None else (data, scale), M, N, x.device)
    if y is None:
        x_out = x
    elif x_out is None:
        x_out = torch.empty((M, N), dtype=torch.float32, device=x.device)
    elif x_out.shape != (M, N) or x_out.dtype != torch.float32 or (N > 1 and x_out.stride(1) != 1):
        raise ValueError(f"out x_new must be [M={M}, N={N}] float32 with unit column stride, got "
                         f"{tuple(x_out.shape)} {x_out.dtype}")
    _launch(x, y, gain, weight, eps, None if y is None else x_out, data, scale)
    return x_out, data, scale
