"""The packed t2va sequence: row layout, modality tags, RoPE positions, per-row timesteps; pack/unpack of latents.

Rows are `[text | audio | video]` (released t2va layout):

* text: one row per prompt token, tag 1, position `(i, 0, 0)`.
* audio: channel-major (all of channel 0, then channel 1), tag 2; latent k at `t = text_len + k`, `h = 0`, `w` pinned
  to the first (channel 0) or last (channel 1) coordinate of the video's width grid. One time unit is one 25 ms
  audio latent.
* video: t-major, then h, then w over the (1, 2, 2)-patched latent grid, tag 0. Latent frame k starts at
  `text_len + sum_{j<k} 5/3 * (1, 4, 4, 4, 4)[j % 5]` (the VAE turns 17 frames into 5 latents: 1 then 4 x 4 frames,
  and 24 fps * 5/3 = 40 audio latents/s); h and w are aspect-normalized centred grids
  `numpy.linspace(left, left + ratio, n, endpoint=False) * 32` with `ratio = dim / sqrt(H * W)` in latent units.

Positions are float64 and reproduce diffusers 0.42.1 `MiniMaxH3PrepareLayoutStep` bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from h3render.spec import (AUDIO_CHANNELS, CANVAS_MULTIPLE, FRAMES_PER_LATENT, LATENT_TIME_UNITS, PATCH,
                           SPATIAL_COMPRESSION, audio_latents, latent_frames)

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

# RoPE time: one latent frame spans 5/3 * (1, 4, 4, 4, 4)[k % 5] units (spec); spatial grids are scaled by 32.
_FRAME_TIME_SCALE = LATENT_TIME_UNITS
_FRAMES_PER_LATENT = FRAMES_PER_LATENT
_SPATIAL_SCALE = 32


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where every row of one packed sequence sits, and its tag and RoPE position.

    Attributes:
        text_len: text rows Nt.
        latent_frames, latent_height, latent_width: video latent grid T, h, w (pixels / 16; T = 5n + 2).
        patch: (pt, ph, pw) = (1, 2, 2).
        audio_len: audio latents per channel Ta (40 per second).
        seq_len: S = Nt + 2 * Ta + T * (h / 2) * (w / 2).
        text_index, audio_index, video_index: `[Nt]`, `[2 * Ta]`, `[Nv]` int64 positions in the sequence.
        token_tags: `[S]` int64 (0 video, 1 text, 2 audio).
        positions: `[S, 3]` float64 (t, h, w).
    """

    text_len: int
    latent_frames: int
    latent_height: int
    latent_width: int
    patch: tuple[int, int, int]
    audio_len: int
    seq_len: int
    text_index: torch.Tensor
    audio_index: torch.Tensor
    video_index: torch.Tensor
    token_tags: torch.Tensor
    positions: torch.Tensor

    @property
    def rows_per_frame(self) -> int:
        return (self.latent_height // self.patch[1]) * (self.latent_width // self.patch[2])

    @property
    def num_video_rows(self) -> int:
        return self.video_index.numel()

    @property
    def num_audio_rows(self) -> int:
        return self.audio_index.numel()

    def to(self, device: torch.device | str) -> "PackedLayout":
        """Copy with the tensors on `device` (positions stay float64)."""
        return dataclasses.replace(
            self,
            text_index=self.text_index.to(device),
            audio_index=self.audio_index.to(device),
            video_index=self.video_index.to(device),
            token_tags=self.token_tags.to(device),
            positions=self.positions.to(device),
        )

    def row_timestep_index(self, video_slot: int, audio_slot: int) -> torch.Tensor:
        """Per-row index `[S]` int64 into a timestep list: `audio_slot` on audio rows, `video_slot` elsewhere (text
        rows take the video timestep)."""
        index = torch.full((self.seq_len,), video_slot, dtype=torch.int64, device=self.token_tags.device)
        index[self.audio_index] = audio_slot
        return index


def _spatial_grid(dim: int, patch: int, sqrt_area: float) -> np.ndarray:
    """`dim // patch` centred, aspect-normalized coordinates x 32, float64. numpy's linspace on purpose: its
    `start + arange(n) * step` differs from torch.linspace in the last ulp."""
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return np.linspace(left, left + ratio, dim // patch, endpoint=False) * _SPATIAL_SCALE


def _frame_times(latent_frames: int, origin: float) -> torch.Tensor:
    """`[T]` float64 start time of every latent frame: `origin + cumsum` of the spans before it (this summation
    order is the reference's)."""
    spans = torch.tensor(
        [_FRAME_TIME_SCALE * _FRAMES_PER_LATENT[k % len(_FRAMES_PER_LATENT)] for k in range(latent_frames)],
        dtype=torch.float64,
    )
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def t2va_layout(text_len: int, height: int, width: int, frames: int) -> PackedLayout:
    """Layout of a text-to-video+audio request.

    Args:
        text_len: prompt tokens (>= 1).
        height, width: canvas in pixels, multiples of 32.
        frames: pixel frames at 24 fps, of the form 17n + 5.
    Returns:
        The `PackedLayout` (CPU tensors). At 1344 x 768 x 243: 72,576 video rows and 810 audio rows.
    Raises:
        ValueError: on a canvas that is not a multiple of 32, a frame count not 17n + 5, or text_len < 1.
    """
    if text_len < 1:
        raise ValueError(f"text_len must be >= 1, got {text_len}")
    if height <= 0 or width <= 0 or height % CANVAS_MULTIPLE or width % CANVAS_MULTIPLE:
        raise ValueError(f"height and width must be positive multiples of {CANVAS_MULTIPLE}, got {width}x{height}")
    t_lat = latent_frames(frames)
    h_lat, w_lat = height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION
    audio_len = audio_latents(frames)
    _, ph, pw = PATCH

    rows_per_frame = (h_lat // ph) * (w_lat // pw)
    n_audio = AUDIO_CHANNELS * audio_len
    n_video = t_lat * rows_per_frame
    audio_start = text_len
    video_start = audio_start + n_audio
    seq_len = video_start + n_video

    sqrt_area = np.sqrt(h_lat * w_lat)
    h_grid = torch.from_numpy(_spatial_grid(h_lat, ph, sqrt_area))
    w_grid = torch.from_numpy(_spatial_grid(w_lat, pw, sqrt_area))

    positions = torch.zeros(seq_len, 3, dtype=torch.float64)
    positions[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)

    audio_time = float(text_len) + torch.arange(audio_len, dtype=torch.float64)  # [Ta]
    positions[audio_start:video_start, 0] = audio_time.repeat(AUDIO_CHANNELS)
    positions[audio_start:video_start, 2] = torch.cat(
        [torch.full((audio_len,), float(w_grid[0]), dtype=torch.float64),
         torch.full((n_audio - audio_len,), float(w_grid[-1]), dtype=torch.float64)]
    )

    video_pos = torch.empty(t_lat, h_lat // ph, w_lat // pw, 3, dtype=torch.float64)  # [T, h/2, w/2, 3]
    video_pos[..., 0] = _frame_times(t_lat, float(text_len))[:, None, None]
    video_pos[..., 1] = h_grid[None, :, None]
    video_pos[..., 2] = w_grid[None, None, :]
    positions[video_start:] = video_pos.reshape(-1, 3)  # [Nv, 3], t-major then h then w

    token_tags = torch.empty(seq_len, dtype=torch.int64)
    token_tags[:audio_start] = TEXT_TAG
    token_tags[audio_start:video_start] = AUDIO_TAG
    token_tags[video_start:] = VIDEO_TAG

    return PackedLayout(
        text_len=text_len,
        latent_frames=t_lat,
        latent_height=h_lat,
        latent_width=w_lat,
        patch=PATCH,
        audio_len=audio_len,
        seq_len=seq_len,
        text_index=torch.arange(0, audio_start),
        audio_index=torch.arange(audio_start, video_start),
        video_index=torch.arange(video_start, seq_len),
        token_tags=token_tags,
        positions=positions,
    )


def step_timesteps(
    layout: PackedLayout, video_t: float | torch.Tensor, audio_t: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct timesteps of one forward and every row's index into them.

    Audio rows take `audio_t`, all other rows (video, and text, which never reaches a head) `video_t`. At step 0
    both are 0 (sigma 1) and there is one distinct value; later two, sorted ascending.

    Returns:
        `(timesteps [K] float32 sorted, index [S] int64)`, K in {1, 2}.
    """
    row_t = torch.full((layout.seq_len,), float(video_t), dtype=torch.float32)
    row_t[layout.audio_index.cpu()] = float(audio_t)
    return torch.unique(row_t, sorted=True, return_inverse=True)


def patchify_video(latent: torch.Tensor, patch: tuple[int, int, int] = PATCH) -> torch.Tensor:
    """Video latent `[C, T, h, w]` -> rows `[T * (h/ph) * (w/pw), C * pt * ph * pw]` (`[Nv, 96]` released).

    Rows are t-major then h then w; each row's values channel-major then (kt, kh, kw).

    Raises:
        ValueError: on a non-4D latent or a grid not divisible by the patch.
    """
    pt, ph, pw = patch
    if latent.ndim != 4:
        raise ValueError(f"video latent must be [C, T, h, w], got {list(latent.shape)}")
    c, t, h, w = latent.shape
    if t % pt or h % ph or w % pw:
        raise ValueError(f"video latent grid {t}x{h}x{w} is not divisible by the patch {patch}")
    x = latent.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)  # [T', h', w', C, pt, ph, pw]
    return x.reshape(-1, c * pt * ph * pw)


def unpatchify_video(rows: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Inverse of `patchify_video`: rows `[Nv, C * pt * ph * pw]` -> latent `[C, T, h, w]` of the layout's grid.

    Raises:
        ValueError: when the row count does not match the layout.
    """
    pt, ph, pw = layout.patch
    t, h, w = layout.latent_frames, layout.latent_height, layout.latent_width
    if rows.ndim != 2 or rows.shape[0] != layout.num_video_rows or rows.shape[1] % (pt * ph * pw):
        raise ValueError(f"video rows must be [{layout.num_video_rows}, C*{pt * ph * pw}], got {list(rows.shape)}")
    c = rows.shape[1] // (pt * ph * pw)
    x = rows.reshape(t // pt, h // ph, w // pw, c, pt, ph, pw)
    x = x.permute(3, 0, 4, 1, 5, 2, 6)  # [C, T', pt, h', ph, w', pw]
    return x.reshape(c, t, h, w)


def audio_to_rows(latent: torch.Tensor) -> torch.Tensor:
    """Audio latent `[2, 32, Ta]` (one batch item per stereo channel) -> rows `[2 * Ta, 32]`, channel-major."""
    if latent.ndim != 3:
        raise ValueError(f"audio latent must be [channels, 32, Ta], got {list(latent.shape)}")
    return latent.permute(0, 2, 1).reshape(-1, latent.shape[1])


def rows_to_audio(rows: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Inverse of `audio_to_rows`: `[2 * Ta, 32]` -> `[2, 32, Ta]`.

    Raises:
        ValueError: when the row count does not match the layout.
    """
    if rows.ndim != 2 or rows.shape[0] != layout.num_audio_rows:
        raise ValueError(f"audio rows must be [{layout.num_audio_rows}, C], got {list(rows.shape)}")
    return rows.reshape(AUDIO_CHANNELS, layout.audio_len, rows.shape[1]).permute(0, 2, 1)
