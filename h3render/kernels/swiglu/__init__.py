"""SwiGLU activation of the FFN: silu(gate) * value, gate half first (DiT) or value half first (video VAE).

The official checkpoint's `mlp.fc1` stacks [gate; value] rows (released: 2 x 14336), so its output is [S, 2F]
with the gate in the first F columns. (diffusers' `SwiGLU` reads [value; gate]; its converter swaps the halves.)
The video VAE decoder's `ff.net.0.proj` keeps diffusers' [value; gate] (released: 2 x 8192): `value_first=True`.
"""

from __future__ import annotations

import torch

from h3render.kernels.fp8 import Fp8Rows
from h3render.kernels.swiglu.naive import swiglu_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["swiglu", "swiglu_naive"]


def swiglu(
    h: torch.Tensor, *, out: torch.Tensor | None = None, fp8: bool = False, value_first: bool = False,
    bias: torch.Tensor | None = None, use_triton: bool | None = None
) -> "torch.Tensor | Fp8Rows":
    """silu(gate) * value of h (+ bias) = [gate | value], or [value | gate] with value_first.

    Args:
        h: [S, 2F] fc1 output (bf16 on GPU), gate half first unless value_first, unit stride over the last axis.
        out: optional [S, F] output buffer (not with fp8).
        fp8: return `Fp8Rows` (e4m3 [S, F] + per-row fp32 scale [S, 1]) quantized from the fp32 result in the same
            pass, for the FP8 fc2 (`--precision fp8`).
        value_first: h = [value | gate] (the video VAE decoder, diffusers' `SwiGLU`).
        bias: optional [2F] fc1 bias in h's column order, added to h in fp32 before the activation (fc1's GEMM then
            skips it: the VAE decoder's FP8 FFN).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [S, F] in h's dtype (or `Fp8Rows` when fp8); math in fp32, rounded once.

    Raises:
        ValueError: h is not 2-D with an even last axis, or not unit-stride along it; bias is not [2F] contiguous.
    """
    if h.ndim != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F] with an even last dim, got shape {tuple(h.shape)}")
    check_last_dim_contiguous("h", h)
    if bias is not None and (bias.shape != (h.shape[1],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [2F={h.shape[1]}], got shape {tuple(bias.shape)}")
    if fp8 and out is not None:
        raise ValueError("out= is for the bf16 result; fp8=True allocates its Fp8Rows")
    if use_triton_for(h, use_triton):
        if fp8:
            from h3render.kernels.swiglu.triton_impl import swiglu_fp8_triton

            return Fp8Rows(*swiglu_fp8_triton(h, value_first=value_first, bias=bias))
        from h3render.kernels.swiglu.triton_impl import swiglu_triton

        return swiglu_triton(h, out=out, value_first=value_first, bias=bias)
    result = swiglu_naive(h, fp8=fp8, value_first=value_first, bias=bias)
    if fp8:
        return Fp8Rows(*result)
    return result if out is None else out.copy_(result)
