"""Triton launcher + kernel for the AdaLN gated residual; a program covers one row's BLOCK_C columns."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import calculate_settings

# Element-wise: a block of 2048 columns per program is enough to stream at bandwidth (hidden 5376 -> 3 programs).
_MAX_BLOCK = 2048


@triton.jit
def _gated_residual_kernel(
    x_ptr,  # [S, C] strides (stride_x_s, 1)
    y_ptr,  # [S, C] strides (stride_y_s, 1)
    gate_ptr,  # [R, C] strides (stride_gate_r, 1)
    row_index_ptr,  # [S] int32/int64
    out_ptr,  # [S, C] strides (stride_out_s, 1); may alias x
    stride_x_s,
    stride_y_s,
    stride_gate_r,
    stride_out_s,
    C,
    BLOCK_C: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    r = tl.load(row_index_ptr + s).to(tl.int64)
    x = tl.load(x_ptr + s * stride_x_s + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + s * stride_y_s + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + r * stride_gate_r + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + s * stride_out_s + cols, (x + g * y).to(out_ptr.dtype.element_ty), mask=mask)


def gated_residual_triton(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    row_index: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch over (rows, column blocks). Arguments as in `kernels.gated_residual.gated_residual`, validated.

    Args:
        x, y: [S, C]; gate: [R, C]; row_index: [S] int; out: optional [S, C], may be x itself.

    Returns:
        [S, C] in x's dtype.
    """
    S, C = x.shape
    if out is None:
        out = torch.empty((S, C), dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    block_c, num_warps = calculate_settings(min(C, _MAX_BLOCK))
    grid = (S, triton.cdiv(C, block_c))
    _gated_residual_kernel[grid](
        x, y, gate, row_index, out,
        x.stride(0), y.stride(0), gate.stride(0), out.stride(0),
        C,
        BLOCK_C=block_c, num_warps=num_warps,
    )
    return out
