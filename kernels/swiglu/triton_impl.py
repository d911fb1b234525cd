"""Triton launcher + kernel for SwiGLU; a program covers BLOCK_F outputs of one row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import calculate_settings

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
