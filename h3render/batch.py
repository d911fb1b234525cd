"""The batch queue: render a list of jobs with one resident model, job by job, resumable, interruptible, and safe
beside another queue on the same out dir.

`run_batch` walks the jobs in order. A job whose MP4 and JSON sidecar exist, whose sidecar's ``"job"`` equals
``job.params()`` and whose ``"mp4"`` record (size, sha256) matches the MP4 on disk, is skipped (resume); every
other job is rendered by one renderer, built lazily by ``renderer_factory()`` the first time a job needs it. A job
that raises (its folder set-up included) is recorded as failed and the queue goes on (``fail_fast`` stops it);
the signals of `h3render.signals` stop it cleanly. ``<out_dir>/batch-report.json`` is written at the start, each
job's outcome is appended to its journal (`h3render.report`), and a final state is written on every exit path
Python sees (a SIGKILL leaves ``running``, with the pid, until a later queue marks it ``killed``).

Two queues on one out dir (a requeued SLURM task beside its old copy, an array submitted twice): a job is rendered
while holding its OS lock ``<name>.lock`` (`h3render.locks`); a job locked by a live process is recorded as
``elsewhere`` ("in progress elsewhere"); at the end of the queue its holder is waited for (`_Queue.elsewhere_wait`)
and the job tried once more (finished by the holder: ``skipped``, success here too), else left to its holder;
a dead holder's lock is free again, so a later run picks the job up. Every temp name of a job is written only
under that lock, so the stale-temp sweep (under the lock, also for skipped jobs) removes only what a dead process
left. The report belongs to one process: the first queue holds ``batch-report.json.lock``; a second queue on the
same report name writes ``batch-report.<host>-<pid>.json`` instead, so each report says what its process did; a
report an earlier (ended) queue left is kept under its start time (`report.keep_earlier_report`), never replaced.

Exit codes (``BatchReport.exit_code``; the CLI exits with it):

====  =====================================================================================================
0     every job succeeded or was skipped as already rendered (an empty shard too; a job finished elsewhere too)
1     a job failed, a job was left ``elsewhere`` (another live process still held it), or the final report
      could not be written (the log names the file); the other jobs still ran
2     bad input or usage, found before anything renders: manifest errors, bad ``--shard``, two jobs sharing an
      output, an ``--out-dir`` that is a file, under a file, or a broken or looping symlink (`BatchUsageError`)
75    stopped by SIGUSR1/SIGUSR2 (SLURM's warning before the time limit): requeue and resume
130   interrupted by SIGINT, SIGTERM or SIGHUP
====  =====================================================================================================

File names, for a job with ``output = "clips/a"``: final ``<out_dir>/clips/a.mp4`` and ``clips/a.json``, lock
``clips/a.lock`` (removed when released); the renderer writes through ``clips/a.tmp.mp4`` and ``clips/a.json.tmp``
(or ``clips/a.tmp.json``) and renames, MP4 first. Whatever way a job ends other than success, its temp names are
swept and any final-named file written during the attempt is removed. The commit order makes every crash point
resumable: before the MP4 rename the old pair stands; between the renames the new MP4 no longer matches the old
sidecar's record (or there is no sidecar), so resume renders it again; after the sidecar rename the pair matches.

The renderer contract (``h3render.engine.Engine``): ``render_async(job, mp4_path, sidecar_path) -> Future`` resolving
once the MP4 and then the sidecar are in place (or ``render(...) -> dict``). Jobs need ``id``, ``output``, ``params()``.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from h3render import locks
from h3render.report import (ELSEWHERE, FAILED, INTERRUPTED, PENDING, SKIPPED, SUCCEEDED, BatchReport, JobOutcome,
                             QueueLog, _name, claim_report, mark_dead_reports, remove_files, stop_lines)
from h3render.sidecar import SidecarUnreadable, read_sidecar, rendered_with
from h3render.signals import InterruptGuard, settle, signum_of
from h3render.outputs import (BatchUsageError, JobPathError, lock_path, make_folders, output_paths, path_problem,
                              prepare_out_dir, remove_empty_folders, render_reason, temp_paths)


ELSEWHERE_WAIT_MIN_S = 60.0  # the least the end of the queue waits for a job held by another live process
ELSEWHERE_POLL_S = 0.2


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
    render_order: Sequence[int] | None = None,
    current: dict[str, Any] | None = None,
    elsewhere_wait_s: float | None = None,
    resume: str | None = None,
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
        fail_fast: stop after the first failed job; later jobs stay ``pending``.
        quiet: no progress bars; one line per job on stderr.
        progress: draw the tqdm queue bar at position 0 (the renderer's step bar takes position 1). None (the
            default): only when stderr is a terminal.
        shard: ``(index, count)`` of this array task, 0-based; only names the report file and is recorded in it.
        render_order: the order to render in (indices into ``jobs``; a mixed queue renders its t2va jobs before
            the FastH3 student is fused); the report keeps ``jobs``' order. Default: ``jobs``' order.
        current: this run's ``{"checkpoint": ..., "encoder": ...}`` (`sidecar.rendered_with`): a skipped job
            rendered with another checkpoint or encoder setting says so in its log line.
        elsewhere_wait_s: how long the end of the queue waits for another live process to release the jobs it
            holds (default: `_Queue.elsewhere_wait`). A job it finished meanwhile is ``skipped``: success here too.
        resume: the command that resumes this queue, for the last lines after a signal (None: "the same command").
    Returns:
        The final ``BatchReport``; ``report.path`` holds the same.

    Raises:
        BatchUsageError: two jobs share an output path, or the out dir cannot be a folder (nothing was rendered).

    Signals do not propagate (`h3render.signals`): the running job is cleaned up, its status becomes
    ``interrupted``, the report is written and ``exit_code`` is 130 (75 for SIGUSR1/SIGUSR2). Handlers are only
    installed when called from the main thread. An internal error is recorded (state ``crashed``) and re-raised.
    """
    out_dir = Path(out_dir)
    targets = [output_paths(out_dir, job) for job in jobs]
    seen: dict[Path, int] = {}
    for i, (mp4, _) in enumerate(targets):
        if mp4 in seen:
            raise BatchUsageError(f"jobs {seen[mp4] + 1} and {i + 1} both write {mp4}; give each job its own output")
        seen[mp4] = i
    prepare_out_dir(out_dir)
    try:
        report_path, report_lock, note, locking = claim_report(out_dir, shard)
    except OSError as exc:
        raise BatchUsageError(f"--out-dir {out_dir}: cannot write there: {exc.strerror or exc}") from None
    report = BatchReport(path=report_path, shard=shard,
                         jobs=[JobOutcome(id=job.id, output=mp4.relative_to(out_dir).as_posix())
                               for job, (mp4, _) in zip(jobs, targets)])
    if progress is None:
        progress = sys.stderr.isatty()
    queue = _Queue(jobs, targets, report, renderer_factory, out_dir, QueueLog(bar=progress and not quiet),
                   fail_fast=fail_fast)
    queue.locking, queue.render_order, queue.settings = locking, render_order, current
    queue.elsewhere_wait_s, queue.resume = elsewhere_wait_s, resume
    crash: BaseException | None = None
    try:
        with InterruptGuard() as guard:
            try:
                queue.start(overwrite, shard, note)
                queue.run(guard)
                guard.acknowledge()  # the outcome is decided: a signal from here on changes nothing
                report.finished = True
            except KeyboardInterrupt as exc:
                guard.acknowledge()
                if not report.finished:
                    report.interrupted, report.signum = True, signum_of(exc)
                    queue.interrupted(exc)
            except BaseException as exc:
                guard.acknowledge()
                report.crashed, crash = _describe(exc), exc
                queue.interrupted(exc)
            queue.close()
            settle()
    finally:
        if report_lock is not None:
            report_lock.release()
    if crash is not None:
        raise crash
    return report


class _Queue:
    """The loop of ``run_batch``: one job after another, each job's writer tail beside the next job's start."""

    def __init__(self, jobs, targets, report: BatchReport, factory, out_dir: Path, log: "QueueLog", *,
                 fail_fast: bool):
        self.jobs, self.targets, self.report = jobs, targets, report
        self.factory, self.log, self.fail_fast = factory, log, fail_fast
        self.out_dir = out_dir
        self.out_real = out_dir.resolve()
        self.reasons: list[str | None] = [None] * len(jobs)
        self.order: list[int] = []
        self.renderer = None
        self.current: int | None = None  # the job the main thread renders
        self.attempt: _Attempt | None = None
        # Jobs whose writer tail may still run (one at a time), each with the event its `_tail_done` sets last.
        self.tails: list[tuple[int, threading.Event]] = []
        self.lock = threading.RLock()  # job outcomes, the log and the report (tails end on writer threads)
        self.t_queue: float | None = None
        self.said_write_error: str | None = None
        self.locking = True  # False once the filesystem refused flock (said once)
        self.render_order: Sequence[int] | None = None
        self.settings: dict[str, Any] | None = None  # this run's checkpoint and encoder (`current`)
        self.elsewhere_wait_s: float | None = None  # `run_batch`'s; None: `elsewhere_wait`'s default
        self.since_ns = time.time_ns()  # outputs written since: by another queue of this run (render_reason)
        self.overwrite, self.resume = False, None  # `start`'s, `run_batch`'s (the command that resumes it)

    def start(self, overwrite: bool, shard, note: str | None) -> None:
        """Decide what to render, sweep what dead queues left beside skipped jobs, write the first report."""
        self.overwrite = overwrite
        self.reasons = [render_reason(job, mp4, side, overwrite=overwrite)
                        for job, (mp4, side) in zip(self.jobs, self.targets)]
        for outcome, reason in zip(self.report.jobs, self.reasons):
            if reason is None:
                outcome.status = SKIPPED
        order = range(len(self.jobs)) if self.render_order is None else self.render_order
        self.order = [i for i in order if self.reasons[i] is not None]
        n = len(self.jobs)
        self.log.start(len(self.order))
        if note:
            self.log.line(note)
        self.log.line(f"{n} job{'s' if n != 1 else ''}: {n - len(self.order)} already rendered (skipped), {len(self.order)} to render"
                      + ("" if shard is None else f" [shard {shard[0]} of {shard[1]}]"))
        for i, reason in enumerate(self.reasons):
            if reason is None:
                self._sweep_skipped(*self.targets[i])
                self._say_rendered_with(i)
        self._mark_dead_reports()
        with self.lock:
            if not self.report.write():
                self._say_write_error()

    def _say_rendered_with(self, i: int) -> None:
        """A skipped job rendered with another checkpoint or encoder setting than this run's says so."""
        if self.settings is None:
            return
        try:
            note = rendered_with(read_sidecar(self.targets[i][1]), self.settings["checkpoint"],
                                 self.settings["encoder"])
        except SidecarUnreadable:
            return
        if note:
            self.log.line(f"job {i + 1}/{len(self.jobs)} {_name(self.report.jobs[i])} skipped: {note}")

    def try_lock(self, path: Path):
        """The job's lock, None when a live process holds it, or `_UNLOCKED` where flock is unsupported."""
        if not self.locking:
            return _UNLOCKED
        try:
            return locks.FileLock.try_acquire(path)
        except locks.LockUnsupported as exc:
            self.locking = False
            self.log.line(f"{exc.strerror}; running without job locks (two queues on this out dir would clash)")
            return _UNLOCKED

    def _sweep_skipped(self, mp4: Path, sidecar: Path) -> None:
        """Temps a killed queue left beside a finished job (a killed ``--overwrite``), removed if their owner is
        gone: only the holder of the job's lock ever writes them."""
        leftovers = [p for p in (*temp_paths(mp4, sidecar), lock_path(mp4)) if os.path.lexists(p)]
        if not leftovers:
            return
        try:
            lock = self.try_lock(lock_path(mp4))
            if lock is None:
                return  # a live process is on it: its temps are its own
            try:
                remove_files(*temp_paths(mp4, sidecar))
            finally:
                lock.release()
        except OSError as exc:
            self.log.line(f"could not sweep the temp files of {mp4}: {exc}")

    def record(self, i: int) -> None:
        """Job i's outcome into the report's journal (one appended line; the report itself is written whole only
        at the start and the end)."""
        with self.lock:
            if self.t_queue is not None:
                self.report.queue_seconds = time.perf_counter() - self.t_queue
            if not self.report.record(i):
                self._say_write_error()

    def _say_write_error(self) -> None:
        if self.report.write_error != self.said_write_error:
            self.said_write_error = self.report.write_error
            self.log.line(f"could not write the report {self.report.write_error}; trying again after the next job")

    def _mark_dead_reports(self) -> None:
        for name in mark_dead_reports(self.out_dir, self.report.path):
            self.log.line(f"{name}: its queue died without a final state; marked it killed")

    def _job_done(self, i: int) -> None:
        with self.lock:
            self.log.job_done(i, len(self.jobs), self.report.jobs[i], self.reasons[i])
            self.record(i)

    def _stop_for_failure(self) -> bool:
        if self.fail_fast and self.report.count(FAILED):
            self.log.line("stopping after the first failure (--fail-fast)")
            return True
        return False

    def run(self, guard: InterruptGuard) -> None:
        for i in self.order:
            guard.check()
            if self._stop_for_failure():  # an earlier job's tail failed meanwhile
                break
            if not self._render(i):
                return
        again = [i for i in self.order if self.report.jobs[i].status == ELSEWHERE]
        if again and not self._stop_for_failure():
            self.wait_tails()  # this queue's own times (the wait's bound) are all in
            wait = self.elsewhere_wait()
            self.log.line(f"{len(again)} job(s) were in progress elsewhere; waiting up to {wait:.0f} s for their "
                          f"holders, then trying them once more")
            deadline = time.monotonic() + wait
            for i in again:
                self._wait_for_holder(i, deadline, guard)
                if not self._render(i):
                    return
        self.wait_tails()

    def elsewhere_wait(self) -> float:
        """How long the end of the queue waits for the holders of its ``elsewhere`` jobs: `elsewhere_wait_s` when
        given, else twice the longest job this queue rendered, at least `ELSEWHERE_WAIT_MIN_S`. Two identical queues
        (an array submitted twice) hold one job each at the end, and each job takes about as long in either."""
        if self.elsewhere_wait_s is not None:
            return self.elsewhere_wait_s
        longest = max((j.seconds or 0.0 for j in self.report.jobs), default=0.0)
        return max(ELSEWHERE_WAIT_MIN_S, 2 * longest + (self.report.load_seconds or 0.0))

    def _wait_for_holder(self, i: int, deadline: float, guard: InterruptGuard) -> None:
        """Until job i's lock is free (its holder finished it, failed, or died) or the deadline passes; in short
        slices, so a signal stops the wait."""
        path = lock_path(self.targets[i][0])
        while True:
            guard.check()
            lock = self.try_lock(path)
            if lock is not None:
                lock.release()  # `_render` claims it again and decides: finished elsewhere (skipped) or render
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(ELSEWHERE_POLL_S)

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

    def _render(self, i: int) -> bool:
        """Job i up to its writer tail; the tail's end records the outcome (`_tail_done`). False: stop the queue
        (the renderer could not be created)."""
        job, (mp4, sidecar) = self.jobs[i], self.targets[i]
        outcome = self.report.jobs[i]
        outcome.status, outcome.error = PENDING, None
        self.current = i
        self.attempt = attempt = _Attempt(job, mp4, sidecar, outcome)
        t0 = time.perf_counter()
        failure = future = None
        try:
            busy = attempt.claim(self)
            if busy is not None:
                outcome.status, outcome.error = ELSEWHERE, f"in progress elsewhere ({busy})"
                self.current = self.attempt = None
                self.wait_tails()  # its line after those of the jobs started before it
                self.log.line(f"job {i + 1}/{len(self.jobs)} {_name(outcome)}: in progress elsewhere ({busy}); "
                              f"moving on")
                self.record(i)
                return True
            # Under the lock: another queue may have finished the job since `start` looked.
            reason = render_reason(job, mp4, sidecar, overwrite=self.reasons[i] == "overwrite", since_ns=self.since_ns)
            if reason is None:
                attempt.release()
                outcome.status = SKIPPED
                self.current = self.attempt = None
                self.wait_tails()
                self.log.skipped_late(i, len(self.jobs), outcome)
                self.record(i)
                return True
            self.reasons[i] = reason
            if self.renderer is None:
                t0 = time.perf_counter()
                if not self._load():
                    attempt.release()
                    self.current = self.attempt = None
                    return False
                t0 = time.perf_counter()
            if callable(getattr(self.renderer, "render_async", None)):
                future = self.renderer.render_async(job, mp4, sidecar)
            else:
                future = Future()
                future.set_result(self.renderer.render(job, mp4, sidecar))
        except Exception as exc:
            failure = _Failure.of(exc)  # text only: the exception and its frames go when this block ends
        except BaseException:  # an interrupt: `interrupted` marks the job and releases its lock
            outcome.seconds = time.perf_counter() - t0
            attempt.cleanup()
            raise
        self.current = self.attempt = None
        if failure is not None:
            attempt.fail(failure)
            attempt.release()
            outcome.seconds = time.perf_counter() - t0
            _release_memory()  # the cycles a failed job's traceback left hold its tensors
            self.wait_tails()  # job lines in render order: the earlier jobs' tails print theirs first
            self._job_done(i)
            return True
        recorded = threading.Event()
        self.tails.append((i, recorded))
        future.add_done_callback(lambda f: self._tail_done(i, attempt, f, t0, recorded))
        return True

    def _tail_done(self, i: int, attempt: "_Attempt", future: Future, t0: float, recorded: threading.Event) -> None:
        """Job i's MP4 and sidecar are in place (or its tail failed): record it, then give the lock back, then set
        `recorded`. Runs on the writer's thread; never raises (an exception here would only be logged by
        concurrent.futures)."""
        try:
            self._record_tail(i, attempt, future, t0)
        finally:
            recorded.set()

    def _record_tail(self, i: int, attempt: "_Attempt", future: Future, t0: float) -> None:
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
            try:
                self._job_done(i)
            finally:
                attempt.release()

    def wait_tails(self) -> None:
        """Wait until every writer tail has ended and its outcome is recorded, in short slices so a signal handler
        can run meanwhile. (Waiting on the future alone was not enough: a future is done before its callback runs,
        so the final report could be written without the last job's outcome; seen once in CI, 2026-12-01.)"""
        for _, recorded in self.tails:
            while not recorded.wait(0.1):
                pass
        self.tails.clear()

    def interrupted(self, exc: BaseException) -> None:
        """After an interrupt (or an internal error) reached the main thread: let a running tail end (its job is
        then done, or failed), mark the job being rendered interrupted, remove its files, give its lock back."""
        self.wait_tails()
        if self.current is not None and self.report.jobs[self.current].status == PENDING:
            outcome = self.report.jobs[self.current]
            outcome.status, outcome.error = INTERRUPTED, _describe(exc)
        if self.attempt is not None:
            self.attempt.cleanup()
            self.attempt.release()

    def close(self) -> None:
        """The final report and the last log lines (after the bars are gone, so none is redrawn below them)."""
        report = self.report
        with self.lock:
            if self.t_queue is not None:
                report.queue_seconds = time.perf_counter() - self.t_queue
            written = report.write_final()
        self.log.close(strays=report.interrupted or report.crashed is not None)
        self._mark_dead_reports()
        where = f"report {report.path}" if written else "no report (see above)"
        if not written:
            self.log.line(f"could not write the report {report.write_error}; removed it rather than leave one "
                          f"saying the queue is running")
        elif report.final_write_failed:
            self.log.line(f"could not replace the report {report.write_error}; rewrote it in place")
        if report.crashed:
            self.log.line(f"internal error: {report.crashed}; " + ("report written" if written else "no report"))
        elif report.interrupted:
            for line in stop_lines(report, where, self.resume, overwrite=self.overwrite):
                self.log.line(line)
        else:
            c = report.counts
            self.log.line(f"done: {c[SUCCEEDED]} succeeded, {c[FAILED]} failed, {c[SKIPPED]} skipped, "
                          f"{c[PENDING]} pending" + (f", {c[ELSEWHERE]} in progress elsewhere" if c[ELSEWHERE]
                                                     else "") + f"; {where}")
            return
        _release_memory()  # an interrupted job's tensors


class _Unlocked:
    """Stands in for a lock where the filesystem has none."""

    held = True

    def release(self) -> None:
        pass


_UNLOCKED = _Unlocked()


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
    """One job's render attempt: its folder, its lock, the files it may touch. Every end other than success
    removes the job's temp files and any final-named file written during the attempt, but only once the attempt
    holds the lock: before that, those files may be another process's."""

    def __init__(self, job, mp4: Path, sidecar: Path, outcome: JobOutcome):
        self.job, self.mp4, self.sidecar, self.outcome = job, mp4, sidecar, outcome
        self.temps = temp_paths(mp4, sidecar)
        self.lock = None
        self.made: list[Path] = []  # the folders `claim` made (`outputs.make_folders`)
        self.before: dict[Path, Any] = {}

    def claim(self, queue: _Queue) -> str | None:
        """Make the job's folder (inside the out dir), take its lock and sweep what a dead holder left. Returns
        who holds the lock when another live process does (nothing touched), else None.

        Raises:
            JobPathError, OSError: the folder cannot be made or used (the message names the path).
        """
        folder = self.mp4.parent
        problem = path_problem(self.mp4, self.sidecar, queue.out_real)
        if problem is not None:
            raise JobPathError(problem)
        try:
            self.made = make_folders(folder)
        except OSError as exc:
            # `from exc`: the report's traceback keeps the system call's own error (errno, path) as its cause
            raise JobPathError(f"cannot create the job's folder {folder}: {exc.strerror or exc}") from exc
        try:
            lock = queue.try_lock(lock_path(self.mp4))
        except FileNotFoundError:  # an interrupted queue removed the folder, empty, after our mkdir: once more
            self.made = make_folders(folder)
            lock = queue.try_lock(lock_path(self.mp4))
        if lock is None:
            return locks.holder(lock_path(self.mp4))
        self.lock = lock
        remove_files(*self.temps)  # ours now: any temp of this job was left by a dead process
        self.before = {p: _identity(p) for p in (self.mp4, self.sidecar)}
        return None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        remove_empty_folders(self.made)  # still empty once the lock file is gone: the job wrote nothing there

    def check_written(self) -> None:
        if not (self.mp4.is_file() and self.sidecar.is_file()):
            raise RuntimeError(f"renderer returned without writing {self.mp4.name} and {self.sidecar.name}")

    def cleanup(self) -> None:
        if self.lock is None:
            return
        try:
            remove_files(*self.temps)
            # Only files this attempt replaced: a signal landing between the lock and `before` leaves it empty,
            # and then nothing final was written yet (a KeyError here once turned an interrupt into a crash).
            remove_files(*(p for p in (self.mp4, self.sidecar)
                           if p in self.before and _identity(p) not in (None, self.before[p])))
        except OSError:
            pass  # best effort; the next run sweeps temps under the lock

    def fail(self, failure: _Failure) -> None:
        self.outcome.status, self.outcome.error, self.outcome.traceback = FAILED, failure.error, failure.traceback
        self.cleanup()


def _fail_all(report: BatchReport, reasons: list, error: str, tb: str) -> None:
    for outcome, reason in zip(report.jobs, reasons):
        if reason is not None and outcome.status in (PENDING, ELSEWHERE):
            outcome.status, outcome.error, outcome.traceback = FAILED, error, tb


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size), which changes when a file is replaced or rewritten; None if absent."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _release_memory() -> None:
    """Collect cycles (a failed job's traceback frames hold its tensors) and return cached CUDA blocks."""
    gc.collect()
    torch = sys.modules.get("torch")  # never import torch just for this: no torch loaded means no device memory
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


