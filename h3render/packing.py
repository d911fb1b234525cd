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
                           SPATIAL_COMPRESSION, audio_latents, latent_first_frame, latent_frames,
                           latent_of_frame)

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


# ---------------------------------------------------------------------------------------------------------------------
# fl2va: keyframe condition rows.
#
# Rows are `[text | keyframe rows (first, then last) | audio L, R | target video]` (diffusers 0.42.1
# `MiniMaxH3PrepareLayoutStep.build_packed_sequence` with `keyframe_anchors`). A keyframe is one latent frame of the
# target's grid, (H/32) * (W/32) rows, tagged video, at the target's (h, w) grid and at t = text_len ("first") or
# t = text_len + (F - 1) * 5/3 ("last"; the reference's numpy pairwise sum of the frame spans minus the last span).
# h3render also anchors a condition frame at any pixel frame index f (`keyframe_time`: ComfyUI's MiniMaxH3AddGuide
# anchors a guide at any frame index the same way, by its time), which windowed continuation uses for the previous
# window's tail latents at the start frames of the next.
# `video_index` lists the keyframe rows first, then the target video rows (ascending), so the DiT embeds and projects
# them like any video row; the sampler never writes them and drops their velocity.

KEYFRAME_T = 0.999  # keyframes are noised once to t = 0.999 and run at max(t_video, 0.999) (`keyframe_noise_aug`)
# ref2va's reference audio rows are never noised and run clean, at t = 1.0 (diffusers `MiniMaxH3SetTimestepsStep`
# passes 1.0; the prepare-latents step's "t = 0" docstring is wrong: research/conditioning.md §2.5).
REFERENCE_AUDIO_T = 1.0


@dataclass(frozen=True, eq=False)
class ConditionedLayout(PackedLayout):
    """A `PackedLayout` with condition rows at the front of `video_index` (and, ref2va, of `audio_index`).

    Attributes (besides `PackedLayout`'s, whose `video_index` here is `[Nc + Nv]`: conditions first, and
    `audio_index` `[Nca + 2 * Ta]`: reference audio first):
        num_condition_rows: Nc = fl2va: number of keyframes x rows_per_frame; ref2va: the image and video
            references' rows (`ref_packing.ref2va_layout`).
        keyframe_anchors: "first" / "last" / a pixel frame index per keyframe, packed order (fl2va and windowed
            continuation: `keyframe_time`).
        num_condition_audio_rows: Nca = ref2va's reference audio rows (soundtracks and clips), never noised.
        reference_kinds: "image"/"video"/"audio" per reference, request order (ref2va).
    """

    num_condition_rows: int = 0
    keyframe_anchors: tuple[str | int, ...] = ()
    num_condition_audio_rows: int = 0
    reference_kinds: tuple[str, ...] = ()

    @property
    def condition_index(self) -> torch.Tensor:
        """`[Nc]` int64 sequence positions of the keyframe rows."""
        return self.video_index[: self.num_condition_rows]

    @property
    def target_video_index(self) -> torch.Tensor:
        """`[Nv]` int64 sequence positions of the generated video rows."""
        return self.video_index[self.num_condition_rows:]

    @property
    def num_target_video_rows(self) -> int:
        return self.video_index.numel() - self.num_condition_rows

    @property
    def condition_audio_index(self) -> torch.Tensor:
        """`[Nca]` int64 sequence positions of the reference audio rows (ref2va; empty otherwise)."""
        return self.audio_index[: self.num_condition_audio_rows]

    @property
    def target_audio_index(self) -> torch.Tensor:
        """`[2 * Ta]` int64 sequence positions of the generated audio rows."""
        return self.audio_index[self.num_condition_audio_rows:]

    def row_timestep_index(self, video_slot: int, audio_slot: int, condition_slot: int | None = None,
                           audio_condition_slot: int | None = None) -> torch.Tensor:
        """Per-row index `[S]` int64: `audio_slot` on generated audio rows, `condition_slot` on video condition rows,
        `audio_condition_slot` on reference audio rows, `video_slot` elsewhere (text rows, vision pads included, take
        the video timestep).

        Raises:
            ValueError: the layout has condition rows of a kind whose slot was not given.
        """
        index = super().row_timestep_index(video_slot, audio_slot)
        if self.num_condition_rows:
            if condition_slot is None:
                raise ValueError("this layout has video condition rows: give their timestep slot (condition_slot)")
            index[self.condition_index] = condition_slot
        if self.num_condition_audio_rows:
            if audio_condition_slot is None:
                raise ValueError("this layout has reference audio rows: give their timestep slot "
                                 "(audio_condition_slot)")
            index[self.condition_audio_index] = audio_condition_slot
        return index

    def target_layout(self) -> PackedLayout:
        """The target's geometry as a plain `PackedLayout` view (`video_index` = target rows only), for
        `unpatchify_video` / `rows_to_audio` of the generated rows."""
        return PackedLayout(
            text_len=self.text_len, latent_frames=self.latent_frames, latent_height=self.latent_height,
            latent_width=self.latent_width, patch=self.patch, audio_len=self.audio_len, seq_len=self.seq_len,
            text_index=self.text_index, audio_index=self.target_audio_index, video_index=self.target_video_index,
            token_tags=self.token_tags, positions=self.positions,
        )


def _last_keyframe_time(text_len: int, latent_frames: int) -> float:
    """RoPE t of a "last" keyframe: text_len + sum of the frame spans - the last span, summed as the reference does
    (numpy pairwise summation; a sequential sum differs in the last ulp from 16 latent frames on)."""
    spans = np.full(latent_frames, _FRAME_TIME_SCALE, dtype=np.float64)
    for offset, frames in enumerate(_FRAMES_PER_LATENT):
        spans[offset :: len(_FRAMES_PER_LATENT)] *= frames
    return float(text_len) + float(spans.sum()) - _FRAME_TIME_SCALE


def keyframe_time(text_len: int, frames: int, anchor: str | int) -> float:
    """RoPE t of a condition frame anchored at `anchor` of a `frames`-frame clip (float64 value).

    "first" is pixel frame 0 and "last" pixel frame F - 1; an int is a pixel frame index in [0, F). The time is
    `text_len + f * 5/3` (one pixel frame = 5/3 audio-latent units), computed so that the reference's anchors come
    out bit for bit: frame F - 1 as diffusers' "last" (`_last_keyframe_time`), and a frame that starts a latent
    frame k (0, 1, 5, 9, 13, 17, ...: `spec.latent_first_frame`) at exactly the t of the target's latent frame k
    (frame 0: `text_len`, diffusers' "first").

    Raises:
        ValueError: an anchor that is neither "first", "last" nor an int in [0, frames).
    """
    t_lat = latent_frames(frames)
    if anchor == "first":
        anchor = 0
    elif anchor == "last":
        anchor = frames - 1
    if isinstance(anchor, bool) or not isinstance(anchor, int) or not 0 <= anchor < frames:
        raise ValueError(f"keyframe anchor must be 'first', 'last' or a frame index in 0..{frames - 1}, "
                         f"got {anchor!r}")
    if anchor == frames - 1:
        return _last_keyframe_time(text_len, t_lat)
    latent = latent_of_frame(anchor)
    if latent_first_frame(latent) == anchor:
        return float(_frame_times(latent + 1, float(text_len))[latent])
    return float(text_len) + anchor * _FRAME_TIME_SCALE


def fl2va_layout(
    token_tags: torch.Tensor, height: int, width: int, frames: int, keyframe_anchors: tuple[str | int, ...]
) -> ConditionedLayout:
    """Layout of a keyframe-conditioned request.

    Args:
        token_tags: `[Nt]` int64 tags of the text-encoder rows (1 text, 0 the keyframes' vision blocks), from
            `TextEncoder.encode_with_images`.
        height, width: canvas in pixels, multiples of 32 (the keyframes were put onto it).
        frames: pixel frames at 24 fps, 17n + 5.
        keyframe_anchors: per condition frame, packed order: "first", "last" or a pixel frame index (`keyframe_time`);
            released fl2va: `("first",)`, `("last",)` or `("first", "last")` (an empty tuple gives the t2va layout
            with the given text tags).

    Returns:
        `ConditionedLayout` (CPU tensors). At 1344 x 768 x 243 with both keyframes: 2,016 condition rows.

    Raises:
        ValueError: as `t2va_layout`; an unknown anchor; tags not `[Nt]` of 0/1.
    """
    if token_tags.ndim != 1 or bool(((token_tags != TEXT_TAG) & (token_tags != VIDEO_TAG)).any()):
        raise ValueError(f"text token tags must be [Nt] of {TEXT_TAG} (text) / {VIDEO_TAG} (vision block)")
    text_len = token_tags.numel()
    times = [keyframe_time(text_len, frames, anchor) for anchor in keyframe_anchors]  # checks the anchors
    base = t2va_layout(text_len, height, width, frames)
    rows_per_frame = base.rows_per_frame
    n_cond = len(keyframe_anchors) * rows_per_frame
    seq_len = base.seq_len + n_cond

    # Everything after the text shifts back by the condition rows; the target positions are the t2va ones.
    positions = torch.empty(seq_len, 3, dtype=torch.float64)
    positions[:text_len] = base.positions[:text_len]
    positions[text_len + n_cond:] = base.positions[text_len:]
    _, ph, pw = PATCH
    sqrt_area = np.sqrt(base.latent_height * base.latent_width)
    h_grid = torch.from_numpy(_spatial_grid(base.latent_height, ph, sqrt_area))
    w_grid = torch.from_numpy(_spatial_grid(base.latent_width, pw, sqrt_area))
    frame_hw = torch.stack(torch.meshgrid(h_grid, w_grid, indexing="ij"), dim=-1).reshape(-1, 2)  # [rows, 2]
    for k in range(len(keyframe_anchors)):
        rows = slice(text_len + k * rows_per_frame, text_len + (k + 1) * rows_per_frame)
        positions[rows, 0] = times[k]
        positions[rows, 1:] = frame_hw

    tags = torch.empty(seq_len, dtype=torch.int64)
    tags[:text_len] = token_tags.to(torch.int64)
    tags[text_len + n_cond:] = base.token_tags[text_len:]
    tags[text_len:text_len + n_cond] = VIDEO_TAG

    audio_index = base.audio_index + n_cond
    video_index = torch.cat([torch.arange(text_len, text_len + n_cond), base.video_index + n_cond])
    return ConditionedLayout(
        text_len=text_len, latent_frames=base.latent_frames, latent_height=base.latent_height,
        latent_width=base.latent_width, patch=PATCH, audio_len=base.audio_len, seq_len=seq_len,
        text_index=base.text_index, audio_index=audio_index, video_index=video_index, token_tags=tags,
        positions=positions, num_condition_rows=n_cond, keyframe_anchors=tuple(keyframe_anchors),
    )


def condition_timestep(video_t: float | torch.Tensor) -> torch.Tensor:
    """Timestep of the keyframe rows at a step: `max(t_video, 0.999)` as a 0-d float32 (0.999 in every normal
    schedule: the keyframes are never run clean at t = 1)."""
    return torch.tensor(max(float(video_t), KEYFRAME_T), dtype=torch.float32)


def fl2va_step_timesteps(
    layout: ConditionedLayout, video_t: float | torch.Tensor, audio_t: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct timesteps of one fl2va forward and every row's index into them (diffusers
    `MiniMaxH3SetTimestepsStep.build_row_timesteps`): keyframe rows `condition_timestep(video_t)`, audio rows
    `audio_t`, all others `video_t`.

    Returns:
        `(timesteps [K] float32 sorted, index [S] int64)`; K = 2 at step 0 (t_video = t_audio = 0), else 3.
    """
    row_t = torch.full((layout.seq_len,), float(video_t), dtype=torch.float32)
    row_t[layout.condition_index.cpu()] = condition_timestep(video_t)
    row_t[layout.audio_index.cpu()] = float(audio_t)
    return torch.unique(row_t, sorted=True, return_inverse=True)


def noise_keyframes(
    condition_latents: list[torch.Tensor], generator: torch.Generator, patch: tuple[int, int, int] = PATCH
) -> torch.Tensor:
    """Noise the keyframe latents once to t = 0.999 and pack them: the condition rows, fixed for the whole loop.

    One `randn` per keyframe of its latent's `[1, 24, 1, h, w]` shape, float32, in packed order, from the job's CPU
    `generator` BEFORE the video and audio noise are drawn from it (diffusers `MiniMaxH3PrepareConditionLatentsStep`,
    then `MiniMaxH3PrepareLatentsStep`); mixed `t * x0 + (1 - t) * n` in float32 (`MiniMaxH3Scheduler.scale_noise`).

    Args:
        condition_latents: one normalized latent `[24, 1, h, w]` per keyframe (`VideoVAE.encode_condition`).
        generator: the job's CPU generator, seeded with the job's seed, not yet drawn from.

    Returns:
        `[Nc, 96]` float32 rows on the latents' device, keyframe by keyframe, each t-major then h then w.
    """
    for latent in condition_latents:
        if latent.ndim != 4 or latent.shape[1] != 1:
            raise ValueError(f"a keyframe latent must be [C, 1, h, w], got {list(latent.shape)}")
    return noise_conditions(condition_latents, generator, patch)


def noise_conditions(
    condition_latents: list[torch.Tensor], generator: torch.Generator, patch: tuple[int, int, int] = PATCH
) -> torch.Tensor:
    """`noise_keyframes` for latents of any frame count and grid (ref2va's image and video references, each at its
    own size): one float32 `randn` of each latent's `[1, C, T, h, w]` shape, in order, mixed to t = 0.999 and
    patchified on its own (diffusers `MiniMaxH3PrepareConditionLatentsStep`).

    Returns:
        `[Nc, 96]` float32 rows, reference by reference, each t-major then h then w.
    """
    packed = []
    for latent in condition_latents:
        if latent.ndim != 4:
            raise ValueError(f"a condition latent must be [C, T, h, w], got {list(latent.shape)}")
        noise = torch.randn((1, *latent.shape), generator=generator, dtype=torch.float32)[0].to(latent.device)
        t = torch.tensor(KEYFRAME_T, dtype=torch.float32, device=latent.device)
        packed.append(patchify_video(t * latent.float() + (1.0 - t) * noise, patch))
    return torch.cat(packed)
