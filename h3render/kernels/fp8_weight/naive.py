"""Torch reference of the weight-only FP8 linear: `y = x @ (w8 * scale).T + bias`, the dequantized weight in fp32.

The reference dequantizes the e4m3 codes exactly (`float()` is exact), multiplies by the per-channel scale in fp32,
runs the product in fp32 and rounds once to x's dtype: the Triton kernel computes the same function with the scale
applied to the fp32 accumulator instead (exact codes in the dot), so the two differ by fp32 accumulation order and
the final rounding alone.
"""

from __future__ import annotations

import torch


def fp8_weight_linear_naive(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` float, weight `[N, K]` float8_e4m3fn, scale `[1, N]` (or `[N]`) fp32, bias `[N]` or None ->
    `[M, N]` in x's dtype."""
    w = weight.float() * scale.reshape(1, -1).t().float()  # [N, K] fp32, per output channel
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
