"""Rectified-flow sampling for MiniMax-H3: sigma schedules, the Euler step, noise, and the denoising loop.

Conventions of the released model (diffusers 0.42.1 `MiniMaxH3Scheduler` is the reference):

* sigma = 1 is pure noise, 0 is data. The model sees `t = 1 - sigma` in [0, 1] (no x1000).
* The velocity is data-ward: `x0 = x + sigma * v` (the opposite sign of flux).
* The Euler step is the blend `r * x + (1 - r) * x0` with `r = sigma_next / sigma`, in float32.
* Video and audio follow their own schedules (released: shift 12 video, 3 audio) through one forward per step.
* Guidance-distilled: one forward per step, no negative prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from h3render.packing import REFERENCE_AUDIO_T, PackedLayout, condition_timestep
from h3render.spec import AUDIO_LATENT_CHANNELS, VIDEO_LATENT_CHANNELS

if TYPE_CHECKING:
    from h3render.models.dit import DiT, ModulationTables

# model_fn(video_rows, audio_rows, video_t, audio_t) -> (video_velocity, audio_velocity); t are 0-d float32 tensors.
ModelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


def _shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """`s * sigma / (1 + (s - 1) * sigma)` in float32; maps 0 -> 0 and 1 -> 1."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_schedule(num_points: int, shift: float) -> torch.Tensor:
    """Base schedule: `linspace(1, 0, num_points)` pushed through the shift, consecutive float32 duplicates removed.

    `num_points` counts the terminal 0, so N points drive N - 1 forwards (released default 50 -> 49 forwards).

    Args:
        num_points: grid points N >= 2, terminal zero included.
        shift: released checkpoint: video 12, audio 3.
    Returns:
        `[M]` float32 CPU, strictly decreasing from 1 to 0, M <= N.
    Raises:
        ValueError: on N < 2 or shift <= 0.
    """
    if num_points < 2:
        raise ValueError(f"num_points must be >= 2 (terminal zero included), got {num_points}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    return torch.unique_consecutive(_shift(base, float(shift)))


def shifted_sigmas(positions: Sequence[float], shift: float) -> torch.Tensor:
    """Explicit pre-shift positions (FastH3: e.g. (0.999, 0.749, 0.5, 0.25, 0)) pushed through the shift; no
    de-duplication. len(positions) - 1 forwards.

    Returns:
        `[len(positions)]` float32 CPU.
    Raises:
        ValueError: unless positions are >= 2 values in [0, 1], strictly decreasing, ending at 0; or shift <= 0.
    """
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    p = torch.as_tensor(list(positions), dtype=torch.float32).flatten()
    if p.numel() < 2 or bool((p[1:] >= p[:-1]).any()) or float(p[-1]) != 0.0 or float(p[0]) > 1.0:
        raise ValueError(f"sigma positions must be strictly decreasing values in [0, 1] ending at 0, got {positions}")
    return _shift(p, float(shift))


@dataclass(frozen=True)
class Schedule:
    """The sigma lists of one job, base or few-step, and where they came from (the sidecar's `sigmas`).

    Attributes:
        video, audio: `[M]` float32 CPU, 1 -> 0 (terminal 0 included: M - 1 forwards), equal length.
        video_shift, audio_shift: the shifts applied (released 12 / 3; FastH3 V2 10 / 3).
        source: "linspace(50) + shift", "release default", "adapter metadata", "FastH3 V2 contract", ...
        positions: the pre-shift positions of a few-step schedule (FastH3), None for the base grid.
    """

    video: torch.Tensor
    audio: torch.Tensor
    video_shift: float
    audio_shift: float
    source: str
    positions: tuple[float, ...] | None = None

    @property
    def forwards(self) -> int:
        return self.video.numel() - 1

    @classmethod
    def base(cls, points: int, video_shift: float, audio_shift: float) -> "Schedule":
        """The base model's grid: `linspace(1, 0, points)` through each modality's shift (`sigma_schedule`)."""
        return cls(sigma_schedule(points, video_shift), sigma_schedule(points, audio_shift), float(video_shift),
                   float(audio_shift), f"linspace({points}) + shift")

    @classmethod
    def few_step(cls, positions: Sequence[float], video_shift: float, audio_shift: float, source: str) -> "Schedule":
        """A distilled student's fixed pre-shift positions through each modality's shift (`shifted_sigmas`)."""
        positions = tuple(float(p) for p in positions)
        return cls(shifted_sigmas(positions, video_shift), shifted_sigmas(positions, audio_shift), float(video_shift),
                   float(audio_shift), source, positions)

    @property
    def timesteps(self) -> torch.Tensor:
        """Every distinct timestep the run visits, `[K]` float32 ascending (`schedule_timesteps`)."""
        return schedule_timesteps(self.video, self.audio)

    def to_dict(self) -> dict:
        """The sidecar's `sigmas` entry."""
        out = {"video": [float(s) for s in self.video], "audio": [float(s) for s in self.audio],
               "source": self.source, "sigma_points": self.video.numel(), "forwards": self.forwards,
               "video_shift": self.video_shift, "audio_shift": self.audio_shift}
        if self.positions is not None:
            out["positions"] = list(self.positions)
        return out


def timesteps_of(sigmas: torch.Tensor) -> torch.Tensor:
    """`t = 1 - sigma` for every forward of a schedule: `[M]` -> `[M - 1]` float32 (the terminal 0 has none)."""
    return 1.0 - sigmas[:-1]


def euler_step(
    x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """One deterministic Euler step in float32: `x0 = x + sigma * v`, `r = sigma_next / sigma`, `r * x + (1 - r) * x0`.

    The sigma in `x0` is recovered from the model's timestep, `1 - (1 - sigma)`, as the reference does: for
    sigma < 0.5 that float32 round trip is not exact, and the ratio `r` uses the grid values.

    Args:
        x, velocity: same shape; sigma, sigma_next: 0-d (float32 schedule entries).
    Returns:
        float32 tensor shaped like `x`.
    """
    x = x.float()
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device)
    sigma_seen = 1 - (1 - sigma)
    x0 = x + sigma_seen * velocity.float()
    ratio = sigma_next / sigma
    return ratio * x + (1.0 - ratio) * x0


def draw_noise(seed: int | torch.Generator, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise from one CPU generator seeded with `seed`: video first, then audio directly in row layout.

    The draw order and shapes are the reference's (a CUDA generator would give other numbers). fl2va passes the
    job's generator itself after `packing.noise_keyframes` drew the keyframe noise from it.

    Returns:
        `(video_latent [1, 24, T, h, w], audio_rows [2 * Ta, 32])`, float32 on CPU.
    """
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator(device="cpu").manual_seed(int(seed))
    video = torch.randn(
        (1, VIDEO_LATENT_CHANNELS, layout.latent_frames, layout.latent_height, layout.latent_width),
        generator=gen,
        dtype=torch.float32,
    )
    audio = torch.randn((layout.num_audio_rows, AUDIO_LATENT_CHANNELS), generator=gen, dtype=torch.float32)
    return video, audio


def schedule_timesteps(video_sigmas: torch.Tensor, audio_sigmas: torch.Tensor, keyframes: bool = False) -> torch.Tensor:
    """All distinct timesteps a run visits, sorted ascending `[K]` float32: what `DiT.modulation_tables` needs once
    per schedule pair. `keyframes` adds the keyframe rows' `packing.condition_timestep` of every step (0.999)."""
    parts = [timesteps_of(video_sigmas), timesteps_of(audio_sigmas)]
    if keyframes:
        parts.append(torch.stack([condition_timestep(t) for t in timesteps_of(video_sigmas)]))
    return torch.unique(torch.cat(parts), sorted=True)


def denoise(
    model_fn: ModelFn,
    video_rows: torch.Tensor,
    audio_rows: torch.Tensor,
    video_sigmas: torch.Tensor,
    audio_sigmas: torch.Tensor,
    on_step: StepCallback | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the deterministic Euler loop over both schedules, one forward per step.

    Args:
        model_fn: `(video_rows, audio_rows, video_t, audio_t) -> (video_velocity, audio_velocity)`, t = 1 - sigma as
            0-d float32 tensors.
        video_rows: `[Nv, 96]` noise (float32); audio_rows: `[Na, 32]`.
        video_sigmas, audio_sigmas: `[M]` schedules of equal length (M - 1 forwards).
        on_step: called as `on_step(i, video_rows, audio_rows)` after step i.
    Returns:
        `(video_rows, audio_rows)` float32 at sigma 0.
    Raises:
        ValueError: when the two schedules differ in length.
    """
    if video_sigmas.numel() != audio_sigmas.numel():
        raise ValueError(
            f"video and audio schedules must have the same length, got {video_sigmas.numel()} and "
            f"{audio_sigmas.numel()}"
        )
    video_rows, audio_rows = video_rows.float(), audio_rows.float()
    for i in range(video_sigmas.numel() - 1):
        video_t, audio_t = 1.0 - video_sigmas[i], 1.0 - audio_sigmas[i]
        video_v, audio_v = model_fn(video_rows, audio_rows, video_t, audio_t)
        video_rows = euler_step(video_rows, video_v, video_sigmas[i], video_sigmas[i + 1])
        audio_rows = euler_step(audio_rows, audio_v, audio_sigmas[i], audio_sigmas[i + 1])
        if on_step is not None:
            on_step(i, video_rows, audio_rows)
    return video_rows, audio_rows


def dit_model_fn(
    dit: "DiT",
    text: torch.Tensor,
    layout: PackedLayout,
    tables: "ModulationTables",
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    condition_rows: torch.Tensor | None = None,
    audio_condition_rows: torch.Tensor | None = None,
) -> ModelFn:
    """Adapt a `DiT` to `denoise`'s `model_fn` for one request.

    Args:
        dit: `h3render.models.dit.DiT`.
        text: `[Nt, text_dim]` text-encoder states.
        layout: the request's layout, tensors on the model's device.
        tables: `ModulationTables` holding every timestep of the run (see `schedule_timesteps`).
        rope: `(cos, sin)` from `dit.rope_tables(layout.positions)`; computed once here when None.
        condition_rows: fl2va: `[Nc, 96]` noised keyframe rows (`packing.noise_keyframes`) for a
            `packing.ConditionedLayout`. They are put in front of the generated video rows on every forward, run at
            `packing.condition_timestep(video_t)`, and their velocity is dropped, so `denoise` sees (and writes) only
            the generated rows. `tables` must hold the condition timesteps (`schedule_timesteps(..., keyframes=True)`).
        audio_condition_rows: ref2va: `[Nca, 32]` reference audio rows, clean, put in front of the generated audio
            rows on every forward at `packing.REFERENCE_AUDIO_T` (1.0; `tables` must hold it), velocity dropped.
    """
    if rope is None:
        rope = dit.rope_tables(layout.positions)

    def model_fn(video_rows, audio_rows, video_t, audio_t):
        index = layout.row_timestep_index(tables.index_of(video_t), tables.index_of(audio_t))
        return dit(video_rows, audio_rows, text, layout, tables, index, rope)

    if condition_rows is None and audio_condition_rows is None:
        return model_fn
    num_video = 0 if condition_rows is None else condition_rows.shape[0]
    num_audio = 0 if audio_condition_rows is None else audio_condition_rows.shape[0]
    audio_slot = tables.index_of(REFERENCE_AUDIO_T) if num_audio else None

    def conditioned_model_fn(video_rows, audio_rows, video_t, audio_t):
        index = layout.row_timestep_index(tables.index_of(video_t), tables.index_of(audio_t),
                                          tables.index_of(condition_timestep(video_t)) if num_video else None,
                                          audio_slot)
        if num_video:
            video_rows = torch.cat([condition_rows.to(video_rows.dtype), video_rows])
        if num_audio:
            audio_rows = torch.cat([audio_condition_rows.to(audio_rows.dtype), audio_rows])
        video_v, audio_v = dit(video_rows, audio_rows, text, layout, tables, index, rope)
        return video_v[num_video:], audio_v[num_audio:]

    return conditioned_model_fn
