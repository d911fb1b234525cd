"""What a task hands the job path: `Prepared`, the same shape for every task (t2va, fl2va; ref2va and windowed
continuation next), so `render.generate` has no task branch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from h3render.packing import PackedLayout

# The DiT partition of the checkpoint that t2va and fl2va run (official layout `FL2VA/transformer/`, diffusers
# `transformer/`); ref2va's is `transformer_ref` (official `Ref2VA/transformer/`).
BASE_PARTITION = "transformer"


@dataclass(eq=False)
class Encoded:
    """A job's text conditioning from its task's `encode_text`: `states` `[N, text_dim]` (text-encoder dtype) and
    what the task keeps beside them (fl2va: the `Presentation`; t2va: None). Held in host memory between the text
    phase and the job in the phased memory plans (`h3render.text_phase`)."""

    states: torch.Tensor
    extra: Any = None


@dataclass(eq=False)
class Prepared:
    """One job's (or one window's) inputs to the denoising loop, on the engine's device.

    Attributes:
        text: `[Nt, text_dim]` text-encoder states (the prompt, or its presentation with vision blocks).
        layout: the packed layout the DiT sees (`packing.PackedLayout`; a `ConditionedLayout` with condition rows).
        output_layout: the layout of the generated rows alone, for `packing.unpatchify_video` / `rows_to_audio`
            (t2va: `layout` itself; fl2va: `layout.target_layout()`).
        video_rows: `[Nv, 96]` float32 initial noise of the generated video rows (`packing.patchify_video`).
        audio_rows: `[Na, 32]` float32 initial noise of the audio rows (row layout: channel 0, then channel 1).
        condition_rows: `[Nc, 96]` float32 fixed condition rows put in front of the video rows on every forward
            (fl2va: the noised keyframe latents), or None.
        audio_condition_rows: `[Nca, 32]` float32 clean reference audio rows put in front of the generated audio
            rows on every forward (ref2va's soundtracks and clips), or None.
        partition: which DiT of the checkpoint runs this job (`BASE_PARTITION`, or "transformer_ref").
        record: what the task adds to the sidecar's `extra` (fl2va: `{"fl2va": {...}}`); {} for t2va.
    """

    text: torch.Tensor
    layout: PackedLayout
    output_layout: PackedLayout
    video_rows: torch.Tensor
    audio_rows: torch.Tensor
    condition_rows: torch.Tensor | None = None
    audio_condition_rows: torch.Tensor | None = None
    partition: str = BASE_PARTITION
    record: dict[str, Any] = field(default_factory=dict)
