"""The batch queue's report and progress: job statuses, `BatchReport` (``batch-report.json``) and the queue's
log (a tqdm bar or one line per job). `h3render.batch` drives them; the report's fields are documented in
docs/slurm.md ("The report").
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h3render import locks
from h3render.exits import EXIT_FAILED, EXIT_OK, signal_exit_code
from h3render.signals import signal_name

SUCCEEDED = "succeeded"
FAILED = "failed"
SKIPPED = "skipped"
PENDING = "pending"
INTERRUPTED = "interrupted"
ELSEWHERE = "elsewhere"  # locked by another live process when this queue reached it
STATUSES = (SUCCEEDED, FAILED, SKIPPED, PENDING, INTERRUPTED, ELSEWHERE)

REPORT_FORMAT = 4  # bump when a consumer-visible field of batch-report.json changes (4: elsewhere, signal, errors)


@dataclass
class JobOutcome:
    """One job's line in the report. ``output`` is the MP4 path relative to the out dir; ``seconds`` is wall time
    of this job's render up to its sidecar (the one-off model load is ``BatchReport.load_seconds``), None when it
    did not run."""

    id: str | None
    output: str
    status: str = PENDING
    seconds: float | None = None
    error: str | None = None  # "ExceptionType: message" for failed / interrupted jobs; who holds an elsewhere job
    traceback: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "output": self.output, "status": self.status,
             "seconds": None if self.seconds is None else round(self.seconds, 3), "error": self.error}
        if self.traceback is not None:
            d["traceback"] = self.traceback
        return d


@dataclass
class BatchReport:
    """What happened to each job, in manifest order, and where the report file was written."""

    path: Path
    jobs: list[JobOutcome]
    shard: tuple[int, int] | None = None
    interrupted: bool = False
    signum: int | None = None  # the signal that stopped the queue (None with a plain KeyboardInterrupt)
    finished: bool = False
    crashed: str | None = None  # an internal error that ended the queue ("Type: message")
    load_seconds: float | None = None
    queue_seconds: float | None = None  # wall time from the first render to the latest job outcome (load excluded)
    started_at: str = field(default_factory=lambda: _now())
    write_error: str | None = None  # the latest failed report write ("<path>: <reason>"), None once one succeeds
    final_write_failed: bool = False
    _write_lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, status: str) -> int:
        return sum(1 for j in self.jobs if j.status == status)

    @property
    def counts(self) -> dict[str, int]:
        return {s: self.count(s) for s in STATUSES}

    @property
    def exit_code(self) -> int:
        """See the module docstring: 75 or 130 when stopped by a signal, else 1 or 0."""
        if self.interrupted:
            return signal_exit_code(self.signum)
        bad = self.count(FAILED) or self.count(ELSEWHERE) or self.crashed or self.final_write_failed
        return EXIT_FAILED if bad else EXIT_OK

    @property
    def state(self) -> str:
        if self.crashed:
            return "crashed"
        return "interrupted" if self.interrupted else ("finished" if self.finished else "running")

    def to_dict(self) -> dict[str, Any]:
        done = self.finished or self.interrupted or self.crashed
        return {
            "format": REPORT_FORMAT,
            "state": self.state,
            "exit_code": self.exit_code if done else None,
            "signal": None if not self.interrupted else signal_name(self.signum),
            "error": self.crashed,
            "report_error": self.write_error,
            "shard": None if self.shard is None else {"index": self.shard[0], "count": self.shard[1]},
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "updated_at": _now(),
            "load_seconds": None if self.load_seconds is None else round(self.load_seconds, 3),
            "queue_seconds": None if self.queue_seconds is None else round(self.queue_seconds, 3),
            "counts": self.counts,
            "jobs": [j.to_dict() for j in self.jobs],
        }

    def write(self) -> bool:
        """Atomically (temp file in the same folder, fsync, rename) replace the report file. Thread-safe. A failed
        write (a full disk) is recorded in ``write_error`` and returns False: the next write retries it."""
        with self._write_lock:
            try:
                _write_json_atomic(self.path, self.to_dict())
            except OSError as exc:
                self.write_error = f"{self.path}: {exc.strerror or exc}"
                return False
            self.write_error = None
            return True

    def write_final(self) -> bool:
        """The last write: atomic if possible; else the exit code becomes 1 and the report is rewritten in place
        (its old blocks need no new space on a full disk); if even that fails it is removed, so that no file is
        left claiming the queue still runs. Returns whether the final report is on disk."""
        if self.write():
            return True
        with self._write_lock:
            self.final_write_failed = True
            try:
                _write_in_place(self.path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())
                return True
            except OSError:
                remove_files(self.path)
                return False


def report_name(shard: tuple[int, int] | None = None, owner: str | None = None) -> str:
    """``batch-report.json``, or ``batch-report.shard-<i>-of-<n>.json`` (i 0-based) so array tasks writing into one
    out dir keep apart; with ``owner`` ("<host>-<pid>") the name a second process on the same report takes."""
    stem = "batch-report" if shard is None else f"batch-report.shard-{shard[0]}-of-{shard[1]}"
    return f"{stem}.json" if owner is None else f"{stem}.{owner}.json"


# A fresh file, never an existing one or a link's target: O_EXCL fails on any name already there, symlinks included.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")  # the report's owner (its lock) is the only writer of this name
    try:
        remove_files(tmp)  # whatever is there (a symlink planted to a file outside) is unlinked, never written through
        with os.fdopen(os.open(tmp, _NEW_FILE, 0o644), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_files(tmp)
        raise


def _write_in_place(path: Path, data: bytes) -> None:
    """Overwrite an existing file's bytes without a temp file (no new blocks needed for the same length)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a symlink at the report's name is not written
    try:
        os.write(fd, data)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_files(*paths: Path) -> None:
    """Delete each path that exists (temp files of a failed or interrupted job)."""
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def claim_report(out_dir: Path, shard) -> tuple[Path, "locks.FileLock | None", str | None, bool]:
    """The report path this process owns (`report_name`), the lock that keeps it, a note for the log (a per-process name was
    taken, or the filesystem has no locks) and whether locks work here.

    Raises:
        OSError: the out dir takes no file (read-only, full).
    """
    main = out_dir / report_name(shard)
    try:
        lock = locks.FileLock.try_acquire(main.with_name(main.name + ".lock"))
    except locks.LockUnsupported as exc:
        return main, None, f"{exc.strerror}; running without locks: two queues on this out dir would clash", False
    if lock is not None:
        return main, lock, None, True
    who = locks.holder(main.with_name(main.name + ".lock"))
    own = out_dir / report_name(shard, owner=f"{socket.gethostname()}-{os.getpid()}")
    return own, None, f"{main.name} belongs to another queue ({who}); this queue's report is {own.name}", True


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _name(outcome: JobOutcome) -> str:
    return outcome.output if outcome.id is None else f"{outcome.id} ({outcome.output})"


class QueueLog:
    """The queue's progress: a tqdm bar (done / failed / left, ETA) or, without it, one stderr line per job."""

    def __init__(self, bar: bool):
        self.want_bar = bar
        self.total, self.done, self.failed = 0, 0, 0
        self.bar = None

    def start(self, total: int) -> None:
        self.total = total
        if self.want_bar and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, position=0, desc="queue", unit="job", file=sys.stderr, dynamic_ncols=True)
            self._postfix()

    def _postfix(self) -> None:
        self.bar.set_postfix_str(f"done {self.done}, failed {self.failed}, left {self.total - self.done - self.failed}")

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"h3render batch: {text}", file=sys.stderr)
        else:
            print(f"h3render batch: {text}", file=sys.stderr, flush=True)

    def _count(self, status: str) -> None:
        if status in (SUCCEEDED, SKIPPED):
            self.done += 1
        elif status == FAILED:
            self.failed += 1  # an interrupted job is neither: the report says interrupted, so does the bar's end
        if self.bar is not None:
            self.bar.update(1)
            self._postfix()

    def job_done(self, index: int, n_jobs: int, outcome: JobOutcome, reason: str) -> None:
        self._count(outcome.status)
        if self.bar is not None:
            if outcome.status == FAILED:
                self.line(f"job {index + 1}/{n_jobs} {_name(outcome)} failed: {outcome.error}")
        else:
            tail = f": {outcome.error}" if outcome.status == FAILED else ""
            self.line(f"job {index + 1}/{n_jobs} {_name(outcome)} {outcome.status} in {outcome.seconds:.1f} s "
                      f"(rendered because: {reason}){tail}; left {self.total - self.done - self.failed}")

    def skipped_late(self, index: int, n_jobs: int, outcome: JobOutcome) -> None:
        self._count(SKIPPED)
        self.line(f"job {index + 1}/{n_jobs} {_name(outcome)}: rendered meanwhile by another process; skipped")

    def close(self, strays: bool = False) -> None:
        """Close the queue bar; with ``strays`` (an interrupt) also any bar a renderer left open (its step bar
        stopped mid-job), so that no bar is redrawn below the final message."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            if strays:
                from tqdm import tqdm

                for bar in list(getattr(tqdm, "_instances", ())):
                    bar.close()
