"""The audio VAE's architecture as a small typed dataclass, and the registry's built-in sizes (tiny, small).

Its own module, torch-free, so that the release registry and `checkpoint.info` (read before anything heavy loads)
name it without importing the model (`h3render.models.audio_vae`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3render.models.config_dict import config_fields
from h3render.spec import SAMPLE_RATE


@dataclass(frozen=True)
class AudioVAEConfig:
    """Architecture; fields and defaults equal diffusers' `AutoencoderKLMiniMaxH3Audio.__init__` (released values).

    `latents_mean` / `latents_std` (32 floats each) come from the checkpoint config; None means identity.
    """

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sampling_rate: int = SAMPLE_RATE  # 32000 released; the MP4 writer writes its AAC track at the same spec rate
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(
                f"audio VAE config: decoder_rates upsample by {math.prod(self.decoder_rates)}, "
                f"encoder hop is {self.hop_length}"
            )
        if self.latent_dim % self.latent_channels:
            raise ValueError(f"audio VAE config: latent_dim {self.latent_dim} must be a multiple of latent_channels")
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("audio VAE config: decoder_kernel_sizes and decoder_rates must have equal length")
        for name in ("latents_mean", "latents_std"):
            value = getattr(self, name)
            if value is not None and len(value) != self.latent_channels:
                raise ValueError(f"audio VAE config: {name} needs {self.latent_channels} values, got {len(value)}")

    @property
    def hop_length(self) -> int:
        """Samples per latent frame: prod(encoder_rates), 800 at release (32000 Hz / 800 = 40 latents/s)."""
        return math.prod(self.encoder_rates)

    @classmethod
    def from_dict(cls, data: dict) -> "AudioVAEConfig":
        """Build from a diffusers `config.json` dict; `_class_name`/`_diffusers_version` are ignored.

        Raises:
            ValueError: a key that is not a field of this config.
        """
        return cls(**config_fields(cls, data, "audio VAE config.json"))


# Tiny test model: keeps hop 800 (so 40 latents/s at 32 kHz) with few, narrow stages.
AUDIO_VAE_TINY = AudioVAEConfig(
    encoder_dim=2,
    latent_dim=64,
    num_attention_heads=2,
    decoder_dim=32,
    decoder_rates=(5, 5, 4, 8),
    decoder_kernel_sizes=(9, 9, 8, 16),
    resblock_kernel_sizes=(3,),
    resblock_dilation_sizes=((1, 3),),
    # A random model's latents are unnormalized: identity statistics, stated (diffusers multiplies by them).
    latents_mean=(0.0,) * 32, latents_std=(1.0,) * 32,
)

# Small model for GPU smoke runs: the released stage layout at reduced width.
AUDIO_VAE_SMALL = AudioVAEConfig(
    encoder_dim=8,
    latent_dim=256,
    num_attention_heads=4,
    decoder_dim=256,
    resblock_kernel_sizes=(3, 7),
    resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
    latents_mean=(0.0,) * 32, latents_std=(1.0,) * 32,  # identity, as the tiny model's
)
