"""Turbo LoRA schedules (issue #25 item 3): a few-step LoRA runs the schedule it was distilled for, taken from
the file's metadata or from a named preset, never guessed.

* Metadata: a header entry ``h3render_schedule`` holding JSON ``{"forwards": N, "video_shift": s_v,
  "audio_shift": s_a}`` (the uniform grid below) or ``{"positions": [p_0, ..., 0], "video_shift", "audio_shift"}``
  (explicit pre-shift positions, as FastH3's), optionally ``"alpha"``. No published turbo file states its
  schedule in its header today; the entry is how a converted or self-trained file carries it.
* Presets (`PRESETS`), from the publisher's own statement of the schedule. lightx2v's MiniMax-H3 Turbo LoRAs
  (ModelTC/Minimax-H3-Turbo README, "Model specs"): for NFE = N the evaluation points on the unshifted grid are
  ``q_i = (N - i) / N``, i = 0..N-1, then 0 — ``linspace(1, 0, N + 1)`` — through the training shifts (video /
  audio): FL2VA 4-step v0.1 and 8-step v1.0 at 12 / 3, the 4-step v1.0 768p file at 6 / 3 run with
  ``--lora-alpha 128`` (its scale is alpha / rank: the preset carries the alpha). The README's example: NFE 4,
  shifts 12 / 3 -> video sigmas [1, 0.9730, 0.9231, 0.8000] -> 0, audio [1, 0.9, 0.75, 0.5] -> 0.

larryvrh's Turbo LoRA and alibaba-pai's MiniMax-H3-Acc-LoRAs state no machine-readable schedule and their
model cards were not available to this work: no preset (a job with them runs the base schedule unless its entry
names one or the file carries ``h3render_schedule``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from h3render.checkpoint.errors import AdapterError
from h3render.sampling import Schedule

METADATA_KEY = "h3render_schedule"


@dataclass(frozen=True)
class TurboPreset:
    """A published turbo LoRA's schedule: ``forwards`` N (grid linspace(1, 0, N + 1)), the shifts, the alpha its
    publisher runs it with (None: the file's own), and the source of these numbers."""

    forwards: int
    video_shift: float
    audio_shift: float
    alpha: float | None
    source: str

    def schedule(self, label: str) -> Schedule:
        s = Schedule.base(self.forwards + 1, self.video_shift, self.audio_shift)
        return Schedule(s.video, s.audio, s.video_shift, s.audio_shift, f"turbo LoRA {label}")


_LIGHTX2V = "ModelTC/Minimax-H3-Turbo README (Model specs; NFE grid q_i = (N - i) / N)"
PRESETS = {
    "lightx2v-fl2va-4step-v0.1": TurboPreset(4, 12.0, 3.0, None, _LIGHTX2V),
    "lightx2v-fl2va-8step-v1.0": TurboPreset(8, 12.0, 3.0, None, _LIGHTX2V),
    "lightx2v-fl2va-4step-v1.0-768p": TurboPreset(4, 6.0, 3.0, 128.0, _LIGHTX2V + "; run with --lora-alpha 128"),
}


def metadata_schedule(metadata: dict[str, str], where: str) -> tuple[Schedule, float | None] | None:
    """The schedule (and alpha) an ``h3render_schedule`` header entry states, or None without one.

    Raises:
        AdapterError: the entry is not JSON of the documented form (naming the file and the field).
    """
    text = metadata.get(METADATA_KEY)
    if text is None:
        return None
    try:
        spec = json.loads(text)
        video_shift, audio_shift = float(spec["video_shift"]), float(spec["audio_shift"])
        alpha = None if spec.get("alpha") is None else float(spec["alpha"])
        if "positions" in spec:
            schedule = Schedule.few_step(spec["positions"], video_shift, audio_shift, f"LoRA metadata ({where})")
        else:
            forwards = int(spec["forwards"])
            if forwards < 1:
                raise ValueError("forwards must be >= 1")
            s = Schedule.base(forwards + 1, video_shift, audio_shift)
            schedule = Schedule(s.video, s.audio, s.video_shift, s.audio_shift, f"LoRA metadata ({where})")
    except (ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"{where}: metadata {METADATA_KEY}={text!r} is not {{forwards | positions, video_shift, "
                           f"audio_shift[, alpha]}} ({exc})") from None
    return schedule, alpha
