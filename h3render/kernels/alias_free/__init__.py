"""BigVGAN's anti-aliased SnakeBeta activation (audio VAE decoder `Activation1d`): x2 Kaiser-sinc upsampling, SnakeBeta,
x2 low-pass downsampling, each with replicate padding.

The released decoder runs 127 of these per decode on fp32 signals of up to 2 x 8 x 648,000 samples. In torch each
is ~9 kernels and ~0.6 GB of memory traffic at the released 10 s shape (pad, transposed conv, five element-wise
SnakeBeta passes, pad, conv); the Triton path is two kernels and ~0.12 GB. Math is fp32 throughout; the sums run in
another order than cuDNN's, so results differ from the torch path by float rounding (~1e-7 relative).
"""

from __future__ import annotations

import torch

from h3render.kernels.alias_free.naive import (
    TAPS,
    alias_free_activation_naive,
    lowpass_downsample_naive,
    upsample_snake_naive,
)
from h3render.kernels.utils import use_triton_for

__all__ = ["alias_free_activation", "alias_free_activation_naive", "lowpass_downsample", "upsample_snake"]


def _check(x: torch.Tensor, channels: int | None = None, **filters: torch.Tensor) -> None:
    if x.ndim != 3 or x.dtype != torch.float32:
        raise ValueError(f"signal must be float32 [B, C, L], got {tuple(x.shape)} {x.dtype}")
    for name, t in filters.items():
        want = (TAPS,) if name.endswith("filter") else (channels,)
        if t.shape != want or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"{name} must be float32 {list(want)} on {x.device}, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")


def upsample_snake(x: torch.Tensor, up_filter: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, *,
                   use_triton: bool | None = None) -> torch.Tensor:
    """SnakeBeta of the x2 anti-aliased upsampling of x.

    Args:
        x: [B, C, L] float32.
        up_filter: [12] the upsampler's Kaiser-sinc filter (its stored buffer, gain not applied).
        alpha, inv_beta: [C] e^alpha and 1 / (e^beta + 1e-9).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [B, C, 2L] float32.

    Raises:
        ValueError: shapes, dtypes or devices do not fit the above.
    """
    _check(x, x.shape[1] if x.ndim == 3 else None, up_filter=up_filter, alpha=alpha, inv_beta=inv_beta)
    if use_triton_for(x, use_triton):
        from h3render.kernels.alias_free.triton_impl import upsample_snake_triton

        return upsample_snake_triton(x.contiguous(), up_filter.contiguous(), alpha.contiguous(),
                                     inv_beta.contiguous())
    return upsample_snake_naive(x, up_filter, alpha, inv_beta)


def lowpass_downsample(a: torch.Tensor, down_filter: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """Replicate-padded (5, 6) 12-tap low-pass at stride 2: [B, C, N] float32 -> [B, C, ceil(N / 2)].

    Raises:
        ValueError: shapes, dtypes or devices do not fit.
    """
    _check(a, down_filter=down_filter)
    if use_triton_for(a, use_triton):
        from h3render.kernels.alias_free.triton_impl import lowpass_downsample_triton

        return lowpass_downsample_triton(a.contiguous(), down_filter.contiguous())
    return lowpass_downsample_naive(a, down_filter)


def alias_free_activation(x: torch.Tensor, up_filter: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor,
                          down_filter: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[B, C, L] -> [B, C, L]: `lowpass_downsample(upsample_snake(x, ...), down_filter)`; arguments as there."""
    a = upsample_snake(x, up_filter, alpha, inv_beta, use_triton=use_triton)
    return lowpass_downsample(a, down_filter, use_triton=use_triton)
