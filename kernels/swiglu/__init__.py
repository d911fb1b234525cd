"""SwiGLU activation of the FFN: silu(gate) * value, gate half first.

The official checkpoint's `mlp.fc1` stacks [gate; value] rows (released: 2 x 14336), so its output is [S, 2F]
with the gate in the first F columns. (diffusers' `SwiGLU` reads [value; gate]; its converter swaps the halves.)
"""

from __future__ import annotations

import torch

from h3render.kernels.fp8 import Fp8Rows
from h3render.kernels.swiglu.naive import swiglu_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["swiglu", "swiglu_naive"]


def swiglu(
    h: torch.Tensor, *, out: torch.Tensor | None = None, fp8: bool = False, use_triton: bool | None = None
) -> "torch.Tensor | Fp8Rows":
    """silu(h[:, :F]) * h[:, F:].

    Args:
        h: [S, 2F] fc1 output (bf16 on GPU), gate half first, unit stride over the last axis.
        out: optional [S, F] output buffer (not with fp8).
        fp8: return `Fp8Rows` (e4m3 [S, F] + per-row fp32 scale [S, 1]) quantized from the fp32 result in the same
            pass, for the FP8 fc2 (`--precision fp8`).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [S, F] in h's dtype (or `Fp8Rows` when fp8); math in fp32, rounded once.

    Raises:
        ValueError: h is not 2-D with an even last axis, or not unit-stride along it.
    """
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] with an even last dim, got shape {tuple(h.shape)}")
    check_last_dim_contiguous("h", h)
    if fp8 and out is not None:
        raise ValueError("out= is for the bf16 result; fp8=True allocates its Fp8Rows")
    if use_triton_for(h, use_triton):
        if fp8:
            from h3render.kernels.swiglu.triton_impl import swiglu_fp8_triton

            return Fp8Rows(*swiglu_fp8_triton(h))
        from h3render.kernels.swiglu.triton_impl import swiglu_triton

        return swiglu_triton(h, out=out)
    if fp8:
        return Fp8Rows(*swiglu_naive(h, fp8=True))
    result = swiglu_naive(h)
    return result if out is None else out.copy_(result)
