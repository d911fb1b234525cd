"""AdaLN gated residual of the packed rows: x + gate[r] * y.

r is the row's AdaLN table row (timestep_index * 3 + modality tag); gate is a block table's slot 2 (attention)
or slot 5 (FFN) of [R, 6, C], passed as the strided view `table[:, 2]` or `table[:, 5]`.
"""

from __future__ import annotations

import torch

from h3render.kernels.gated_residual.naive import gated_residual_naive
from h3render.kernels.modulate import check_rows
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["gated_residual", "gated_residual_naive"]


def gated_residual(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    row_index: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Add the gated branch output to the residual stream.

    Args:
        x: [S, C] residual stream (bf16 on GPU), unit stride over C.
        y: [S, C] branch output (attention out-projection or FFN), same dtype as x.
        gate: [R, C] gate table, e.g. `table[:, 2]` of a block's [R, 6, C] table.
        row_index: [S] int32/int64 table row of every packed row (values in [0, R); not checked on the GPU).
        out: optional [S, C] output; `out=x` updates the residual stream in place.
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [S, C] in x's dtype (out when given); math in fp32, rounded once.

    Raises:
        ValueError: shapes, dtypes, devices or strides do not fit the above.
    """
    check_rows(x, row_index, {"gate": gate})
    if y.shape != x.shape or y.dtype != x.dtype or y.device != x.device:
        raise ValueError(f"y must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(y.shape)}, {y.dtype}")
    check_last_dim_contiguous("y", y)
    if use_triton_for(x, use_triton):
        from h3render.kernels.gated_residual.triton_impl import gated_residual_triton

        return gated_residual_triton(x, y, gate, row_index, out=out)
    result = gated_residual_naive(x, y, gate, row_index)
    return result if out is None else out.copy_(result)
