"""Plain-torch reference for the SwiGLU activation with gate-first halves."""

from __future__ import annotations

import torch


def swiglu_naive(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * value with h = [gate | value] along the last axis, fp32 math.

    Args:
        h: [S, 2F] fc1 output, gate half first (official checkpoint's `mlp.fc1` row order).

    Returns:
        [S, F] in h's dtype.
    """
    gate, value = h.float().chunk(2, dim=-1)  # [S, F] each
    return (torch.nn.functional.silu(gate) * value).to(h.dtype)
