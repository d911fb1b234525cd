"""Triton launchers + kernel for AdaLN modulation: one program normalizes one packed row.

The same kernel writes either the row in the output dtype (bf16) or, with FP8, its e4m3 codes and per-row scale
straight from the fp32 result (`kernels.fp8.triton_impl`): no bf16 intermediate, one read of x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.fp8.triton_impl import fp8_rows_out, quantize_codes, row_scale
from h3render.kernels.utils import calculate_settings, interpreting


@triton.jit
def _modulate_kernel(
    x_ptr,  # [S, C] strides (stride_x_s, 1)
    w_ptr,  # [C] RMSNorm weight; unused unless HAS_WEIGHT
    shift_ptr,  # [R, C] strides (stride_shift_r, 1)
    scale_ptr,  # [R, C] strides (stride_scale_r, 1)
    row_index_ptr,  # [S] int32/int64
    out_ptr,  # [S, C] strides (stride_out_s, 1): x's dtype, or the uint8 view of float8_e4m3fn data if FP8
    row_scale_ptr,  # [S, 1] fp32 contiguous per-row scale; unused unless FP8
    stride_x_s,
    stride_shift_r,
    stride_scale_r,
    stride_out_s,
    C,
    eps,
    HAS_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    r = tl.load(row_index_ptr + s).to(tl.int64)

    x = tl.load(x_ptr + s * stride_x_s + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)  # masked lanes are 0: the sum covers C channels
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + r * stride_scale_r + cols, mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + r * stride_shift_r + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (1.0 + scale) + shift  # masked lanes stay 0, so they do not move the row's abs-max
    if FP8:
        q_scale = row_scale(y)
        tl.store(out_ptr + s * stride_out_s + cols, quantize_codes(y, q_scale, HW_CVT), mask=mask)
        tl.store(row_scale_ptr + s, q_scale)
    else:
        tl.store(out_ptr + s * stride_out_s + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def modulate_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch one program per row. Arguments as in `kernels.modulate.modulate`, already validated.

    Args:
        x: [S, C]; norm_weight: [C] or None; shift, scale: [R, C]; row_index: [S] int; eps: float.
        out: optional [S, C] output (unit stride over C), may alias x.

    Returns:
        [S, C] in x's dtype.
    """
    S, C = x.shape
    if out is None:
        out = torch.empty((S, C), dtype=x.dtype, device=x.device)
    _launch(x, norm_weight, shift, scale, row_index, eps, out, None)
    return out


def modulate_fp8_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Modulate and quantize each row to e4m3 in one program. Arguments as in `kernels.modulate.modulate`.

    Args:
        x: [S, C] with C <= 65536 (released hidden 5376); norm_weight: [C] or None; shift, scale: [R, C];
        row_index: [S] int; eps: float.
        out: optional (data [S, C] float8_e4m3fn, scale [S, 1] float32) to write into.

    Returns:
        (data [S, C] float8_e4m3fn, scale [S, 1] float32): `kernels.fp8` semantics applied to the fp32 result,
        as `modulate_naive(..., fp8=True)`.
    """
    S, C = x.shape
    data, q_scale = fp8_rows_out(out, S, C, x.device)
    _launch(x, norm_weight, shift, scale, row_index, eps, data, q_scale)
    return data, q_scale


def _launch(x, norm_weight, shift, scale, row_index, eps, out, q_scale) -> None:
    """One program per row into `out` [S, C]: x's dtype when `q_scale` is None, else e4m3 data with its [S, 1]
    row scales in `q_scale`."""
    S, C = x.shape
    if S == 0:
        return
    block_c, num_warps = calculate_settings(C)
    has_weight = norm_weight is not None
    fp8 = q_scale is not None
    _modulate_kernel[(S,)](
        x, norm_weight if has_weight else x, shift, scale, row_index, out.view(torch.uint8) if fp8 else out,
        q_scale if fp8 else x,
        x.stride(0), shift.stride(0), scale.stride(0), out.stride(0),
        C, eps,
        HAS_WEIGHT=has_weight, FP8=fp8, BLOCK_C=block_c, HW_CVT=fp8 and not interpreting(), num_warps=num_warps,
    )
