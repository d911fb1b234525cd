"""Plain-torch reference for the AdaLN gated residual."""

from __future__ import annotations

import torch


def gated_residual_naive(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, row_index: torch.Tensor
) -> torch.Tensor:
    """x + gate[row_index] * y, fp32 math, result in x's dtype.

    Args:
        x: [S, C] residual stream; y: [S, C] branch output (attention or FFN).
        gate: [R, C] gate table; row_index: [S] integer table row of each packed row.

    Returns:
        [S, C] in x's dtype.
    """
    g = gate.float().index_select(0, row_index.long())
    return (x.float() + g * y.float()).to(x.dtype)
