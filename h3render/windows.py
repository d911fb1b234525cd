"""Clips longer than one pass: the window plan of a windowed continuation (torch-free, like `h3render.spec`).

A clip of F frames longer than one pass of the model is rendered as windows of at most `window` frames (each
17n + 5), each after the first starting `overlap` frames before the previous one ends. The overlap is 17j + 5
frames, i.e. K = 5j + 2 latent frames: the previous window's last K latents start a VAE group (latent index 5m, its
phase 0), so placed as condition rows at the next window's latent frames 0 .. K - 1 every latent keeps its phase in
the 1, 4, 4, 4, 4 frame grouping (`spec.FRAMES_PER_LATENT`). In the MP4 the overlap is cross-faded: window i's first
`overlap` frames blend with window i - 1's last (`h3render.seams`). The last window is snapped up to 17n + 5 and
its frames past F are not written, so the MP4 has exactly F frames and `spec.audio_samples(F)` samples per channel.

Defaults and why (docs/manifest.md "Long clips"):

* `window`: the longest 17n + 5 within 15 s, 345 frames (14.375 s): the longest clip inside the 5-15 s the released
  weights were trained on and diffusers 0.42.1 accepts (124-345 frames); a checkpoint whose `max_frames` is lower
  caps it there. Windows are then evened out: n = ceil((F - overlap) / (window - overlap)) windows of equal length
  (snapped up), the last one shortened, so no window is a short leftover outside the trained range.
* `overlap`: 22 frames (0.92 s; K = 7 latent frames). vLLM-Omni's merged latent-tail continuation (PR #7838)
  conditions on the previous window's latent tail; its open sliding-window PR #6779 cross-fades "up to half a
  second"; LongCat-Video-Avatar conditions on 13 frames. 5 frames (K = 2, the shortest phase-aligned tail) carries
  one latent group of motion; 22 carries the last VAE group plus one (about a second of motion, and a cross-fade
  long enough that two unrelated windows still join without a jump, `tests/e2e/test_longclip.py`) at +7 % of a
  window's rows (7 of 102 latent frames at 345 frames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3render.spec import (FPS, FRAMES_PER_CHUNK, FRAMES_REMAINDER, Limits, is_snapped, latent_frames, seconds_text,
                           snap_frames, snap_frames_up)

MAX_CLIP_SECONDS = 120  # the longest clip h3render renders in windows (issue #24); 2,880 frames
MAX_CLIP_FRAMES = MAX_CLIP_SECONDS * FPS
WINDOW_SECONDS = 15.0  # a window stays inside the released training range (5-15 s): <= 360 frames -> 345
DEFAULT_OVERLAP = 22  # frames (17j + 5): 7 latent frames of the previous window condition the next


@dataclass(frozen=True)
class Window:
    """One window of a windowed clip.

    Attributes:
        index: 0-based.
        start: the MP4 frame of this window's frame 0.
        frames: frames this window renders (17n + 5).
        overlap: frames shared with the previous window (0 for the first): its first `overlap` frames are cross-faded
            with the previous window's last `overlap`.
        keep: frames this window hands the writer (its blended head included): up to the next window's start, or
            up to the clip's end for the last window (whose frames past it are dropped).
    """

    index: int
    start: int
    frames: int
    overlap: int
    keep: int

    @property
    def tail_latents(self) -> int:
        """Latent frames of the previous window that condition this one (0 for the first window)."""
        return latent_frames(self.overlap) if self.overlap else 0

    def to_dict(self) -> dict:
        return {"start": self.start, "overlap": self.overlap, "keep": self.keep}


def default_window(limits: Limits) -> int:
    """The longest window: the longest 17n + 5 within `WINDOW_SECONDS` and the checkpoint's `max_frames` (345)."""
    top = min(int(WINDOW_SECONDS * FPS), limits.max_frames)
    return top - (top - FRAMES_REMAINDER) % FRAMES_PER_CHUNK


def check_window(window: int, overlap: int) -> None:
    """Raises ValueError unless `overlap` is 17j + 5 and `window` a 17n + 5 at least 2 x overlap + 17 frames (a window
    must reach past both its blended head and its held tail)."""
    if not is_snapped(overlap):
        raise ValueError(f"overlap {overlap} must be 17j + 5 frames (5, 22, 39, ...) so the tail latents keep their "
                         "phase")
    if not is_snapped(window) or window < 2 * overlap + FRAMES_PER_CHUNK:
        raise ValueError(f"window {window} must be 17n + 5 frames and at least {2 * overlap + FRAMES_PER_CHUNK} "
                         f"(2 x overlap {overlap} + 17)")


def plan_windows(frames: int, window: int, overlap: int = DEFAULT_OVERLAP) -> tuple[Window, ...]:
    """The windows of a `frames`-frame clip (see the module docstring): n = ceil((F - overlap) / (window -
    overlap)) windows of one evened-out length L = snap_up(ceil((F - overlap) / n) + overlap) <= window, starting
    every L - overlap frames; the last one snapped up from what is left.

    30 s (720 frames), window 345, overlap 22 -> 3 windows of 260 frames starting at 0, 238, 476 (the last renders
    260, keeps 244).

    Raises:
        ValueError: a bad window/overlap (`check_window`), or frames < 1.
    """
    check_window(window, overlap)
    if frames < 1:
        raise ValueError(f"frames {frames} must be positive")
    if snap_frames_up(frames) <= window:
        return (Window(0, 0, snap_frames_up(frames), 0, frames),)
    count = math.ceil((frames - overlap) / (window - overlap))
    length = snap_frames_up(math.ceil((frames - overlap) / count) + overlap)
    while True:  # the rounding up of `length` can leave the last window nothing past its overlap: one fewer then
        step = length - overlap
        last_start = (count - 1) * step
        if frames - last_start > overlap or count == 1:
            break
        count -= 1
    plan = []
    for index in range(count):
        start = index * step
        last = index == count - 1
        plan.append(Window(index, start, snap_frames_up(frames - start) if last else length,
                           overlap if index else 0, frames - start if last else step))
    return tuple(plan)


def resolve_frames(frames: int | None, duration: float | None, limits: Limits) -> tuple[int, int | None]:
    """The frames a request renders and, past one pass, its window: `(snapped frames, None)` for a clip that fits
    one pass (`spec.snap_frames`), `(exact frames, window)` for a longer one up to `MAX_CLIP_SECONDS` (a duration
    becomes round(duration x 24) frames, which the MP4 then has exactly).

    Raises:
        ValueError: as `spec.snap_frames` (bad values, below the checkpoint's range), or longer than 120 s.
    """
    try:
        return snap_frames(frames, duration, limits), None
    except ValueError:
        wanted = snap_frames(frames, duration)  # the same checks of the value itself, no range
        if wanted <= limits.max_frames:
            raise
    exact = frames if frames is not None else max(1, round(duration * FPS))
    if exact > MAX_CLIP_FRAMES:
        asked = f"duration {duration:g} s" if duration is not None else f"frames {frames}"
        raise ValueError(f"{asked} is {exact} frames ({seconds_text(exact)} s), longer than the {MAX_CLIP_SECONDS} s "
                         f"({MAX_CLIP_FRAMES} frames) h3render renders as windowed continuation")
    return exact, default_window(limits)


def plan_note(frames: int, window: int, overlap: int, conditioned: bool = True) -> str:
    """"in 3 windows of 260 frames, 22-frame overlaps cross-faded" for the plan line and the log."""
    plan = plan_windows(frames, window, overlap)
    lengths = sorted({w.frames for w in plan}, reverse=True)
    how = (f"each conditioned on the last {latent_frames(overlap)} latent frames of the one before" if conditioned
           else "not conditioned on each other (FastH3 students are t2va-only)")
    return (f"in {len(plan)} windows of {'/'.join(map(str, lengths))} frames, {overlap}-frame overlaps cross-faded, "
            f"{how}")
