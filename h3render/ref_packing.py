"""ref2va's packed sequence: the reference blocks, their shared rotary clock, tags, noise and timestep plan.

Rows are `[text | per reference, in request order | target audio L, R | target video]` (diffusers 0.42.1
`MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`; research/conditioning.md §2.5), where a reference
block is

* image: its own latent frame, `(h/2) * (w/2)` rows at the image's own latent grid (not the target's), tag 0;
* standalone audio: `2 * Tref` channel-major rows, tag 2, `w` pinned to the *target* grid's first / last coordinate;
* video: its soundtrack's `2 * Tref` rows (when it has one), then its `T * (h/2) * (w/2)` video rows; the soundtrack's
  `w` comes from the *video's* grid.

A rotary clock starts at `text_len`; each block takes the current value as its time origin and advances it: an image
by 1, an audio clip by `Tref`, a video by `max(Tref, span)` where `span` is the sequential float64 sum of its latent
frames' `5/3 * (1, 4, 4, 4, 4)` spans (the reference sums this one sequentially, unlike fl2va's last keyframe). The
target rows start at the final clock value.

`video_index` lists every reference's video rows (request order), then the target video; `audio_index` every
reference's audio rows, then the target audio: both ascending, so the DiT scatters and shards them like any rows.
The visual references are noised once to t = 0.999 (`packing.noise_conditions`, one draw each, in order, before the
target noise) and run at `max(t_video, 0.999)`; reference audio is never noised and runs at t = 1.0
(`packing.REFERENCE_AUDIO_T`). The sampler never writes either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from h3render.packing import (
    _FRAME_TIME_SCALE,
    _FRAMES_PER_LATENT,
    AUDIO_TAG,
    PATCH,
    REFERENCE_AUDIO_T,
    TEXT_TAG,
    VIDEO_TAG,
    ConditionedLayout,
    _frame_times,
    _spatial_grid,
    condition_timestep,
    t2va_layout,
)
from h3render.spec import AUDIO_CHANNELS

REFERENCE_KINDS = ("image", "video", "audio")


@dataclass(frozen=True)
class ReferenceBlock:
    """What the layout needs of one reference: its kind and the shapes its encoders produced.

    Attributes:
        kind: "image", "video" or "audio".
        latent_frames, latent_height, latent_width: the visual latent grid `[T, h, w]` (image: T = 1; video: 5n + 2);
            0 for an audio clip.
        audio_latents: Tref, audio latents per channel of its soundtrack / clip (40 per second); 0 for none.
    """

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    @property
    def video_rows(self) -> int:
        _, ph, pw = PATCH
        return self.latent_frames * (self.latent_height // ph) * (self.latent_width // pw)

    @property
    def audio_rows(self) -> int:
        return AUDIO_CHANNELS * self.audio_latents


def _frame_hw(latent_height: int, latent_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`([rows, 2] (h, w) of one latent frame, [w/2] width axis)`, float64, as `packing.t2va_layout` builds them."""
    _, ph, pw = PATCH
    sqrt_area = np.sqrt(latent_height * latent_width)
    h_grid = torch.from_numpy(_spatial_grid(latent_height, ph, sqrt_area))
    w_grid = torch.from_numpy(_spatial_grid(latent_width, pw, sqrt_area))
    return torch.stack(torch.meshgrid(h_grid, w_grid, indexing="ij"), dim=-1).reshape(-1, 2), w_grid


def _fill_audio(positions: torch.Tensor, start: int, audio_latents: int, origin: float, w_grid: torch.Tensor) -> None:
    """One channel-major audio block at rows `start...`: t = origin + k, h = 0, w = the grid's first (channel 0) or
    last (channel 1) coordinate."""
    n = AUDIO_CHANNELS * audio_latents
    rows = slice(start, start + n)
    positions[rows, 0] = (origin + torch.arange(audio_latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    positions[rows, 2] = torch.cat([torch.full((audio_latents,), float(w_grid[0]), dtype=torch.float64),
                                    torch.full((n - audio_latents,), float(w_grid[-1]), dtype=torch.float64)])


def _video_span(latent_frames: int) -> float:
    """Rotary time a video reference occupies: the sequential (Python float) sum of its frame spans."""
    return sum(_FRAME_TIME_SCALE * _FRAMES_PER_LATENT[k % len(_FRAMES_PER_LATENT)] for k in range(latent_frames))


def ref2va_layout(token_tags: torch.Tensor, references: list[ReferenceBlock], height: int, width: int,
                  frames: int) -> ConditionedLayout:
    """Layout of a reference-conditioned request (module docstring).

    Args:
        token_tags: `[Nt]` int64 tags of the presentation's rows (1 text, 0 vision blocks).
        references: one `ReferenceBlock` per reference, request order.
        height, width: the target canvas in px (multiples of 32); frames: 17n + 5 target frames at 24 fps.

    Returns:
        `ConditionedLayout` (CPU tensors) with `num_condition_rows` reference video rows and
        `num_condition_audio_rows` reference audio rows; `reference_kinds` in request order.

    Raises:
        ValueError: no reference, audio references only, an unknown kind, a visual reference without a latent grid
            or a grid not divisible by the patch, tags not `[Nt]` of 0/1; as `packing.t2va_layout`.
    """
    if token_tags.ndim != 1 or bool(((token_tags != TEXT_TAG) & (token_tags != VIDEO_TAG)).any()):
        raise ValueError(f"text token tags must be [Nt] of {TEXT_TAG} (text) / {VIDEO_TAG} (vision block)")
    if not references:
        raise ValueError("ref2va needs at least one reference")
    if all(r.kind == "audio" for r in references):
        raise ValueError("ref2va needs an image or video reference: audio references alone are not supported")
    _, ph, pw = PATCH
    for r in references:
        if r.kind not in REFERENCE_KINDS:
            raise ValueError(f"a reference must be one of {REFERENCE_KINDS}, got {r.kind!r}")
        if r.kind != "audio" and (r.latent_frames < 1 or r.latent_height % ph or r.latent_width % pw
                                  or r.latent_height < ph or r.latent_width < pw):
            raise ValueError(f"{r.kind} reference latent grid {r.latent_frames}x{r.latent_height}x{r.latent_width} "
                             f"is empty or not divisible by the patch {PATCH}")
        if r.kind == "audio" and r.audio_latents < 1:
            raise ValueError("an audio reference needs at least one audio latent")
    text_len = token_tags.numel()
    target = t2va_layout(text_len, height, width, frames)
    n_ref_video = sum(r.video_rows for r in references if r.kind != "audio")
    n_ref_audio = sum(r.audio_rows for r in references if r.kind != "image")
    seq_len = target.seq_len + n_ref_video + n_ref_audio

    positions = torch.zeros(seq_len, 3, dtype=torch.float64)
    positions[:text_len, 0] = torch.arange(text_len, dtype=torch.float64)
    target_hw, target_w = _frame_hw(target.latent_height, target.latent_width)
    video_parts, audio_parts = [], []
    cursor, clock = text_len, float(text_len)
    for r in references:
        if r.kind == "image":
            hw, _ = _frame_hw(r.latent_height, r.latent_width)
            positions[cursor:cursor + r.video_rows, 0] = clock
            positions[cursor:cursor + r.video_rows, 1:] = hw
            video_parts.append(torch.arange(cursor, cursor + r.video_rows))
            cursor += r.video_rows
            clock += 1.0  # a still takes one integer rotary slot, not a latent frame's 5/3 units
        elif r.kind == "audio":
            _fill_audio(positions, cursor, r.audio_latents, clock, target_w)
            audio_parts.append(torch.arange(cursor, cursor + r.audio_rows))
            cursor += r.audio_rows
            clock += float(r.audio_latents)
        else:  # video: its soundtrack's rows first, sharing the video's origin
            hw, w_grid = _frame_hw(r.latent_height, r.latent_width)
            _fill_audio(positions, cursor, r.audio_latents, clock, w_grid)
            audio_parts.append(torch.arange(cursor, cursor + r.audio_rows))
            cursor += r.audio_rows
            rows = slice(cursor, cursor + r.video_rows)
            positions[rows, 0] = _frame_times(r.latent_frames, clock).repeat_interleave(hw.shape[0])
            positions[rows, 1:] = hw.repeat(r.latent_frames, 1)
            video_parts.append(torch.arange(cursor, cursor + r.video_rows))
            cursor += r.video_rows
            clock += max(float(r.audio_latents), _video_span(r.latent_frames))

    audio_start = cursor
    video_start = audio_start + target.num_audio_rows
    _fill_audio(positions, audio_start, target.audio_len, clock, target_w)
    positions[video_start:, 0] = _frame_times(target.latent_frames, clock).repeat_interleave(target_hw.shape[0])
    positions[video_start:, 1:] = target_hw.repeat(target.latent_frames, 1)

    video_index = torch.cat(video_parts + [torch.arange(video_start, seq_len)])
    audio_index = torch.cat(audio_parts + [torch.arange(audio_start, video_start)])
    tags = torch.empty(seq_len, dtype=torch.int64)
    tags[:text_len] = token_tags.to(torch.int64)
    tags[audio_index] = AUDIO_TAG
    tags[video_index] = VIDEO_TAG
    return ConditionedLayout(
        text_len=text_len, latent_frames=target.latent_frames, latent_height=target.latent_height,
        latent_width=target.latent_width, patch=PATCH, audio_len=target.audio_len, seq_len=seq_len,
        text_index=torch.arange(text_len), audio_index=audio_index, video_index=video_index, token_tags=tags,
        positions=positions, num_condition_rows=n_ref_video, num_condition_audio_rows=n_ref_audio,
        reference_kinds=tuple(r.kind for r in references),
    )


def ref2va_step_timesteps(layout: ConditionedLayout, video_t: float | torch.Tensor,
                          audio_t: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct timesteps of one ref2va forward and every row's index into them (diffusers
    `MiniMaxH3SetTimestepsStep.build_row_timesteps`): reference video rows `condition_timestep(video_t)`, target
    audio `audio_t`, reference audio 1.0, all others (text, vision pads, target video) `video_t`.

    Returns:
        `(timesteps [K] float32 sorted, index [S] int64)`; with reference audio K = 3 at step 0, else 4.
    """
    row_t = torch.full((layout.seq_len,), float(video_t), dtype=torch.float32)
    row_t[layout.condition_index.cpu()] = condition_timestep(video_t)
    row_t[layout.target_audio_index.cpu()] = float(audio_t)
    row_t[layout.condition_audio_index.cpu()] = REFERENCE_AUDIO_T
    return torch.unique(row_t, sorted=True, return_inverse=True)
