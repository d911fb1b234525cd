"""h3render.progress: which lines each style prints, on a fake clock."""

from __future__ import annotations

import io

import pytest

from h3render.progress import FALLBACK_COLUMNS, Progress, as_progress


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
    assert lines(stream) == ["h3render: clip: denoise 1/3 steps, 12.0 s so far, about 24 s left",
                             "h3render: clip: denoise 2/3 steps, 24.0 s so far, about 12 s left",
                             "h3render: clip: denoise 3/3 steps, 36.0 s so far",
                             "h3render: clip: denoise done in 36.0 s (3/3 steps)"]


def test_lines_style_fast_steps_print_every_ten_seconds():
    stream, clock = io.StringIO(), Clock()
    run_stage(Progress("lines", stream=stream, clock=clock), clock, step_s=3.0, steps=10)  # 30 s in all
    assert lines(stream) == ["h3render: clip: denoise 4/10 steps, 12.0 s so far, about 18 s left",
                             "h3render: clip: denoise 8/10 steps, 24.0 s so far, about 6 s left",
                             "h3render: clip: denoise done in 30.0 s (10/10 steps)"]


def test_slow_style_mentions_only_long_stages_and_off_nothing():
    stream, clock = io.StringIO(), Clock()
    progress = Progress("slow", stream=stream, clock=clock)
    run_stage(progress, clock, step_s=1.0, steps=5)  # 5 s: not mentioned
    assert lines(stream) == []
    run_stage(progress, clock, step_s=6.0, steps=2)  # 12 s
    assert lines(stream) == ["h3render: clip: denoise 2/2 steps, 12.0 s so far",  # the last step: no time left
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


def test_a_stage_without_a_total_has_no_eta():
    stream, clock = io.StringIO(), Clock()
    with Progress("lines", stream=stream, clock=clock).stage("clip", "decode", None, "frames") as shown:
        clock.t = 11.0
        shown.update(5)
    assert lines(stream) == ["h3render: clip: decode 5 frames, 11.0 s so far",
                             "h3render: clip: decode done in 11.0 s (5 frames)"]


def test_an_interrupted_or_failed_stage_does_not_say_done():
    stream, clock = io.StringIO(), Clock()
    progress = Progress("lines", stream=stream, clock=clock)
    with pytest.raises(KeyboardInterrupt):
        with progress.stage("clip", "denoise", 7, "steps"):
            clock.t += 3.0
            raise KeyboardInterrupt
    with pytest.raises(RuntimeError):
        with progress.stage("clip", "decode", 8, "frames") as shown:
            clock.t += 1.0
            shown.update(2)
            raise RuntimeError("VAE out of memory")
    short = progress.stage("clip", "encode", 8, "frames")  # closed short of its total, no error (an abort)
    short.update(3)
    short.close()
    assert lines(stream) == ["h3render: clip: denoise interrupted after 3.0 s (0/7 steps)",
                             "h3render: clip: decode stopped after 1.0 s (2/8 frames)",
                             "h3render: clip: encode stopped after 0.0 s (3/8 frames)"]


# --- bars on a real pseudo-terminal, read back through a minimal terminal model --------------------------------------

def _on_a_terminal(columns: int, rows: int, draw) -> bytes:
    """Everything `draw(stream)` writes to a pseudo-terminal of `columns` x `rows` (as the kernel reports it)."""
    pty = pytest.importorskip("pty")  # noqa: F841  (POSIX only)
    import fcntl
    import os
    import select
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    raw = b""
    with os.fdopen(slave, "w", buffering=1) as stream:
        draw(stream)
        stream.flush()
        while select.select([master], [], [], 0.2)[0]:
            raw += os.read(master, 65536)
    os.close(master)
    return raw


def _screen(raw: bytes, columns: int) -> list[str]:
    """What a `columns`-wide terminal shows: printable text with auto-wrap, CR, LF and cursor-up (ESC [ A), which
    is all tqdm and print emit here."""
    text = raw.decode().replace("\x1b[A", "\x00")
    rows, row, col = [[]], 0, 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
        elif ch == "\x00":
            row = max(0, row - 1)
        else:
            if col >= columns:  # auto-wrap onto the next row
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(r).rstrip() for r in rows]


def _render_like_a_job(stream) -> None:
    progress = Progress("bar", stream=stream)
    encode = progress.stage("clip", "encode", 8, "frames", row=1)  # beside decode, one row down (render.py)
    decode = progress.stage("clip", "decode", 8, "frames")
    for _ in range(8):
        decode.update(1)
        encode.update(1)
    decode.close()
    encode.close()
    print("h3render: wrote out/clip.mp4 and out/clip.json in 3.0 s", file=stream)  # runner's last line


def test_the_wrote_line_starts_at_the_left_edge_after_the_bars_close():
    screen = _screen(_on_a_terminal(60, 24, _render_like_a_job), 60)
    assert "h3render: wrote out/clip.mp4 and out/clip.json in 3.0 s" in screen  # on one row, not wrapped


def test_a_terminal_reporting_zero_columns_still_shows_bars():
    raw = _on_a_terminal(0, 0, _render_like_a_job).decode()
    bars = [part for part in raw.replace("\x1b[A", "\r").split("\r") if "decode" in part or "encode" in part]
    assert bars, raw  # tqdm alone draws nothing on a 0 x 0 terminal
    assert all(len(bar) <= FALLBACK_COLUMNS for bar in bars)
