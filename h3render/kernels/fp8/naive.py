"""Plain-torch reference for per-row FP8 (e4m3) quantization."""

from __future__ import annotations

import torch

# Largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max): a row's abs-max maps onto it.
E4M3_MAX = 448.0
# A zero row would give scale 0 and 0/0 on dequantization; its scale is floored here (any positive value
# dequantizes zeros to zeros). fp32's smallest normal / E4M3_MAX keeps the reciprocal finite.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_rows_naive(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of `y` to e4m3 with its own scale: y ~= data.float() * scale.

    Args:
        y: [S, K] any float dtype; the math runs in fp32 (fused producers pass their fp32 result before rounding).

    Returns:
        data [S, K] torch.float8_e4m3fn = RTNE(clamp(y * (1 / scale), +-448)), scale [S, 1] float32 =
        max(|y_row|) / 448 (>= MIN_SCALE); both divisions IEEE-rounded, as the Triton kernels compute them.
        The [S, 1] shape is what `torch._scaled_mm` takes as a row-wise scale_a.
    """
    yf = y.float()
    amax = yf.abs().amax(dim=-1, keepdim=True)
    # Divided by a tensor, not the Python float: CUDA torch turns division by a scalar into a multiply by its
    # reciprocal (1/448 is inexact), which moves some scales 1 ulp off the IEEE quotient the Triton kernels compute;
    # on the H200 that flipped 1.2e-3 of the codes at exact e4m3 ties (test_fp8_kernels_on_cuda_match_naive).
    scale = (amax / torch.full_like(amax, E4M3_MAX)).clamp_min(MIN_SCALE)
    # One reciprocal per row and a multiply per element (the kernels' cheaper form of y / scale; at most 1 fp32 ulp
    # apart before the e4m3 rounding).
    inv = torch.ones_like(scale) / scale
    data = (yf * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale
