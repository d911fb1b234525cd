"""The video VAE's architecture as a small typed dataclass, and the registry's built-in sizes (tiny, small).

Its own module so that the encoder (`video_vae_encoder`) and the decoder (`video_vae`) both import it and neither
imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3render.models.config_dict import config_fields
from h3render.models.vae_tiling import TemporalGeometry


@dataclass(frozen=True)
class VideoVAEConfig:
    """Architecture of the video VAE; fields and defaults equal diffusers' `AutoencoderKLMiniMaxH3.__init__`.

    The defaults are the released checkpoint's architecture (2.6 B params: encoder levels 128..1024, 36 decoder
    layers of width 32 x 64 = 2048). `latents_mean` / `latents_std` default to identity here; the released values are
    read from the checkpoint's config.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 24
    block_out_channels: tuple[int, ...] = (128, 256, 256, 512, 512, 1024)
    layers_per_block: int = 2
    spatial_downsample_factors: tuple[int, ...] = (2, 2, 2, 2, 1, 1)
    temporal_downsample_factors: tuple[int, ...] = (1, 2, 2, 1, 1, 1)
    norm_num_groups: int = 32
    norm_eps: float = 1e-6
    spatial_padding_mode: str = "reflect"
    decoder_num_layers: int = 36
    decoder_num_attention_heads: int = 32
    decoder_attention_head_dim: int = 64
    decoder_num_register_tokens: int = 4
    decoder_ffn_mult: int = 4
    decoder_rope_theta: float = 100.0
    decoder_rope_dim_ratio: float = 0.75
    decoder_norm_eps: float = 1e-5
    clip_length: int = 17
    token_drop: int = 3
    latents_mean: tuple[float, ...] = (0.0,) * 24
    latents_std: tuple[float, ...] = (1.0,) * 24

    def __post_init__(self) -> None:
        levels = len(self.block_out_channels)
        if len(self.spatial_downsample_factors) != levels or len(self.temporal_downsample_factors) != levels:
            raise ValueError("video VAE config: block_out_channels and the downsample factors must have equal length")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"video VAE config: latents_mean/latents_std need {self.latent_channels} values each")

    @property
    def spatial_ratio(self) -> int:
        return math.prod(self.spatial_downsample_factors)

    @property
    def temporal_ratio(self) -> int:
        return math.prod(self.temporal_downsample_factors)

    @property
    def geometry(self) -> TemporalGeometry:
        return TemporalGeometry(self.clip_length, self.temporal_ratio, self.token_drop)

    @classmethod
    def from_dict(cls, data: dict) -> "VideoVAEConfig":
        """Build from a diffusers `config.json` dict; `_class_name`/`_diffusers_version` are ignored.

        Raises:
            ValueError: a key that is not a field of this config.
        """
        return cls(**config_fields(cls, data, "video VAE config.json"))


# Tiny test model: keeps the 16x spatial / 4x temporal compression and the 17-frame clip geometry; decodes
# 39 frames at 128x128 in about a second on CPU.
VIDEO_VAE_TINY = VideoVAEConfig(
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(1, 2, 2, 1),
    norm_num_groups=4,
    decoder_num_layers=2,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=16,
    decoder_ffn_mult=2,
)

# Small model for GPU smoke runs and benchmarks of the decode machinery at full canvas sizes.
VIDEO_VAE_SMALL = VideoVAEConfig(
    block_out_channels=(32, 64, 64, 128),
    layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2),
    temporal_downsample_factors=(1, 2, 2, 1),
    norm_num_groups=8,
    decoder_num_layers=4,
    decoder_num_attention_heads=4,
    decoder_attention_head_dim=64,
)
