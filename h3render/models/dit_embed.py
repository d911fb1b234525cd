"""The DiT's embeddings of position and time: the 3-axis RoPE tables of the packed rows and the sinusoidal timestep
embedding (pure functions of their inputs and the config's sizes; `models.dit` re-exports both)."""

from __future__ import annotations

import math

import torch


def timestep_sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of unscaled timesteps `t` in [0, 1], cos half first.

    Args:
        t: `[K]`.
        dim: even embedding width (released: 256).
    Returns:
        `[K, dim]` float32: `[cos(t * f_i), sin(t * f_i)]` with `f_i = max_period ** (-i / (dim / 2))`.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    angles = t.float()[:, None] * torch.exp(exponent)[None, :]  # [K, half]
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


def rope_tables(
    positions: torch.Tensor, freq_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the 3-axis RoPE of every packed row.

    Positions are rounded to float32 before the angles are formed, as in the reference. The three axes share one set
    of `freq_dim` inverse frequencies `theta ** (-2i / (2 * freq_dim))`; angles are laid out `[t | h | w]` and
    repeated twice (rotate_half convention).

    Args:
        positions: `[S, 3]` (t, h, w), float64 from the layout.
        freq_dim: frequencies per axis (released: 16).
        theta: RoPE base (released: 1e4).
    Returns:
        `(cos, sin)`, each `[S, 6 * freq_dim]` float32 on `positions.device`.
    """
    if positions.ndim != 2 or positions.shape[-1] != 3:
        raise ValueError(f"rope positions must be [S, 3], got {list(positions.shape)}")
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, 2 * freq_dim, 2, dtype=torch.float32, device=positions.device) / (2 * freq_dim))
    )
    angles = positions.to(torch.float32)[:, :, None] * inv_freq[None, None, :]  # [S, 3, F]
    angles = angles.flatten(1)  # [S, 3F]: t block, h block, w block
    angles = torch.cat((angles, angles), dim=-1)  # [S, 6F]
    return angles.cos(), angles.sin()
