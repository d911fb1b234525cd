"""Plain-torch reference for the SwiGLU activation with gate-first halves."""

from __future__ import annotations

import torch

from h3render.kernels.fp8.naive import quantize_rows_naive


def swiglu_naive(h: torch.Tensor, fp8: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * value with h = [gate | value] along the last axis, fp32 math.

    Args:
        h: [S, 2F] fc1 output, gate half first (official checkpoint's `mlp.fc1` row order).
        fp8: quantize the fp32 result per row instead (`kernels.fp8.quantize_rows_naive`).

    Returns:
        [S, F] in h's dtype, or (data [S, F] float8_e4m3fn, scale [S, 1] float32) when fp8.
    """
    gate, value = h.float().chunk(2, dim=-1)  # [S, F] each
    y = torch.nn.functional.silu(gate) * value
    return quantize_rows_naive(y) if fp8 else y.to(h.dtype)
