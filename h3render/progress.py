"""Stage progress of one render on stderr: tqdm bars on a terminal, plain lines in a log.

`render.render_job` reports four stages of every job through a `Progress` (the engine's `settings.progress`):
``text_encode``, ``denoise`` (one update per DiT forward), ``decode`` (one update per frame decoded by the video VAE
and handed to the MP4 writer) and ``encode`` (frames the x264 thread has taken in, then the MP4's close: flush,
trailer, fsync, rename). Styles:

=========  ==========================================================================================================
``bar``    a tqdm bar per stage (``leave=False``, at ``position``: 0 for `h3render prompt`, 1 under batch's queue bar)
``lines``  a line when each stage ends, and while a stage runs a line at most every ``every_s`` seconds (10 s: one
           line per step when a step is slower than that); `h3render prompt` when stderr is not a terminal
``slow``   only stages that run ``every_s`` or longer are mentioned (their periodic lines and their end line);
           `h3render batch` in a log, which already prints one line per job
``off``    nothing (`--quiet`; ranks other than 0)
=========  ==========================================================================================================
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO

STYLES = ("bar", "lines", "slow", "off")
EVERY_S = 10.0  # a log line at most this often per running stage: a SLURM log stays readable, a stall shows


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

            self._bar = tqdm(total=total, desc=name, unit=unit or "it", position=owner.position + row, leave=False,
                             file=owner.stream, dynamic_ncols=True)

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if self.owner.style in ("lines", "slow"):
            now = self.owner.clock()
            if now - self.last_line >= self.owner.every_s:
                self.last_line = now
                self.owner.write(f"h3render: {self.job}: {self.name} {self._count()}, {now - self.start:.1f} s so far")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._bar is not None:
            self._bar.close()
            return
        elapsed = self.owner.clock() - self.start
        if self.owner.style == "lines" or (self.owner.style == "slow" and elapsed >= self.owner.every_s):
            count = f" ({self._count()})" if self.total is not None or self.done else ""
            self.owner.write(f"h3render: {self.job}: {self.name} done in {elapsed:.1f} s{count}")

    def _count(self) -> str:
        """'12/49 steps', or '12 steps' without a total."""
        done = str(self.done) if self.total is None else f"{self.done}/{self.total}"
        return f"{done} {self.unit}".rstrip()


def as_progress(value, position: int = 0) -> Progress:
    """`RunSettings.progress` (h3render.settings) as a `Progress`: a Progress as is, True -> tqdm bars at `position`, False -> off."""
    if isinstance(value, Progress):
        return value
    return Progress("bar" if value else "off", position=position)
