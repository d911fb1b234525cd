"""ref2va: ordered image, video and audio references condition the clip, beside the prompt."""

from __future__ import annotations

import torch

from h3render.packing import REFERENCE_AUDIO_T
from h3render.sampling import Schedule, schedule_timesteps

NAME = "ref2va"
ENCODE_STAGE = "text + references encode"
FEW_STEP = False  # the FastH3 students are t2va-only
PARTITION = "transformer_ref"  # official layout: Ref2VA/transformer/


def timesteps(schedule: Schedule) -> torch.Tensor:
    """Every distinct timestep of a ref2va job's forwards, `[K]` float32 ascending: the schedule's, the visual
    references' `packing.condition_timestep` of every step (0.999) and the reference audio's 1.0 (tabulated even
    for a job without audio references: one AdaLN row more, so one table serves every ref2va job of a schedule)."""
    base = schedule_timesteps(schedule.video, schedule.audio, keyframes=True)
    return torch.unique(torch.cat([base, torch.tensor([REFERENCE_AUDIO_T], dtype=torch.float32)]), sorted=True)
