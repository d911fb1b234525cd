"""Plain-torch reference for the video VAE decoder's residual add + RMSNorm + bf16 rounding + e4m3 row quantization."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3render.kernels.fp8.naive import quantize_rows_naive


def residual_norm_fp8_naive(
    x: torch.Tensor, y: torch.Tensor | None, gain: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an FP8 `models.video_vae.ViTBlock` computes unfused at a fusion point, op for op.

    Per row: x_new = x + y.float() * gain (the residual add; skipped when y is None), then
    `nn.RMSNorm(N, eps)` of x_new in fp32 with `weight`, rounded to bf16 (the block's `.to(dtype)`), then the
    per-row e4m3 quantization `Fp8Linear` applies to a bf16 input (`kernels.fp8.quantize_rows_naive`).

    Args:
        x: [M, N] float32 residual stream rows.
        y: [M, N] (bf16: a linear's output) or None; gain: [N] float32 residual gain (the block's scale1 / scale2),
            None when y is None.
        weight: [N] float32 RMSNorm weight; eps: its epsilon.

    Returns:
        (x_new [M, N] float32, a new tensor; x itself when y is None, data [M, N] float8_e4m3fn,
        scale [M, 1] float32).
    """
    x_new = x if y is None else x + y.float() * gain
    h = F.rms_norm(x_new, (x.shape[-1],), weight, eps).to(torch.bfloat16)
    return (x_new, *quantize_rows_naive(h))
