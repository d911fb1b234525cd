"""Triton launchers + kernels for SwiGLU: bf16 out over (row, column-block) programs; FP8 out one row per program.

The FP8 form needs the whole row's abs-max before it can write a byte, so one program holds a full row
(released F = 14336: gate and value are 2 x 16384-lane blocks) and writes e4m3 codes + the row scale from the fp32
result (`kernels.fp8.triton_impl`), with no bf16 intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.fp8.triton_impl import fp8_rows_out, quantize_codes, row_scale
from h3render.kernels.utils import calculate_settings, interpreting

_MAX_BLOCK = 2048


@triton.jit
def _swiglu_kernel(
    h_ptr,  # [S, 2F] strides (stride_h_s, 1): gate at [:, :F], value at [:, F:]
    out_ptr,  # [S, F] strides (stride_out_s, 1)
    stride_h_s,
    stride_out_s,
    F,
    BLOCK_F: tl.constexpr,
):
    # int64 row index: S * 2F = 73,642 * 28,672 is just below 2**31 at the released size.
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    row = h_ptr + s * stride_h_s
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(row + F + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * value
    tl.store(out_ptr + s * stride_out_s + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_triton(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch over (rows, column blocks). Arguments as in `kernels.swiglu.swiglu`, already validated.

    Args:
        h: [S, 2F]; out: optional [S, F] output.

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
    _swiglu_kernel[grid](h, out, h.stride(0), out.stride(0), F, BLOCK_F=block_f, num_warps=num_warps)
    return out


@triton.jit
def _swiglu_fp8_kernel(
    h_ptr,  # [S, 2F] strides (stride_h_s, 1): gate at [:, :F], value at [:, F:]
    data_ptr,  # [S, F] uint8 view of the float8_e4m3fn output, strides (stride_d_s, 1)
    scale_ptr,  # [S, 1] fp32 contiguous
    stride_h_s,
    stride_d_s,
    F,
    BLOCK_F: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    mask = cols < F
    row = h_ptr + s * stride_h_s
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(row + F + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * value  # masked lanes: silu(0) * 0 = 0
    scale = row_scale(y)
    tl.store(data_ptr + s * stride_d_s + cols, quantize_codes(y, scale, HW_CVT), mask=mask)
    tl.store(scale_ptr + s, scale)


def swiglu_fp8_triton(
    h: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row: silu(gate) * value in fp32, then its e4m3 codes and scale. Validated by `swiglu`.

    Args:
        h: [S, 2F] gate half first, F <= 32768 (released 14336).
        out: optional (data [S, F] float8_e4m3fn, scale [S, 1] float32) to write into.

    Returns:
        (data [S, F] float8_e4m3fn, scale [S, 1] float32), as `swiglu_naive(h, fp8=True)`.
    """
    S, two_f = h.shape
    F = two_f // 2
    data, scale = fp8_rows_out(out, S, F, h.device)
    if S == 0:
        return data, scale
    block_f, _ = calculate_settings(F)
    # Warps sized for the 2F values a program loads (gate + value), not the F it writes.
    _, num_warps = calculate_settings(2 * block_f)
    _swiglu_fp8_kernel[(S,)](
        h, data.view(torch.uint8), scale, h.stride(0), data.stride(0), F, BLOCK_F=block_f, HW_CVT=not interpreting(),
        num_warps=num_warps
    )
    return data, scale
