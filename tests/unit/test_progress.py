"""h3render.progress: which lines each style prints, on a fake clock."""

from __future__ import annotations

import io

import pytest

from h3render.progress import Progress, as_progress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def run_stage(progress: Progress, clock: Clock, step_s: float, steps: int) -> None:
    with progress.stage("clip", "denoise", steps, "steps") as shown:
        for _ in range(steps):
            clock.t += step_s
            shown.update(1)


def test_lines_style_end_line_and_one_line_per_slow_step():
    stream, clock = io.StringIO(), Clock()
    progress = Progress("lines", stream=stream, clock=clock)
    run_stage(progress, clock, step_s=12.0, steps=3)  # every step slower than 10 s: a line each
    assert lines(stream) == ["h3render: clip: denoise 1/3 steps, 12.0 s so far",
                             "h3render: clip: denoise 2/3 steps, 24.0 s so far",
                             "h3render: clip: denoise 3/3 steps, 36.0 s so far",
                             "h3render: clip: denoise done in 36.0 s (3/3 steps)"]


def test_lines_style_fast_steps_print_every_ten_seconds():
    stream, clock = io.StringIO(), Clock()
    run_stage(Progress("lines", stream=stream, clock=clock), clock, step_s=3.0, steps=10)  # 30 s in all
    assert lines(stream) == ["h3render: clip: denoise 4/10 steps, 12.0 s so far",
                             "h3render: clip: denoise 8/10 steps, 24.0 s so far",
                             "h3render: clip: denoise done in 30.0 s (10/10 steps)"]


def test_slow_style_mentions_only_long_stages_and_off_nothing():
    stream, clock = io.StringIO(), Clock()
    progress = Progress("slow", stream=stream, clock=clock)
    run_stage(progress, clock, step_s=1.0, steps=5)  # 5 s: not mentioned
    assert lines(stream) == []
    run_stage(progress, clock, step_s=6.0, steps=2)  # 12 s
    assert lines(stream) == ["h3render: clip: denoise 2/2 steps, 12.0 s so far",
                             "h3render: clip: denoise done in 12.0 s (2/2 steps)"]
    quiet = io.StringIO()
    run_stage(Progress("off", stream=quiet, clock=clock), clock, step_s=20.0, steps=2)
    assert quiet.getvalue() == ""


def test_close_twice_prints_once_and_a_stage_without_units_has_no_count():
    stream, clock = io.StringIO(), Clock()
    shown = Progress("lines", stream=stream, clock=clock).stage("clip", "text encode")
    clock.t = 0.5
    shown.close()
    shown.close()
    assert lines(stream) == ["h3render: clip: text encode done in 0.5 s"]


def test_bar_style_draws_tqdm_and_as_progress_maps_bools():
    stream = io.StringIO()
    with Progress("bar", stream=stream).stage("clip", "decode", 4, "frames") as shown:
        shown.update(4)
    assert "decode" in stream.getvalue() and "/4 [" in stream.getvalue()  # a tqdm bar, cleared (leave=False)
    assert as_progress(True, position=1).style == "bar" and as_progress(True, position=1).position == 1
    assert as_progress(False).style == "off"
    with pytest.raises(ValueError, match="progress style"):
        Progress("loud")
