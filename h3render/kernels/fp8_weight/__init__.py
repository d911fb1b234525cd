"""Weight-only FP8 linear: `y = x @ dequantize(w8).T + bias` without materializing the dequantized weight.

What the FP8 text encoder runs (`models.fp8.Fp8WeightLinear`, issue 26 item 3): before this kernel every call
dequantized its weight to fp32 and then bf16 (11 bytes moved per weight) and ran a bf16 GEMM; the Triton kernel reads
the e4m3 codes once (1 byte per weight) and decodes them in registers (with the sm_89+ conversion instruction, or with
integer operations where there is none: Ampere sm_80, whose weight-only FP8 DiT would need the same product). It is
built for a prompt's few rows (`triton_impl`); `Fp8WeightLinear` multiplies more rows by `fp8_dequantize` + cuBLAS.
"""

from __future__ import annotations

import torch

from h3render.kernels.fp8_weight.naive import fp8_weight_linear_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["fp8_dequantize", "fp8_weight_linear", "fp8_weight_linear_naive"]


def fp8_weight_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      *, use_triton: bool | None = None) -> torch.Tensor:
    """`[..., K]` bf16/fp16 x `[N, K]` float8_e4m3fn (scale `[1, N]` fp32, one per output channel) -> `[..., N]` in x's
    dtype.

    Args:
        use_triton: None = the Triton kernel on CUDA tensors, the torch reference otherwise; True / False force one
            (True on CPU tensors needs TRITON_INTERPRET=1).

    Raises:
        ValueError: shapes that do not match, a weight that is not e4m3, activations that are not bf16 / fp16 on the
            Triton path, or x not unit-stride along K.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2:
        raise ValueError(f"weight must be [N, K] float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k or scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"fp8_weight_linear: x [..., {x.shape[-1]}], weight [{n}, {k}], scale {tuple(scale.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not match")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not use_triton_for(x2, use_triton):
        return fp8_weight_linear_naive(x2, weight, scale, bias).view(*lead, n)
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_weight_linear: the Triton kernel takes bf16 / fp16 activations, got {x2.dtype}")
    check_last_dim_contiguous("x", x2)
    from h3render.kernels.fp8_weight.triton_impl import fp8_weight_linear_triton

    return fp8_weight_linear_triton(x2, weight.contiguous(), scale, bias).view(*lead, n)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   *, use_triton: bool | None = None) -> torch.Tensor:
    """`(weight.float() * scale.t()).to(dtype)`, `[N, K]` e4m3 + `[1, N]` fp32 -> `[N, K]` `dtype`, bit for bit the
    same; on CUDA one Triton pass (1 byte read and 2 written per weight, against 11 for the torch expression's fp32
    transient). What a large row count multiplies with cuBLAS (`models.fp8.Fp8WeightLinear`)."""
    if weight.dtype != torch.float8_e4m3fn or weight.ndim != 2 or scale.numel() != weight.shape[0]:
        raise ValueError(f"fp8_dequantize: weight [N, K] float8_e4m3fn and scale [1, N], got {weight.dtype} "
                         f"{tuple(weight.shape)} and {tuple(scale.shape)}")
    if not use_triton_for(weight, use_triton):
        return (weight.float() * scale.reshape(1, -1).t().float()).to(dtype)
    from h3render.kernels.fp8_weight.triton_impl import dequantize_triton

    return dequantize_triton(weight.contiguous(), scale, dtype)
