"""Stage progress of one render on stderr: tqdm bars on a terminal, plain lines in a log.

`render.render_job` reports four stages of every job through a `Progress` (the engine's `settings.progress`):
``text_encode`` (one update: the window's prompt), ``denoise`` (one update per DiT forward), ``decode`` (one update per frame decoded by the video VAE
and handed to the MP4 writer) and ``encode`` (frames the x264 thread has taken in, then the MP4's close: flush,
trailer, fsync, rename). Styles:

=========  ==========================================================================================================
``bar``    a tqdm bar per stage (``leave=False``, at ``position``: 0 for `h3render prompt`, 1 under batch's queue bar)
``lines``  a line when each stage ends, and while a stage runs a line at most every ``every_s`` seconds (10 s: one
           line per step when a step is slower than that) with the time left when the total is known; `h3render
           prompt` when stderr is not a terminal
``slow``   only stages that run ``every_s`` or longer are mentioned (their periodic lines and their end line);
           `h3render batch` in a log, which already prints one line per job
``off``    nothing (`--quiet`; ranks other than 0)
=========  ==========================================================================================================

A stage's end line says "done" only when it reached its total; one left early says "interrupted" (Ctrl-C) or
"stopped" (an error, or closed short of its total), so a log never reads "done (0/7 forwards)".
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

STYLES = ("bar", "lines", "slow", "off")
EVERY_S = 10.0  # a log line at most this often per running stage: a SLURM log stays readable, a stall shows
# The bar size when the terminal reports none: some terminals (a serial console, an IDE's pseudo-terminal, `docker
# exec -t`) say 0 x 0, and tqdm then hides every bar (it places none at or beyond "row -1").
FALLBACK_COLUMNS, FALLBACK_ROWS = 80, 24


def terminal_size(stream: TextIO) -> tuple[int, int] | None:
    """(columns, rows) of the terminal behind `stream`, or None when it has none or reports a zero size."""
    try:
        columns, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return (columns, rows) if columns > 0 and rows > 0 else None


class Progress:
    """Where a job's stage progress goes; one object serves every job of a queue (thread-safe).

    Args:
        style: one of `STYLES` (see the module docstring).
        every_s: least seconds between two lines of one running stage (``lines``/``slow``), and the shortest stage
            ``slow`` mentions.
        position: tqdm row of the bars (``bar``).
        stream: where lines and bars go (default: stderr at call time).
        clock: seconds, monotonic (tests pass a fake).
    """

    def __init__(self, style: str = "off", *, every_s: float = EVERY_S, position: int = 0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if style not in STYLES:
            raise ValueError(f"progress style {style!r}: choose one of {', '.join(STYLES)}")
        self.style, self.every_s, self.position = style, every_s, position
        self._stream, self.clock = stream, clock
        self._lock = threading.Lock()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def stage(self, job: str, name: str, total: int | None = None, unit: str = "", row: int = 0) -> "StageProgress":
        """Start reporting stage `name` of job `job` (its output name); `total` units expected (None: unknown).
        `row`: bar row below `position`, for a stage that runs beside another (encode beside decode)."""
        return StageProgress(self, job, name, total, unit, row)

    def write(self, text: str) -> None:
        with self._lock:
            if self.style == "bar":
                from tqdm import tqdm

                tqdm.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)


class StageProgress:
    """One running stage: `update(n)` as units finish, `close()` at its end (both safe from any thread; `close` more
    than once is a no-op). Also a context manager that closes on exit."""

    def __init__(self, owner: Progress, job: str, name: str, total: int | None, unit: str, row: int = 0) -> None:
        self.owner, self.job, self.name, self.total, self.unit = owner, job, name, total, unit
        self.done = 0
        self.start = self.last_line = owner.clock()
        self.closed = False
        self._bar = None
        if owner.style == "bar":
            from tqdm import tqdm

            # Follow the terminal's width as it is resized, unless it reports no size: then a fixed 80 x 24.
            size = {} if terminal_size(owner.stream) else {"ncols": FALLBACK_COLUMNS, "nrows": FALLBACK_ROWS}
            self._bar = tqdm(total=total, desc=name, unit=unit or "it", position=owner.position + row, leave=False,
                             file=owner.stream, dynamic_ncols=not size, **size)

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if self.owner.style in ("lines", "slow"):
            now = self.owner.clock()
            if now - self.last_line >= self.owner.every_s:
                self.last_line = now
                elapsed = now - self.start
                self.owner.write(f"h3render: {self.job}: {self.name} {self._count()}, {elapsed:.1f} s so far"
                                 f"{self._eta(elapsed)}")

    def close(self, error: BaseException | None = None) -> None:
        """End the stage. `error`: what ended it early (a `with` block passes its exception); without one, a stage
        short of its total still reads "stopped", not "done"."""
        if self.closed:
            return
        self.closed = True
        if self._bar is not None:
            with self.owner._lock:
                self._bar.close()
                # tqdm clears a bar below the first row by writing spaces there and moving up one row, which
                # leaves the cursor at the far right: the next line (`wrote ...`) would start there and wrap.
                self.owner.stream.write("\r")
                self.owner.stream.flush()
            return
        elapsed = self.owner.clock() - self.start
        if isinstance(error, KeyboardInterrupt):
            outcome = "interrupted after"
        elif error is not None or (self.total is not None and self.done < self.total):
            outcome = "stopped after"
        else:
            outcome = "done in"
        if self.owner.style == "lines" or (self.owner.style == "slow" and elapsed >= self.owner.every_s):
            count = f" ({self._count()})" if self.total is not None or self.done else ""
            self.owner.write(f"h3render: {self.job}: {self.name} {outcome} {elapsed:.1f} s{count}")

    def _eta(self, elapsed: float) -> str:
        """', about 18 s left' at the mean rate so far, when the total is known and some but not all units are done."""
        if self.total is None or not 0 < self.done < self.total:
            return ""
        left = elapsed / self.done * (self.total - self.done)
        return f", about {left:.0f} s left"

    def _count(self) -> str:
        """'12/49 steps', or '12 steps' without a total."""
        done = str(self.done) if self.total is None else f"{self.done}/{self.total}"
        return f"{done} {self.unit}".rstrip()


def as_progress(value, position: int = 0) -> Progress:
    """`RunSettings.progress` (h3render.settings) as a `Progress`: a Progress as is, True -> tqdm bars at `position`, False -> off."""
    if isinstance(value, Progress):
        return value
    return Progress("bar" if value else "off", position=position)
