"""A clip's soundtrack on its way to the AAC encoder: checked, trimmed or padded to the video's length, clipped.

The audio VAE emits round(frames/24*40) latents x `spec.AUDIO_HOP` (800) samples, which can fall short of
round(frames*32000/24) (`spec.audio_samples`) by up to half a latent (400 samples); one whole latent (25 ms) of zero
padding is accepted, anything shorter is refused.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from h3render.colour import MediaError
from h3render.spec import AUDIO_HOP

AUDIO_FRAME_SAMPLES = 1024  # AAC-LC frame length (32 ms at 32 kHz)
MAX_AUDIO_PAD = AUDIO_HOP  # samples of zero padding accepted at the end (one audio latent)


def prepare_audio(
    waveform: Union[np.ndarray, torch.Tensor], samples: int, *, name: str = "audio"
) -> np.ndarray:
    """Check, trim/pad and clip a stereo soundtrack for the AAC encoder.

    Args:
        waveform: float ``[2, n]``, numpy or torch (any device).
        samples: wanted length per channel (``spec.audio_samples(frames)``).
    Returns:
        float32 ``[2, samples]`` C-contiguous, clipped to [-1, 1]; zero-padded at the end if ``n`` is short by
        at most 800 samples.
    Raises:
        MediaError: wrong shape, non-float dtype, NaN/inf (never a silent file), or more than 800 samples short.
    """
    if isinstance(waveform, torch.Tensor):
        if not waveform.is_floating_point():
            raise MediaError(f"{name}: audio must be float, got {waveform.dtype}")
        waveform = waveform.detach().float().cpu().numpy()
    if not isinstance(waveform, np.ndarray) or waveform.dtype.kind != "f":
        raise MediaError(f"{name}: audio must be a float array [2, samples]")
    if waveform.ndim != 2 or waveform.shape[0] != 2:
        raise MediaError(f"{name}: audio must be [2, samples] (stereo), got shape {waveform.shape}")
    if not np.isfinite(waveform).all():
        raise MediaError(f"{name}: audio contains NaN or inf (the decode diverged); refusing to write it")
    n = waveform.shape[1]
    if n < samples - MAX_AUDIO_PAD:
        raise MediaError(f"{name}: audio has {n} samples per channel, need {samples} (at most {MAX_AUDIO_PAD} short)")
    out = np.zeros((2, samples), dtype=np.float32)
    keep = min(n, samples)
    np.clip(waveform[:, :keep], -1.0, 1.0, out=out[:, :keep])
    return out
