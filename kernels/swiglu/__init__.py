"""SwiGLU activation of the FFN: silu(gate) * value, gate half first.

The official checkpoint's `mlp.fc1` stacks [gate; value] rows (released: 2 x 14336), so its output is [S, 2F]
with the gate in the first F columns. (diffusers' `SwiGLU` reads [value; gate]; its converter swaps the halves.)
"""

from __future__ import annotations

import torch

from h3render.kernels.swiglu.naive import swiglu_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["swiglu", "swiglu_naive"]


def swiglu(h: torch.Tensor, *, out: torch.Tensor | None = None, use_triton: bool | None = None) -> torch.Tensor:
    """silu(h[:, :F]) * h[:, F:].

    Args:
        h: [S, 2F] fc1 output (bf16 on GPU), gate half first, unit stride over the last axis.
        out: optional [S, F] output buffer.
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [S, F] in h's dtype; math in fp32, rounded once.

    Raises:
        ValueError: h is not 2-D with an even last axis, or not unit-stride along it.
    """
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] with an even last dim, got shape {tuple(h.shape)}")
    check_last_dim_contiguous("h", h)
    if use_triton_for(h, use_triton):
        from h3render.kernels.swiglu.triton_impl import swiglu_triton

        return swiglu_triton(h, out=out)
    result = swiglu_naive(h)
    return result if out is None else out.copy_(result)
