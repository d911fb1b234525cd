"""Plain-torch reference for AdaLN modulation: RMSNorm, then per-row scale and shift."""

from __future__ import annotations

import torch

from h3render.kernels.fp8.naive import quantize_rows_naive


def modulate_naive(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float,
    fp8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * (1 + scale[row_index]) + shift[row_index], fp32 math, result in x's dtype.

    Args:
        x: [S, C] residual stream rows.
        norm_weight: [C] RMSNorm weight, or None for an unweighted norm.
        shift, scale: [R, C] modulation tables (strided views of a [R, 6, C] table are fine).
        row_index: [S] integer table row of each packed row.
        eps: RMSNorm epsilon.
        fp8: quantize the fp32 result per row instead (`kernels.fp8.quantize_rows_naive`), never rounding to x's
            dtype first.

    Returns:
        [S, C] in x's dtype, or (data [S, C] float8_e4m3fn, scale [S, 1] float32) when fp8.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if norm_weight is not None:
        y = y * norm_weight.float()
    row_index = row_index.long()
    y = y * (1.0 + scale.float().index_select(0, row_index)) + shift.float().index_select(0, row_index)
    return quantize_rows_naive(y) if fp8 else y.to(x.dtype)
