"""Plain-torch reference for the SwiGLU activation: gate half first (DiT) or value half first (video VAE)."""

from __future__ import annotations

import torch

from h3render.kernels.fp8.naive import quantize_rows_naive


def swiglu_naive(
    h: torch.Tensor, fp8: bool = False, *, value_first: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * value with h (+ bias) = [gate | value] (or [value | gate]) along the last axis, fp32 math.

    Args:
        h: [S, 2F] fc1 output, gate half first (official DiT checkpoint's `mlp.fc1` row order) unless value_first.
        fp8: quantize the fp32 result per row instead (`kernels.fp8.quantize_rows_naive`).
        value_first: h = [value | gate] (the video VAE's `ff.net.0.proj`, diffusers' `SwiGLU`).
        bias: optional [2F] fc1 bias, in h's column order, added to h in fp32 before the activation (fc1's GEMM
            then runs without it: one rounding fewer than a bf16 bias add).

    Returns:
        [S, F] in h's dtype, or (data [S, F] float8_e4m3fn, scale [S, 1] float32) when fp8.
    """
    hf = h.float()
    if bias is not None:
        hf = hf + bias.float()
    first, second = hf.chunk(2, dim=-1)  # [S, F] each
    gate, value = (second, first) if value_first else (first, second)
    y = torch.nn.functional.silu(gate) * value
    return quantize_rows_naive(y) if fp8 else y.to(h.dtype)
