"""The seams of a windowed clip: each window's decoded frames and soundtrack turned into its share of the one MP4.

Window i (`h3render.windows.Window`) starts at MP4 frame `start`; its first `overlap` frames are the previous
window's last `overlap` frames rendered again, and are cross-faded with them:

* video, in pixel space: local frame j < O is `(1 - w) * previous + w * this` with `w = (j + 1) / (O + 1)`, a linear
  ramp that reaches neither end (both pictures show the same scene, so a linear fade keeps the brightness);
* audio, equal power: over the overlap's samples `a(start + O) - a(start)` (`a = spec.audio_samples`), sample k is
  `cos(theta) * previous + sin(theta) * this`, `theta = pi/2 * (k + 1/2) / N`, so two uncorrelated signals keep
  their power through the fade (cos^2 + sin^2 = 1).

Frames of a window from `keep` on are held for the next window's fade (at most `overlap` frames, on the device they
were decoded on), or dropped past the clip's end (the last window is snapped up to 17n + 5). Audio is cut at the
same frame boundaries in samples, so the writer's per-window audio shares (`Mp4Writer(windows=keeps)`) line up.
Without overlaps every window passes through untouched.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from h3render.spec import FPS, SAMPLE_RATE, audio_samples
from h3render.windows import Window


def back_to_back(frames: Sequence[int]) -> tuple[Window, ...]:
    """The plan of windows of `frames` each, one after the other, whole and without overlap."""
    starts = [sum(frames[:i]) for i in range(len(frames))]
    return tuple(Window(i, start, n, 0, n) for i, (start, n) in enumerate(zip(starts, frames)))


def video_weights(overlap: int) -> torch.Tensor:
    """`[O]` float32 weights of the later window over an `overlap`-frame fade: (j + 1) / (O + 1)."""
    return torch.arange(1, overlap + 1, dtype=torch.float32) / (overlap + 1)


def audio_gains(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`([N], [N])` float32 equal-power gains (earlier window's cos, later window's sin) over `samples` samples."""
    theta = (torch.arange(samples, dtype=torch.float64) + 0.5) * (math.pi / 2 / max(samples, 1))
    return torch.cos(theta).float(), torch.sin(theta).float()


class Splicer:
    """Rank 0's seams of one job: call `audio(i, ...)` once and `frames(i, ...)` per decoded chunk, window by window.

    Args:
        plan: the windows in order (`windows.plan_windows`, or `back_to_back`).
    """

    def __init__(self, plan: Sequence[Window], sample_rate: int = SAMPLE_RATE, fps: int = FPS):
        self.plan = tuple(plan)
        self.sample_rate, self.fps = sample_rate, fps
        self._held: torch.Tensor | None = None  # [3, O, H, W]: the previous window's tail, for this window's head
        self._holding: torch.Tensor | None = None  # the tail being collected from the current window
        self._audio_tail: torch.Tensor | None = None  # [2, n] the previous window's tail samples

    @property
    def keeps(self) -> list[int]:
        """Frames each window hands the writer (`Mp4Writer(windows=...)`)."""
        return [w.keep for w in self.plan]

    def _samples(self, frame: int) -> int:
        return audio_samples(frame, self.sample_rate, self.fps)

    def audio(self, index: int, waveform: torch.Tensor) -> torch.Tensor:
        """Window `index`'s share of the soundtrack from its waveform `[2, S]` (float, CPU, window-local from its frame
        0): its head cross-faded with the previous window's tail, its own tail kept for the next window's fade.

        Returns:
            `[2, a(start + keep) - a(start)]` float32 (zero-padded where the waveform is short); `waveform` itself
            for a window without seams.
        """
        window = self.plan[index]
        following = self.plan[index + 1] if index + 1 < len(self.plan) else None
        if not window.overlap and (following is None or not following.overlap) and window.keep == window.frames:
            return waveform  # a whole window without seams: the writer trims it (and refuses it too short)
        origin = self._samples(window.start)
        share = self._samples(window.start + window.keep) - origin
        wave = waveform.float()
        block = _take(wave, 0, share)
        head = self._samples(window.start + window.overlap) - origin
        if head:
            if self._audio_tail is None or self._audio_tail.shape[1] != head:
                raise ValueError(f"window {index}: no soundtrack tail of {head} samples from window {index - 1}")
            fade_out, fade_in = audio_gains(head)
            block[:, :head] = fade_out * self._audio_tail + fade_in * block[:, :head]
        self._audio_tail = None
        if following is not None:
            end = self._samples(following.start + following.overlap) - origin
            self._audio_tail = _take(wave, share, end)
        return block

    def frames(self, index: int, first: int, chunk: torch.Tensor) -> torch.Tensor | None:
        """What of one decoded chunk goes to the writer now: `chunk` `[3, n, H, W]` float in [0, 1] holds window
        `index`'s local frames `first .. first + n - 1` (chunks in order). Returns `[3, m, H, W]` (head frames
        blended with the previous window's tail), or None when every frame of the chunk is held or dropped."""
        window = self.plan[index]
        if first == 0:
            self._held, self._holding = self._holding, None
        n = chunk.shape[1]
        following = self.plan[index + 1].overlap if index + 1 < len(self.plan) else 0
        out = []
        head_end = min(first + n, window.overlap)
        if first < head_end:  # blended head
            if self._held is None or self._held.shape[1] != window.overlap:
                raise ValueError(f"window {index}: no tail of {window.overlap} frames from window {index - 1}")
            w = video_weights(window.overlap)[first:head_end].to(chunk.device)[None, :, None, None]
            earlier = self._held[:, first:head_end].to(chunk.device)
            out.append((1 - w) * earlier + w * chunk[:, : head_end - first].float())
        lo, hi = max(first, window.overlap), min(first + n, window.keep)
        if lo < hi:  # this window's own frames
            out.append(chunk[:, lo - first: hi - first])
        if following:  # the tail, for the next window's head
            lo, hi = max(first, window.keep), min(first + n, window.keep + following)
            if lo < hi:
                if self._holding is None:
                    self._holding = chunk.new_empty(chunk.shape[0], following, *chunk.shape[2:])
                self._holding[:, lo - window.keep: hi - window.keep] = chunk[:, lo - first: hi - first]
        if first + n >= window.frames:
            self._held = None  # the head is written; free it before the next window
        if not out:
            return None
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def _take(wave: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """`wave[:, start:end]` as a new float32 tensor, zero-padded where the waveform ends early."""
    block = torch.zeros(wave.shape[0], max(0, end - start), dtype=torch.float32)
    part = wave[:, start:end]
    block[:, : part.shape[1]] = part
    return block
