"""Plain-torch reference for BigVGAN's anti-aliased SnakeBeta activation (the audio VAE decoder's `Activation1d`).

The same ops as `h3render.models.audio_vae.AliasFreeActivation`'s reference form: replicate-pad 5, depthwise
transposed conv with the 12-tap Kaiser-sinc filter at stride 2 (gain 2), crop 15 each side, SnakeBeta, replicate-pad
(5, 6), depthwise conv with the 12-tap low-pass filter at stride 2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TAPS = 12  # released BigVGAN filters: kernel 12 for the x2 upsampler and the x2 downsampler
RATIO = 2


def upsample_snake_naive(x: torch.Tensor, up_filter: torch.Tensor, alpha: torch.Tensor,
                         inv_beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, L] -> SnakeBeta(upsample_x2(x)) [B, C, 2L]; up_filter [12], alpha / inv_beta [C] (e^alpha and
    1 / (e^beta + 1e-9), the activation's coefficients)."""
    c = x.shape[1]
    pad = TAPS // RATIO - 1  # 5
    crop = pad * RATIO + (TAPS - RATIO) // 2  # 15 (both sides: the kernel size is even)
    xp = F.pad(x, (pad, pad), mode="replicate")
    u = RATIO * F.conv_transpose1d(xp, up_filter.view(1, 1, TAPS).expand(c, -1, -1), stride=RATIO, groups=c)
    u = u[..., crop:-crop]
    return u + inv_beta.view(1, c, 1) * torch.sin(alpha.view(1, c, 1) * u).pow(2)


def lowpass_downsample_naive(a: torch.Tensor, down_filter: torch.Tensor) -> torch.Tensor:
    """a [B, C, N] -> replicate-pad (5, 6), depthwise 12-tap low-pass at stride 2 -> [B, C, ceil(N / 2)]."""
    c = a.shape[1]
    ap = F.pad(a, (TAPS // 2 - 1, TAPS // 2), mode="replicate")
    return F.conv1d(ap, down_filter.view(1, 1, TAPS).expand(c, -1, -1), stride=RATIO, groups=c)


def alias_free_activation_naive(x: torch.Tensor, up_filter: torch.Tensor, alpha: torch.Tensor,
                                inv_beta: torch.Tensor, down_filter: torch.Tensor) -> torch.Tensor:
    """x [B, C, L] -> [B, C, L]: upsample x2, SnakeBeta, low-pass and downsample x2."""
    return lowpass_downsample_naive(upsample_snake_naive(x, up_filter, alpha, inv_beta), down_filter)
