"""The batch queue's report and progress: job statuses, `BatchReport` (``batch-report.json``) and the queue's
log (a tqdm bar or one line per job). `h3render.batch` drives them; the report's fields are documented in
docs/slurm.md ("The report").

The report is written whole twice: at the start (every job, ``running``) and at the end (the final state). In
between each job's outcome is appended as one JSON line to its journal, ``<report>.jobs.jsonl`` (named by the
report's ``journal`` field), and fsynced, so a crash at any point leaves a readable report plus a journal whose
lines, folded in order (`read_report`), give the state at the crash; the final report is complete and the journal
is removed. A report left by an earlier queue on the same name is kept, moved to a dated name under the report's
lock (`keep_earlier_report`). Rewriting the whole report after every job cost O(jobs) per job (issue #28 item 8).
Measured on CPU
(2 cores, ext4) with the test suite's fake renderer over the first 300 jobs of a 10,000-job queue: 120 ms of report
writing per job before (the 1.4 MB report rewritten and fsynced), 4.6 ms per job with the journal (an fsynced line).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from h3render import locks
from h3render.exits import EXIT_FAILED, EXIT_OK, REQUEUE_SIGNALS, signal_exit_code
from h3render.signals import signal_name

SUCCEEDED = "succeeded"
FAILED = "failed"
SKIPPED = "skipped"
PENDING = "pending"
INTERRUPTED = "interrupted"
ELSEWHERE = "elsewhere"  # locked by another live process when this queue reached it
STATUSES = (SUCCEEDED, FAILED, SKIPPED, PENDING, INTERRUPTED, ELSEWHERE)

REPORT_FORMAT = 5  # bump when a consumer-visible field of batch-report.json changes (5: the journal, "killed")
JOURNAL_SUFFIX = ".jobs.jsonl"  # <report>.jobs.jsonl: one line per job outcome while the queue runs
KILLED = "killed"  # a report whose process died without a final state, as marked by a later queue


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
    _unjournaled: list = field(default_factory=list, repr=False, compare=False)  # job indices not yet appended
    _written: bool = field(default=False, repr=False, compare=False)  # the start's whole write is on disk

    @property
    def journal(self) -> Path:
        return journal_path(self.path)

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
            "journal": None if done else self.journal.name,
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
        """The whole report, atomically (temp file in the same folder, fsync, rename), with an empty journal behind
        it: the first write of a queue (the last is `write_final`). Thread-safe. A failed write (a full disk) is
        recorded in ``write_error`` and returns False."""
        with self._write_lock:
            try:
                remove_files(self.journal)  # a dead queue's lines describe another run of these jobs
                _write_json_atomic(self.path, self.to_dict())
            except OSError as exc:
                self.write_error = f"{self.path}: {exc.strerror or exc}"
                return False
            self.write_error = None
            self._unjournaled.clear()
            self._written = True
            return True

    def record(self, index: int) -> bool:
        """Append job `index`'s outcome (and the queue's times) to the journal and fsync it: O(1) per job. A failed
        append (a full disk) is kept and tried again with the next one, so no line is lost; returns False then.
        Until the start's whole write succeeded it is tried instead: lines must never follow another run's report."""
        if not self._written:
            return self.write()
        with self._write_lock:
            if index not in self._unjournaled:
                self._unjournaled.append(index)
            lines = "".join(json.dumps({"index": i, "job": self.jobs[i].to_dict(), "updated_at": _now(),
                                        "load_seconds": _round(self.load_seconds),
                                        "queue_seconds": _round(self.queue_seconds)}) + "\n"
                            for i in self._unjournaled)
            try:
                _append(self.journal, lines.encode())
            except OSError as exc:
                self.write_error = f"{self.journal}: {exc.strerror or exc}"
                return False
            self.write_error = None
            self._unjournaled.clear()
            return True

    def write_final(self) -> bool:
        """The last write: the complete report, atomic if possible; else the exit code becomes 1 and the report is
        rewritten in place (its old blocks need no new space on a full disk); if even that fails it is removed, so
        that no file is left claiming the queue still runs. The journal goes once the final report stands (it is
        folded in). Returns whether the final report is on disk."""
        with self._write_lock:
            written = self._write_final()
            remove_files(self.journal)
            return written

    def _write_final(self) -> bool:
        try:
            _write_json_atomic(self.path, self.to_dict())
            self.write_error = None
            return True
        except OSError as exc:
            self.write_error = f"{self.path}: {exc.strerror or exc}"
        self.final_write_failed = True
        try:
            _write_in_place(self.path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())
            return True
        except OSError:
            remove_files(self.path)
            return False


def journal_path(report: Path) -> Path:
    return report.with_name(report.name + JOURNAL_SUFFIX)


def read_report(path: str | os.PathLike) -> dict[str, Any]:
    """A report as it stands: the file, with its journal's lines folded in while the queue runs (or after it was
    killed). A torn last line (a crash mid-append) is ignored: its job keeps its previous state.

    Raises:
        OSError, ValueError: the report file cannot be read or is not JSON.
    """
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not data.get("journal"):
        return data
    try:
        lines = (path.parent / data["journal"]).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return data
    for line in lines:
        try:
            entry = json.loads(line)
            data["jobs"][entry["index"]] = entry["job"]
        except (ValueError, KeyError, IndexError, TypeError):
            continue  # only the last line can be torn (appends are in order)
        for key in ("updated_at", "load_seconds", "queue_seconds"):
            data[key] = entry[key]
    data["counts"] = {s: sum(1 for j in data["jobs"] if j["status"] == s) for s in STATUSES}
    return data


def mark_dead_reports(out_dir: Path, own: Path) -> list[str]:
    """Reports of dead queues in `out_dir` (state ``running``, their lock free: the kernel dropped it when the
    process died, SIGKILL included) get their journal folded in and state ``killed``, so no stale report says
    ``running`` forever. Returns their names. Best effort: a report that cannot be read or locked is left as is."""
    marked = []
    for path in sorted(out_dir.glob("batch-report*.json")):
        if path == own or path.is_symlink() or _KEPT.search(path.name):
            continue  # a kept report is final (`keep_earlier_report`): not read, however many a requeued task left
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("state") != "running":
                continue
            lock = locks.FileLock.try_acquire(path.with_name(path.name + ".lock"))
        except (OSError, ValueError):
            continue
        if lock is None:
            continue  # its process is alive
        try:
            if _mark_killed(path):
                marked.append(path.name)
        finally:
            lock.release()
    return marked


def _mark_killed(path: Path) -> bool:
    """A dead queue's report (the caller holds its lock): its journal folded in, state ``killed``. False when it
    cannot be read or written."""
    try:
        data = read_report(path)
        data.update(state=KILLED, journal=None)
        _write_json_atomic(path, data)
        remove_files(journal_path(path))
        return True
    except (OSError, ValueError):
        return False


# The names `keep_earlier_report` gives: ``<stem>.<YYYYmmddTHHMMSSZ>[-n].json``.
_KEPT = re.compile(r"\.\d{8}T\d{6}Z(-\d+)?\.json$")


def keep_earlier_report(path: Path) -> str | None:
    """An earlier queue's report at `path` moves aside to a dated name, ``<stem>.<started_at>.json`` (e.g.
    ``batch-report.20261130T060211Z.json``: when that queue started, UTC), so a later batch on the same out dir
    never replaces it. The caller holds `path`'s lock, so that queue has ended; a report it left ``running`` (killed)
    has its journal folded in and is marked ``killed`` first. Never overwrites: a taken name gets ``-2``, ``-3``...
    Returns the new name, or None (nothing there, a symlink or other non-file, or it could not be moved: then it is
    replaced as before, and the log says so through the caller).

    Raises:
        OSError: the report could not be moved (a read-only folder).
    """
    if path.is_symlink() or not path.is_file():
        return None  # a planted link is never followed; the report's atomic write replaces the link itself
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        started = datetime.fromisoformat(data["started_at"]).astimezone(timezone.utc)
        state = data.get("state")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        started, state = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc), None
    if state == "running":
        _mark_killed(path)
    stem = path.name.removesuffix(".json") + "." + started.strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 1000):
        target = path.with_name(f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            os.link(path, target)  # fails on a taken name (a rename would replace it)
        except FileExistsError:
            continue
        except OSError:  # a filesystem without hard links: only this report's lock holder makes these names
            if os.path.lexists(target):
                continue
            os.rename(path, target)
            return target.name
        os.unlink(path)
        return target.name
    return None


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _append(path: Path, data: bytes) -> None:
    """Append and fsync; never through a symlink planted at the journal's name."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


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
    taken, an earlier queue's report was kept under a dated name (`keep_earlier_report`), or the filesystem has no
    locks) and whether locks work here.

    Raises:
        OSError: the out dir takes no file (read-only, full).
    """
    main = out_dir / report_name(shard)
    try:
        lock = locks.FileLock.try_acquire(main.with_name(main.name + ".lock"))
    except locks.LockUnsupported as exc:
        # Without locks a report there may be a live queue's: it is replaced, as before the reports were kept.
        return main, None, f"{exc.strerror}; running without locks: two queues on this out dir would clash", False
    if lock is not None:
        return main, lock, _keep_earlier(main, lock), True
    who = locks.holder(main.with_name(main.name + ".lock"))
    own = out_dir / report_name(shard, owner=f"{socket.gethostname()}-{os.getpid()}")
    # Held while this queue runs, like the main report's: a later queue that finds it free knows this one died.
    own_lock = locks.FileLock.try_acquire(own.with_name(own.name + ".lock"))
    note = f"{main.name} belongs to another queue ({who}); this queue's report is {own.name}"
    kept = _keep_earlier(own, own_lock)  # a dead process with this pid, on this host, long ago
    return own, own_lock, note if kept is None else f"{note}; {kept}", True


def _keep_earlier(path: Path, lock: "locks.FileLock | None") -> str | None:
    """`keep_earlier_report` under the report's lock, as the log's note."""
    if lock is None:
        return None
    try:
        kept = keep_earlier_report(path)
    except OSError as exc:
        return f"could not keep the earlier {path.name} ({exc.strerror or exc}); this queue replaces it"
    return None if kept is None else f"the earlier {path.name} is kept as {kept}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _name(outcome: JobOutcome) -> str:
    return outcome.output if outcome.id is None else f"{outcome.id} ({outcome.output})"


def stop_lines(report: BatchReport, where: str, resume: str | None, *, overwrite: bool = False) -> list[str]:
    """The queue's last lines after a signal: which job it stopped (its partial files removed), what finished and
    what did not start, the exit code and report (`where`), and the command that resumes (`resume`; None: "the
    same command"). A trial found one terse line ("interrupted (SIGINT); exit 130; report ...")."""
    how = "stopped for a requeue" if report.signum in REQUEUE_SIGNALS else "interrupted"
    n, c = len(report.jobs), report.counts
    stopped = [f"job {i + 1}/{n} {_name(j)}" for i, j in enumerate(report.jobs) if j.status == INTERRUPTED]
    during = f" during {', '.join(stopped)}; its partial files were removed" if stopped else " between jobs"
    counts = f"{c[SUCCEEDED]} succeeded, {c[FAILED]} failed, {c[SKIPPED]} skipped (already rendered)" + (
        f", {c[ELSEWHERE]} in progress elsewhere" if c[ELSEWHERE] else "") + f", {c[PENDING]} not started"
    command = resume or "the same h3render batch command"
    if overwrite:  # --overwrite again would render the finished jobs again
        again = (f"to resume: {command} (without --overwrite: the jobs finished now are skipped, and so are those "
                 f"not reached whose earlier outputs are current; with it every job renders again)")
    else:
        again = f"to resume (jobs already rendered are skipped): {command}"
    return [f"{how} ({signal_name(report.signum)}){during}", f"{counts}; exit {report.exit_code}; {where}", again]


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
            why = "ran because" if outcome.status == FAILED else "rendered because"  # a failed job rendered nothing
            self.line(f"job {index + 1}/{n_jobs} {_name(outcome)} {outcome.status} in {outcome.seconds:.1f} s "
                      f"({why}: {reason}){tail}; left {self.total - self.done - self.failed}")

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
