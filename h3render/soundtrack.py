"""A clip's soundtrack on its way to the AAC encoder: checked, trimmed or padded to the video's length, measured
(peak and clipped samples: `AudioLevels`), clipped.

The audio VAE emits round(frames/24*40) latents x `spec.AUDIO_HOP` (800) samples, which can fall short of
round(frames*32000/24) (`spec.audio_samples`) by up to half a latent (400 samples); one whole latent (25 ms) of zero
padding is accepted, anything shorter is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from h3render.colour import MediaError
from h3render.spec import AUDIO_HOP

AUDIO_FRAME_SAMPLES = 1024  # AAC-LC frame length (32 ms at 32 kHz)
MAX_AUDIO_PAD = AUDIO_HOP  # samples of zero padding accepted at the end (one audio latent)


@dataclass
class AudioLevels:
    """How loud a soundtrack was before it was clipped to full scale, summed over the windows `prepare_audio` saw:
    the sidecar's `extra.audio` and the warning when samples were clipped.

    A sample at or beyond full scale (|x| >= 1) counts as clipped: the released audio VAE clamps its output to
    [-1, 1] itself (`models.audio_vae`), so what it clipped arrives at exactly full scale, and what a caller hands
    over beyond it is clipped here.

    Attributes:
        peak: the largest |sample| (1.0 = 0 dBFS).
        clipped: samples (both channels) at or beyond full scale.
        samples: samples measured (both channels).
    """

    peak: float = 0.0
    clipped: int = 0
    samples: int = 0

    def add(self, block: np.ndarray) -> None:
        """Measure `block` (float ``[2, n]``, before clipping)."""
        magnitude = np.abs(block)
        self.peak = max(self.peak, float(magnitude.max(initial=0.0)))
        self.clipped += int(np.count_nonzero(magnitude >= 1.0))
        self.samples += magnitude.size

    @property
    def peak_dbfs(self) -> float | None:
        """The peak in dB relative to full scale (0.0: at full scale); None for silence (-inf is not JSON)."""
        return 20.0 * math.log10(self.peak) if self.peak > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {"peak_dbfs": self.peak_dbfs, "clipped_samples": self.clipped, "samples": self.samples,
                "clipped_fraction": self.clipped / self.samples if self.samples else 0.0}

    def warning(self, name: str) -> str | None:
        """The one-line warning when samples were clipped, else None."""
        if not self.clipped:
            return None
        return (f"h3render: warning: {name}: {self.clipped} of {self.samples} audio samples "
                f"({100.0 * self.clipped / self.samples:.2g}%) reached full scale and were clipped (peak "
                f"{self.peak_dbfs:+.1f} dBFS); the sidecar's extra.audio records it")


def prepare_audio(
    waveform: Union[np.ndarray, torch.Tensor], samples: int, *, name: str = "audio", levels: AudioLevels | None = None
) -> np.ndarray:
    """Check, trim/pad and clip a stereo soundtrack for the AAC encoder.

    Args:
        waveform: float ``[2, n]``, numpy or torch (any device).
        samples: wanted length per channel (``spec.audio_samples(frames)``).
        levels: where to add the kept samples' peak and clip count (measured before clipping), or None.
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
    if levels is not None:
        levels.add(waveform[:, :keep])
    np.clip(waveform[:, :keep], -1.0, 1.0, out=out[:, :keep])
    return out
