"""The DiT's architecture as a small typed dataclass, and the registry's built-in sizes (released, tiny, small).

Its own module, so the checkpoint registry and loaders read an architecture without the model's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from h3render.models.config_dict import config_fields


@dataclass(frozen=True)
class DiTConfig:
    """Architecture of the DiT. Field names equal the `__init__` arguments of diffusers'
    `MiniMaxH3Transformer3DModel`; defaults are the released checkpoint (`MiniMaxAI/MiniMax-H3`, 33.1 B parameters).

    `num_attention_heads * attention_head_dim` (7168 released) differs from `hidden_size` (5376). RoPE rotates the
    leading `2 * 3 * rope_freq_dim` channels of every head (96 of 128 released).
    """

    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    # FastH3 Trim (FastVideo 0.2.1's `adaln_rank`; not a diffusers argument, hence last and in `FASTVIDEO_FIELDS`):
    # every AdaLN projection reads a shared rank-r basis of the time embedding, `adaln_basis(silu(temb))` [r],
    # instead of silu(temb) [time_embed_dim]. None: the release's.
    adaln_rank: int | None = None

    FASTVIDEO_FIELDS: ClassVar[tuple[str, ...]] = ("adaln_rank",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3:
            raise ValueError(f"DiTConfig.patch_size must have 3 entries (t, h, w), got {self.patch_size}")
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(
                f"DiTConfig: RoPE rotates 2*3*rope_freq_dim = {6 * self.rope_freq_dim} channels, more than "
                f"attention_head_dim = {self.attention_head_dim}"
            )
        if self.adaln_rank is not None and not 0 < self.adaln_rank <= self.time_embed_dim:
            raise ValueError(f"DiTConfig.adaln_rank must be in (0, time_embed_dim={self.time_embed_dim}], got "
                             f"{self.adaln_rank}")
        if self.freq_dim % 2:
            raise ValueError(f"DiTConfig.freq_dim must be even (cos and sin halves), got {self.freq_dim}")

    @property
    def video_patch_dim(self) -> int:
        """Width of one video row: `in_channels * prod(patch_size)` (96 released)."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "DiTConfig":
        """Build from a `config.json` dict. Keys starting with `_` (diffusers' `_class_name`, `_diffusers_version`)
        are ignored.

        Raises:
            ValueError: on an unknown key.
        """
        return cls(**config_fields(cls, d, "DiT config"))


# Tiny test model: runs a t2va render on CPU in seconds. 8 heads x 16 (inner 128 != hidden 64, as released; 8 heads
# so a CPU run can split them over 8 Ulysses ranks, like the 56 released heads over 8 GPUs); rope_freq_dim 2 rotates
# 12 of the 16 head channels.
DIT_TINY = DiTConfig(
    num_attention_heads=8,
    attention_head_dim=16,
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=2,
    ffn_dim=128,
    text_dim=48,
    freq_dim=32,
    time_embed_hidden_dim=64,
    time_embed_dim=32,
    rope_freq_dim=2,
)

# Small model for CPU end-to-end runs with some depth: 8 heads x 64 (rope 48 of 64 channels).
DIT_SMALL = DiTConfig(
    num_attention_heads=8,
    attention_head_dim=64,
    hidden_size=384,
    num_layers=4,
    num_refiner_layers=2,
    ffn_dim=1024,
    text_dim=256,
    freq_dim=64,
    time_embed_hidden_dim=384,
    time_embed_dim=192,
    rope_freq_dim=8,
)
