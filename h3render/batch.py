"""The batch queue: render a list of jobs with one resident model, job by job, resumable and interruptible.

`run_batch` walks the jobs in order. A job whose MP4 and JSON sidecar already exist, and whose sidecar's
``"job"`` equals ``job.params()``, is skipped (resume); every other job is rendered by one renderer, built lazily by
``renderer_factory()`` the first time a job needs it, so the model loads once per queue and not at all when
everything is already rendered. A job that raises is recorded as failed and the queue goes on (``fail_fast`` stops
it); SIGINT or SIGTERM stops it cleanly. ``<out_dir>/batch-report.json`` is rewritten atomically after every job,
so even a queue killed with SIGKILL leaves a report of what finished.

Exit codes (``BatchReport.exit_code``; the CLI exits with it):

====  =====================================================================================================
0     every job succeeded or was skipped as already rendered (an empty shard too)
1     at least one job failed; the others still ran (or, with ``fail_fast``, the rest stayed pending)
2     bad input or usage, found before anything loads: manifest errors, bad ``--shard``. The CLI returns it;
      ``run_batch`` is never reached. ``run_batch`` itself raises ``ValueError`` for two jobs sharing an output.
130   interrupted by SIGINT (Ctrl-C) or SIGTERM (``scancel``, a SLURM time limit): 128 + SIGINT, the shell's code
====  =====================================================================================================

File names, for a job with ``output = "clips/a"``: final ``<out_dir>/clips/a.mp4`` and ``clips/a.json``; the
renderer writes them through ``clips/a.tmp.mp4`` and ``clips/a.json.tmp`` (or ``clips/a.tmp.json``) and renames.
Whatever way a job ends other than success, those temp names are swept and any final-named file written during
the attempt is removed, so nothing partial ever sits under a final name.

The renderer contract (``h3render.engine.Engine``): ``render_async(job, mp4_path, sidecar_path) -> Future``, which
returns once the last frame is in the MP4 writer and whose Future resolves when the MP4 and then the sidecar (which
holds ``"job": job.params()``) are in place, both atomically; a renderer with only ``render(...) -> dict`` works too.
While job N's writer tail (encoder flush, trailer, fsync, rename, sidecar) finishes on the writer's thread, job N+1's
prompt encode and denoise already run; job N's outcome is recorded when its tail ends. Jobs need ``id``,
``output`` and ``params()`` (``h3render.jobs.Job``).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

SUCCEEDED = "succeeded"
FAILED = "failed"
SKIPPED = "skipped"
PENDING = "pending"
INTERRUPTED = "interrupted"
STATUSES = (SUCCEEDED, FAILED, SKIPPED, PENDING, INTERRUPTED)

REPORT_FORMAT = 3  # bump when a consumer-visible field of batch-report.json changes (3: no overlap fields)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM arrives, so it unwinds exactly like Ctrl-C (KeyboardInterrupt)."""


@dataclass
class JobOutcome:
    """One job's line in the report. ``output`` is the MP4 path relative to the out dir; ``seconds`` is wall time
    of this job's render up to its sidecar (the one-off model load is ``BatchReport.load_seconds``), None when it
    did not run; the last fraction of a second of it (the writer tail) ran beside the next job's start."""

    id: str | None
    output: str
    status: str = PENDING
    seconds: float | None = None
    error: str | None = None  # "ExceptionType: message" for failed / interrupted jobs
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
    finished: bool = False
    load_seconds: float | None = None
    queue_seconds: float | None = None  # wall time from the first render to the latest job outcome (load excluded)
    started_at: str = field(default_factory=lambda: _now())
    _write_lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, status: str) -> int:
        return sum(1 for j in self.jobs if j.status == status)

    @property
    def counts(self) -> dict[str, int]:
        return {s: self.count(s) for s in STATUSES}

    @property
    def exit_code(self) -> int:
        """130 if interrupted, else 1 if any job failed, else 0 (see the module docstring)."""
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if self.count(FAILED) else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        state = "interrupted" if self.interrupted else ("finished" if self.finished else "running")
        return {
            "format": REPORT_FORMAT,
            "state": state,
            "exit_code": self.exit_code if (self.finished or self.interrupted) else None,
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

    def write(self) -> None:
        """Atomically (temp file in the same folder, fsync, rename) replace the report file. Thread-safe (a job's
        outcome is recorded on its MP4 writer's thread when the tail ends)."""
        with self._write_lock:
            _write_json_atomic(self.path, self.to_dict())


def report_name(shard: tuple[int, int] | None = None) -> str:
    """``batch-report.json``, or ``batch-report.shard-<i>-of-<n>.json`` (i 0-based) so array tasks writing into one
    out dir do not overwrite each other's report."""
    if shard is None:
        return "batch-report.json"
    index, count = shard
    return f"batch-report.shard-{index}-of-{count}.json"


def output_paths(out_dir: Path, job) -> tuple[Path, Path]:
    """Final ``(mp4, sidecar)`` paths of a job: ``<out_dir>/<job.output>.mp4`` and ``.json``."""
    base = Path(out_dir) / job.output
    return base.with_name(base.name + ".mp4"), base.with_name(base.name + ".json")


def temp_paths(mp4: Path, sidecar: Path) -> tuple[Path, ...]:
    """The temp names a job's final files pass through: ``<name>.tmp.mp4`` (media.Mp4Writer), and for the
    sidecar both ``<name>.json.tmp`` (timing.write_sidecar) and ``<name>.tmp.json``."""
    return (mp4.with_name(mp4.stem + ".tmp.mp4"), sidecar.with_name(sidecar.name + ".tmp"),
            sidecar.with_name(sidecar.stem + ".tmp.json"))


def render_reason(job, mp4: Path, sidecar: Path, *, overwrite: bool = False) -> str | None:
    """Why the job must be rendered ("overwrite", "no MP4", "no sidecar", "sidecar unreadable", "parameters
    changed"), or None when its outputs are complete and were rendered with ``job.params()`` (skip it)."""
    if overwrite:
        return "overwrite"
    if not mp4.is_file():
        return "no MP4"
    if not sidecar.is_file():
        return "no sidecar"
    try:
        recorded = json.loads(sidecar.read_text(encoding="utf-8"))["job"]
    except (OSError, ValueError, KeyError, TypeError):
        return "sidecar unreadable"
    # Round-trip through JSON so tuples compare equal to the lists the sidecar holds.
    if recorded != json.loads(json.dumps(job.params())):
        return "parameters changed"
    return None


def run_batch(
    jobs: Sequence,
    renderer_factory: Callable[[], Any],
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    fail_fast: bool = False,
    quiet: bool = False,
    progress: bool | None = None,
    shard: tuple[int, int] | None = None,
) -> BatchReport:
    """Render ``jobs`` in order into ``out_dir`` and return the report (its ``exit_code`` is the process's).

    Args:
        jobs: ``h3render.jobs.Job`` objects (already sharded); each needs ``id``, ``output`` (relative path
            without extension) and ``params()``.
        renderer_factory: zero-argument callable returning an object with ``render_async(job, mp4_path,
            sidecar_path) -> Future`` or ``render(job, mp4_path, sidecar_path)``. Called at most once, just before the
            first job that needs rendering; never when all are skipped.
        out_dir: folder for the MP4s, sidecars and the report; created if missing.
        overwrite: render every job even when its outputs are complete and current (default: resume, skip those).
        fail_fast: stop after the first failed job; later jobs stay ``pending`` (a job already started when an
            earlier job's writer tail failed still runs to its end).
        quiet: no progress bars; one line per job on stderr.
        progress: draw the tqdm queue bar at position 0 (the renderer's step bar takes position 1). None (the
            default): only when stderr is a terminal. Without the bar (False, a SLURM log, ``quiet``) the queue
            logs one line per job instead.
        shard: ``(index, count)`` of this array task, 0-based; only names the report file and is recorded in it.
    Returns:
        The final ``BatchReport``; ``<out_dir>/batch-report[.shard-i-of-n].json`` holds the same.

    Raises:
        ValueError: two jobs share an output path (usage error; nothing was rendered).

    SIGINT and SIGTERM do not propagate: the running job is cleaned up, its status becomes ``interrupted``, the
    report is written and ``exit_code`` is 130. The handlers are only installed when called from the main thread.

    """
    out_dir = Path(out_dir)
    targets = [output_paths(out_dir, job) for job in jobs]
    seen: dict[Path, int] = {}
    for i, (mp4, _) in enumerate(targets):
        if mp4 in seen:
            raise ValueError(f"jobs {seen[mp4] + 1} and {i + 1} both write {mp4}; give each job its own output")
        seen[mp4] = i
    out_dir.mkdir(parents=True, exist_ok=True)

    report = BatchReport(
        path=out_dir / report_name(shard),
        jobs=[JobOutcome(id=job.id, output=mp4.relative_to(out_dir).as_posix())
              for job, (mp4, _) in zip(jobs, targets)],
        shard=shard,
    )
    reasons = [render_reason(job, mp4, side, overwrite=overwrite) for job, (mp4, side) in zip(jobs, targets)]
    for outcome, reason in zip(report.jobs, reasons):
        if reason is None:
            outcome.status = SKIPPED
    to_render = sum(r is not None for r in reasons)
    if progress is None:
        progress = sys.stderr.isatty()
    log = _QueueLog(total=to_render, bar=progress and not quiet)
    log.line(f"{len(jobs)} jobs: {len(jobs) - to_render} already rendered (skipped), {to_render} to render"
             + ("" if shard is None else f" [shard {shard[0]} of {shard[1]}]"))
    report.write()

    queue = _Queue(jobs, targets, reasons, report, renderer_factory, log, fail_fast=fail_fast)
    with _InterruptGuard() as guard:
        try:
            queue.run(guard)
        except KeyboardInterrupt as exc:
            guard.acknowledge()
            report.interrupted = True
            queue.interrupted(exc)
            log.line(f"interrupted ({exc if isinstance(exc, Interrupted) else 'KeyboardInterrupt'}); "
                     f"report written")
            queue.write()
            log.close()
            _release_memory()
            return report

    report.finished = True
    queue.write()
    log.close()
    counts = report.counts
    log.line(f"done: {counts[SUCCEEDED]} succeeded, {counts[FAILED]} failed, {counts[SKIPPED]} skipped, "
             f"{counts[PENDING]} pending; report {report.path}")
    return report


class _Queue:
    """The loop of ``run_batch``: one job after another, each job's writer tail beside the next job's start."""

    def __init__(self, jobs, targets, reasons, report: BatchReport, factory, log: "_QueueLog", *, fail_fast: bool):
        self.jobs, self.targets, self.reasons, self.report = jobs, targets, reasons, report
        self.factory, self.log, self.fail_fast = factory, log, fail_fast
        self.order = [i for i, r in enumerate(reasons) if r is not None]
        self.renderer = None
        self.current: int | None = None  # the job the main thread renders
        self.attempt: _Attempt | None = None
        self.tails: list[tuple[int, Future]] = []  # jobs whose writer tail may still run (one at a time)
        self.lock = threading.RLock()  # job outcomes, the log and the report (tails end on writer threads)
        self.t_queue: float | None = None

    def write(self) -> None:
        with self.lock:
            if self.t_queue is not None:
                self.report.queue_seconds = time.perf_counter() - self.t_queue
            self.report.write()

    def _job_done(self, i: int) -> None:
        with self.lock:
            self.log.job_done(i, len(self.jobs), self.report.jobs[i], self.reasons[i])
            self.write()

    def _stop_for_failure(self) -> bool:
        if self.fail_fast and self.report.count(FAILED):
            self.log.line("stopping after the first failure (--fail-fast)")
            return True
        return False

    def run(self, guard: "_InterruptGuard") -> None:
        for i in self.order:
            guard.check()
            if self._stop_for_failure():  # an earlier job's tail failed meanwhile
                break
            if self.renderer is None:
                self.current = i
                if not self._load():
                    return
            self._render(i)
        self.wait_tails()

    def _load(self) -> bool:
        t0 = time.perf_counter()
        try:
            self.renderer = self.factory()
        except Exception as exc:
            _fail_all(self.report, self.reasons, f"renderer could not be created: {_describe(exc)}",
                      traceback.format_exc())
            self.log.line(f"renderer could not be created: {_describe(exc)}")
            return False
        self.report.load_seconds = time.perf_counter() - t0
        self.t_queue = time.perf_counter()
        return True

    def _render(self, i: int) -> None:
        """Job i up to its writer tail; the tail's end records the outcome (`_tail_done`)."""
        job, (mp4, sidecar) = self.jobs[i], self.targets[i]
        outcome = self.report.jobs[i]
        self.current = i
        self.attempt = attempt = _Attempt(job, mp4, sidecar, outcome)
        t0 = time.perf_counter()
        failure = future = None
        try:
            if callable(getattr(self.renderer, "render_async", None)):
                future = self.renderer.render_async(job, mp4, sidecar)
            else:
                future = Future()
                future.set_result(self.renderer.render(job, mp4, sidecar))
        except Exception as exc:
            failure = _Failure.of(exc)  # text only: the exception and its frames go when this block ends
        except BaseException:  # an interrupt: `interrupted` marks the job
            outcome.seconds = time.perf_counter() - t0
            attempt.cleanup()
            raise
        self.current = self.attempt = None
        if failure is not None:
            attempt.fail(failure)
            outcome.seconds = time.perf_counter() - t0
            _release_memory()  # the cycles a failed job's traceback left hold its tensors
            self._job_done(i)
            return
        self.tails.append((i, future))
        future.add_done_callback(lambda f: self._tail_done(i, attempt, f, t0))

    def _tail_done(self, i: int, attempt: "_Attempt", future: Future, t0: float) -> None:
        """Job i's MP4 and sidecar are in place (or its tail failed): record it. Runs on the writer's thread."""
        with self.lock:
            outcome = attempt.outcome
            outcome.seconds = time.perf_counter() - t0
            try:
                future.result()
                attempt.check_written()
            except BaseException as exc:
                attempt.fail(_Failure.of(exc))
            else:
                outcome.status = SUCCEEDED
            self._job_done(i)

    def wait_tails(self) -> None:
        """Wait for every writer tail still running, in short slices so a signal handler can run meanwhile."""
        for _, future in self.tails:
            while not future.done():
                try:
                    future.exception(timeout=0.1)
                except FutureTimeout:
                    pass
        self.tails.clear()

    def interrupted(self, exc: BaseException) -> None:
        """After an interrupt reached the main thread: let a running tail end (its job is then done, or failed),
        and mark the job being rendered interrupted, with its files removed."""
        self.wait_tails()
        if self.current is not None and self.report.jobs[self.current].status == PENDING:
            outcome = self.report.jobs[self.current]
            outcome.status, outcome.error = INTERRUPTED, _describe(exc)
            if self.attempt is not None:
                self.attempt.cleanup()


@dataclass
class _Failure:
    """How a phase failed, as text only: the exception (and through its traceback the job's tensors) is dropped,
    so that memory can be given back."""

    error: str
    traceback: str | None

    @classmethod
    def of(cls, exc: BaseException) -> "_Failure":
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(_describe(exc), tb)


class _Attempt:
    """One job's render attempt: the files it may touch and the seconds it spent. Every end other than success
    removes the job's temp files and any final-named file written during the attempt."""

    def __init__(self, job, mp4: Path, sidecar: Path, outcome: JobOutcome):
        mp4.parent.mkdir(parents=True, exist_ok=True)
        self.job, self.mp4, self.sidecar, self.outcome = job, mp4, sidecar, outcome
        self.temps = temp_paths(mp4, sidecar)
        remove_files(*self.temps)  # left by an earlier queue killed with SIGKILL
        self.before = {p: _identity(p) for p in (mp4, sidecar)}

    def check_written(self) -> None:
        if not (self.mp4.is_file() and self.sidecar.is_file()):
            raise RuntimeError(f"renderer returned without writing {self.mp4.name} and {self.sidecar.name}")

    def cleanup(self) -> None:
        remove_files(*self.temps)
        remove_files(*(p for p in (self.mp4, self.sidecar) if _identity(p) not in (None, self.before[p])))

    def fail(self, failure: _Failure, status: str = FAILED) -> None:
        self.outcome.status, self.outcome.error = status, failure.error
        if status == FAILED:
            self.outcome.traceback = failure.traceback
        self.cleanup()


def _fail_all(report: BatchReport, reasons: list, error: str, tb: str) -> None:
    for outcome, reason in zip(report.jobs, reasons):
        if reason is not None and outcome.status == PENDING:
            outcome.status, outcome.error, outcome.traceback = FAILED, error, tb


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size), which changes when a file is replaced or rewritten; None if absent."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def remove_files(*paths: Path) -> None:
    """Delete each path that exists (temp files of a failed or interrupted job)."""
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _release_memory() -> None:
    """Collect cycles (a failed job's traceback frames hold its tensors) and return cached CUDA blocks."""
    gc.collect()
    torch = sys.modules.get("torch")  # never import torch just for this: no torch loaded means no device memory
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_files(tmp)
        raise


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class _InterruptGuard:
    """While the queue runs, SIGTERM (``scancel``, a SLURM time limit) and SIGINT raise ``Interrupted`` in the main
    thread, so both unwind like Ctrl-C through the renderer's own cleanup.

    Python drops an exception raised while a ``__del__`` or a weakref callback runs and hands it to
    ``sys.unraisablehook`` (seen under SLURM: the SIGTERM landed in ``regex``'s ``Group.__del__`` during a garbage
    collection, and the queue went on rendering). The guard's hook marks the signal lost and a helper thread sends
    it again a moment later, when the main thread is out of the ``__del__``; the loop also checks for it between
    jobs. Handlers are only installed from the main thread (Python allows no other); an ignored SIGINT (a
    background job) stays ignored.
    """

    RESEND_DELAY_S = 0.05

    def __init__(self):
        self.received: int | None = None
        self._lost = threading.Event()
        self._acknowledged = threading.Event()
        self._lock = threading.Lock()  # no re-send once acknowledged (the default SIGTERM action would kill us)
        self._previous: dict[int, Any] = {}
        self._previous_hook = None

    def __enter__(self) -> "_InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            self._acknowledged.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            threading.Thread(target=self._resend_lost, name="h3render-resend-signal", daemon=True).start()
        raise Interrupted(f"{signal.Signals(signum).name} received")

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, Interrupted):
            self._lost.set()  # not re-sent from here: the handler would run inside this hook and be dropped too
            return
        self._previous_hook(unraisable)

    def _resend_lost(self) -> None:
        while not self._acknowledged.is_set():
            if self._lost.wait(0.5) and not self._acknowledged.wait(self.RESEND_DELAY_S):
                with self._lock:
                    if not self._acknowledged.is_set():
                        self._lost.clear()
                        print(f"h3render batch: {signal.Signals(self.received).name} was dropped inside a __del__; "
                              f"sending it again", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), self.received)

    def check(self) -> None:
        """Raise ``Interrupted`` if a signal arrived whose exception got lost on the way."""
        if self.received is not None:
            raise Interrupted(f"{signal.Signals(self.received).name} received")

    def acknowledge(self) -> None:
        """The queue has the interrupt: ignore further signals while it writes the report and returns
        (milliseconds; leaving the guard restores the previous handlers)."""
        with self._lock:
            self._acknowledged.set()
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)


class _QueueLog:
    """The queue's progress: a tqdm bar (done / failed / left, ETA) or, without it, one stderr line per job."""

    def __init__(self, total: int, bar: bool):
        self.total, self.done, self.failed = total, 0, 0
        self.bar = None
        if bar and total:
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

    def job_done(self, index: int, n_jobs: int, outcome: JobOutcome, reason: str) -> None:
        if outcome.status == SUCCEEDED:
            self.done += 1
        else:
            self.failed += 1
        name = outcome.output if outcome.id is None else f"{outcome.id} ({outcome.output})"
        if self.bar is not None:
            self.bar.update(1)
            self._postfix()
            if outcome.status == FAILED:
                self.line(f"job {index + 1}/{n_jobs} {name} failed: {outcome.error}")
        else:
            tail = f": {outcome.error}" if outcome.status == FAILED else ""
            self.line(f"job {index + 1}/{n_jobs} {name} {outcome.status} in {outcome.seconds:.1f} s "
                      f"(rendered because: {reason}){tail}; left {self.total - self.done - self.failed}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
