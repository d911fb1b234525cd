"""Per-row FP8 activations for the DiT's FP8 GEMMs (`--precision fp8`).

An `Fp8Rows` is what an FP8 linear reads: e4m3 data plus one fp32 scale per row, so that `torch._scaled_mm` can
apply the row scales in its epilogue. The kernels that write the linears' inputs (`modulate` -> qkv / gate / fc1,
`swiglu` -> fc2) produce it in the same pass (`fp8=True`); `quantize_rows` covers inputs no fused producer writes
(the attention output -> out-projection).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from h3render.kernels.fp8.naive import E4M3_MAX, MIN_SCALE, quantize_rows_naive
from h3render.kernels.utils import check_last_dim_contiguous

__all__ = ["E4M3_MAX", "MIN_SCALE", "Fp8Rows", "quantize_rows", "quantize_rows_naive"]


class Fp8Rows(NamedTuple):
    """data [S, K] torch.float8_e4m3fn (row-major), scale [S, 1] float32; row r ~= data[r].float() * scale[r]."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[S, K] in `dtype` (tests and fallbacks; the GEMM never materializes this)."""
        return (self.data.float() * self.scale).to(dtype)


def quantize_rows(y: torch.Tensor, *, use_triton: bool | None = None) -> Fp8Rows:
    """Per-row e4m3 quantization of `y` [S, K] (scale = row abs-max / 448), one pass over y.

    Args:
        y: [S, K] (bf16 on GPU), unit stride over K.
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Raises:
        ValueError: y is not 2-D or not unit-stride along its last axis.
    """
    if y.ndim != 2:
        raise ValueError(f"y must be [S, K], got shape {tuple(y.shape)}")
    check_last_dim_contiguous("y", y)
    from h3render.kernels.utils import use_triton_for

    if use_triton_for(y, use_triton):
        from h3render.kernels.fp8.triton_impl import quantize_rows_triton

        return Fp8Rows(*quantize_rows_triton(y))
    return Fp8Rows(*quantize_rows_naive(y))
