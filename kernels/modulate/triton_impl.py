"""Triton launcher + kernel for AdaLN modulation: one program normalizes one packed row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import calculate_settings


@triton.jit
def _modulate_kernel(
    x_ptr,  # [S, C] strides (stride_x_s, 1)
    w_ptr,  # [C] RMSNorm weight; unused unless HAS_WEIGHT
    shift_ptr,  # [R, C] strides (stride_shift_r, 1)
    scale_ptr,  # [R, C] strides (stride_scale_r, 1)
    row_index_ptr,  # [S] int32/int64
    out_ptr,  # [S, C] strides (stride_out_s, 1)
    stride_x_s,
    stride_shift_r,
    stride_scale_r,
    stride_out_s,
    C,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_C: tl.constexpr,
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
    y = y * (1.0 + scale) + shift
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
    if S == 0:
        return out
    block_c, num_warps = calculate_settings(C)
    has_weight = norm_weight is not None
    _modulate_kernel[(S,)](
        x, norm_weight if has_weight else x, shift, scale, row_index, out,
        x.stride(0), shift.stride(0), scale.stride(0), out.stride(0),
        C, eps,
        HAS_WEIGHT=has_weight, BLOCK_C=block_c, num_warps=num_warps,
    )
    return out
