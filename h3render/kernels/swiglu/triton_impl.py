"""Triton launchers + kernels for SwiGLU: bf16 out over (row, column-block) programs; FP8 out one row per program.

The FP8 form needs the whole row's abs-max before it can write a byte, so one program holds a full row
(released F = 14336: gate and value are 2 x 16384-lane blocks) and writes e4m3 codes + the row scale from the fp32
result (`kernels.fp8.triton_impl`), with no bf16 intermediate.

Both kernels take two constexpr variants: VALUE_FIRST (h = [value | gate], the video VAE decoder's FFN; the DiT's
is gate first) and HAS_BIAS (fc1's bias [2F] added in fp32 here, so its GEMM runs without one). The FP8 kernel
moves 3.8 TB/s (docs/performance.md §9.2), where Inductor's looped two-pass reduction of the torch reference moved
1.5 TB/s (§21.7).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.fp8.triton_impl import fp8_rows_out, quantize_codes, row_scale
from h3render.kernels.utils import calculate_settings, interpreting

_MAX_BLOCK = 2048


@triton.jit
def _swiglu_cols(row, bias_ptr, cols, mask, F, VALUE_FIRST: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 silu(gate) * value at columns `cols` [BLOCK] of one h row (`row`: its first element); masked lanes 0.

    The halves: h[:, :F] and h[:, F:], gate first unless VALUE_FIRST; bias_ptr: [2F] contiguous, read if HAS_BIAS."""
    first = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(row + F + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        first += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        second += tl.load(bias_ptr + F + cols, mask=mask, other=0.0).to(tl.float32)
    if VALUE_FIRST:
        return second * tl.sigmoid(second) * first
    return first * tl.sigmoid(first) * second  # masked lanes: silu(0) * 0 = 0


@triton.jit
def _swiglu_kernel(
    h_ptr,  # [S, 2F] strides (stride_h_s, 1): [gate | value], or [value | gate] if VALUE_FIRST
    bias_ptr,  # [2F] contiguous, in h's column order (read only if HAS_BIAS)
    out_ptr,  # [S, F] strides (stride_out_s, 1)
    stride_h_s,
    stride_out_s,
    F,
    BLOCK_F: tl.constexpr,
    VALUE_FIRST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # int64 row index: S * 2F = 73,642 * 28,672 is just below 2**31 at the released size.
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    out = _swiglu_cols(h_ptr + s * stride_h_s, bias_ptr, cols, mask, F, VALUE_FIRST, HAS_BIAS)
    tl.store(out_ptr + s * stride_out_s + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(
    h: torch.Tensor, out: torch.Tensor | None = None, *, value_first: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch over (rows, column blocks). Arguments as in `kernels.swiglu.swiglu`, already validated.

    Args:
        h: [S, 2F]; out: optional [S, F] output; value_first: h = [value | gate]; bias: optional [2F] contiguous.

    Returns:
        [S, F] in h's dtype.
    """
    S, two_f = h.shape
    F = two_f // 2
    if out is None:
        out = torch.empty((S, F), dtype=h.dtype, device=h.device)
    if S == 0 or F == 0:
        return out
    block_f, num_warps = calculate_settings(min(F, _MAX_BLOCK))
    grid = (S, triton.cdiv(F, block_f))
    _swiglu_kernel[grid](h, bias, out, h.stride(0), out.stride(0), F, BLOCK_F=block_f, VALUE_FIRST=value_first,
                         HAS_BIAS=bias is not None, num_warps=num_warps)
    return out


@triton.jit
def _swiglu_fp8_kernel(
    h_ptr,  # [S, 2F] strides (stride_h_s, 1): [gate | value], or [value | gate] if VALUE_FIRST
    bias_ptr,  # [2F] contiguous, in h's column order (read only if HAS_BIAS)
    data_ptr,  # [S, F] uint8 view of the float8_e4m3fn output, strides (stride_d_s, 1)
    scale_ptr,  # [S, 1] fp32 contiguous
    stride_h_s,
    stride_d_s,
    F,
    BLOCK_F: tl.constexpr,
    VALUE_FIRST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    mask = cols < F
    y = _swiglu_cols(h_ptr + s * stride_h_s, bias_ptr, cols, mask, F, VALUE_FIRST, HAS_BIAS)
    scale = row_scale(y)
    tl.store(data_ptr + s * stride_d_s + cols, quantize_codes(y, scale, HW_CVT), mask=mask)
    tl.store(scale_ptr + s, scale)


def _launch_fp8(h: torch.Tensor, bias: torch.Tensor | None, value_first: bool, data: torch.Tensor,
                scale: torch.Tensor) -> None:
    """Run `_swiglu_fp8_kernel` over h [S, 2F] into data [S, F] float8_e4m3fn, scale [S, 1] float32: one program
    per row."""
    S, two_f = h.shape
    if S == 0:
        return
    F = two_f // 2
    block_f, _ = calculate_settings(F)
    # Warps sized for the 2F values a program loads (gate + value), not the F it writes.
    _, num_warps = calculate_settings(2 * block_f)
    _swiglu_fp8_kernel[(S,)](
        h, bias, data.view(torch.uint8), scale, h.stride(0), data.stride(0), F, BLOCK_F=block_f,
        VALUE_FIRST=value_first, HAS_BIAS=bias is not None, HW_CVT=not interpreting(), num_warps=num_warps
    )


def swiglu_fp8_triton(
    h: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None, *, value_first: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row: silu(gate) * value in fp32, then its e4m3 codes and scale. Validated by `swiglu`.

    Args:
        h: [S, 2F] gate half first unless value_first, F <= 32768 (released DiT 14336, video VAE 8192).
        out: optional (data [S, F] float8_e4m3fn, scale [S, 1] float32) to write into.
        value_first: h = [value | gate]; bias: optional [2F] contiguous, added to h in fp32.

    Returns:
        (data [S, F] float8_e4m3fn, scale [S, 1] float32), as `swiglu_naive(h, fp8=True, ...)`.
    """
    data, scale = fp8_rows_out(out, h.shape[0], h.shape[1] // 2, h.device)
    _launch_fp8(h, bias, value_first, data, scale)
    return data, scale
