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

The renderer contract (``h3render.pipeline.Renderer``): ``render(job, mp4_path, sidecar_path) -> dict``, writing
the MP4 and then the sidecar (which holds ``"job": job.params()``), both atomically. Jobs need ``id``, ``output``
and ``params()`` (``h3render.jobs.Job``). With ``overlap=True`` (one rank) the queue uses the renderer's two phases
instead, ``begin`` (prompt to latents, main thread) and ``finish`` (latents to MP4 and sidecar, one worker thread),
so that job N's finish runs beside job N+1's begin; see ``run_batch``.
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

REPORT_FORMAT = 2  # bump when a consumer-visible field of batch-report.json changes (2: queue_seconds, overlap)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM arrives, so it unwinds exactly like Ctrl-C (KeyboardInterrupt)."""


@dataclass
class JobOutcome:
    """One job's line in the report. ``output`` is the MP4 path relative to the out dir; ``seconds`` is wall time
    of this job's render (the one-off model load is ``BatchReport.load_seconds``), None when it did not run. In an
    overlapped queue ``seconds`` is the time spent in the job's own two phases (begin + finish, not the wait
    between them), and ``overlap`` says how much of its finish ran beside the next job's begin (so the sum of
    ``seconds`` minus the sum of ``overlap.overlapped_s`` does not count any second twice)."""

    id: str | None
    output: str
    status: str = PENDING
    seconds: float | None = None
    error: str | None = None  # "ExceptionType: message" for failed / interrupted jobs
    traceback: str | None = None
    overlap: dict[str, Any] | None = None  # overlapped queue only (see run_batch)

    def to_dict(self) -> dict[str, Any]:
        d = {"id": self.id, "output": self.output, "status": self.status,
             "seconds": None if self.seconds is None else round(self.seconds, 3), "error": self.error}
        if self.overlap is not None:
            d["overlap"] = self.overlap
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
    overlap: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "reason": "not requested"})
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
            "overlap": self._overlap_summary(),
            "counts": self.counts,
            "jobs": [j.to_dict() for j in self.jobs],
        }

    def _overlap_summary(self) -> dict[str, Any]:
        summary = dict(self.overlap)
        if summary.get("enabled"):
            lines = [j.overlap for j in self.jobs if j.overlap is not None]
            summary["overlapped_finishes"] = sum(1 for o in lines if o.get("finish") == "overlapped")
            summary["skipped"] = sum(1 for o in lines if o.get("skipped"))
            summary["overlapped_s"] = round(sum(o.get("overlapped_s") or 0.0 for o in lines), 3)
        return summary

    def write(self) -> None:
        """Atomically (temp file in the same folder, fsync, rename) replace the report file. Thread-safe (the
        overlapped queue records a finished job from its worker thread)."""
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
    overlap: bool = False,
) -> BatchReport:
    """Render ``jobs`` in order into ``out_dir`` and return the report (its ``exit_code`` is the process's).

    Args:
        jobs: ``h3render.jobs.Job`` objects (already sharded); each needs ``id``, ``output`` (relative path
            without extension) and ``params()``.
        renderer_factory: zero-argument callable returning an object with ``render(job, mp4_path, sidecar_path)``
            (and, for ``overlap``, ``begin``/``finish``). Called at most once, just before the first job that needs
            rendering; never when all are skipped.
        out_dir: folder for the MP4s, sidecars and the report; created if missing.
        overwrite: render every job even when its outputs are complete and current (default: resume, skip those).
        fail_fast: stop after the first failed job; later jobs stay ``pending`` (with ``overlap``, also the job
            whose begin ran beside the failed finish: its latents are dropped).
        quiet: no progress bars; one line per job on stderr.
        progress: draw the tqdm queue bar at position 0 (the renderer's step bar takes position 1). None (the
            default): only when stderr is a terminal. Without the bar (False, a SLURM log, ``quiet``) the queue
            logs one line per job instead.
        shard: ``(index, count)`` of this array task, 0-based; only names the report file and is recorded in it.
        overlap: run job N's ``finish`` (audio + video decode, MP4 encode, sidecar) on a worker thread while the
            main thread runs job N+1's ``begin`` (text encode, denoise), at most one finish in flight, when the
            renderer has both phases and its ``plan_overlap(pending, next_job)`` (if any) allows it; see below.

    Returns:
        The final ``BatchReport``; ``<out_dir>/batch-report[.shard-i-of-n].json`` holds the same.

    Raises:
        ValueError: two jobs share an output path (usage error; nothing was rendered).

    SIGINT and SIGTERM do not propagate: the running job is cleaned up, its status becomes ``interrupted``, the
    report is written and ``exit_code`` is 130. The handlers are only installed when called from the main thread.

    Overlap. Only on one rank: on several ranks the renderer (``h3render.parallel.launch.LeaderRenderer``) has no
    phases, because every rank must run each job's collectives in the same order, and the queue runs sequentially
    (the report says so). A job's two phases are ``pending = renderer.begin(job, mp4, sidecar, shared=...)`` and
    ``renderer.finish(pending, shared=..., side_stream=True, cancel=..., overlap=...)``. After job N's begin and
    the previous finish have both ended (the device is idle), the queue frees cached memory, asks
    ``plan_overlap`` whether job N's finish and job N+1's begin fit on the device together, and starts the
    finish on the worker; when they do not fit (or N is the last job) it waits for that finish before going on.
    A failure in either phase fails only its own job; an out-of-memory error in a phase that shared the device
    is retried once alone, and the rest of the queue then runs without overlap. On an interrupt the in-flight
    finish is told to stop at its next decoded chunk: its job ends ``succeeded`` if it had already finished, else
    ``interrupted`` with its files removed. Each job's sidecar gets ``timings.overlap`` and its report line
    ``overlap`` (what ran beside it, for how long, and why an overlap was skipped).
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
    if overlap:
        report.overlap = {"enabled": True, "reason": None}
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

    queue = _Queue(jobs, targets, reasons, report, renderer_factory, log, fail_fast=fail_fast, overlap=overlap)
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
    """The loop of ``run_batch``: sequential (``render`` per job) or overlapped (``begin`` / ``finish``)."""

    def __init__(self, jobs, targets, reasons, report: BatchReport, factory, log: "_QueueLog", *, fail_fast: bool,
                 overlap: bool):
        self.jobs, self.targets, self.reasons, self.report = jobs, targets, reasons, report
        self.factory, self.log, self.fail_fast, self.overlap = factory, log, fail_fast, overlap
        self.order = [i for i, r in enumerate(reasons) if r is not None]
        self.renderer = None
        self.phased = False  # begin/finish with overlap, decided when the renderer exists
        self.current: int | None = None  # the job whose phase the main thread runs
        self.attempts: dict[int, _Attempt] = {}
        self.lock = threading.RLock()  # job outcomes, the log and the report (the worker records finishes too)
        self.worker = _Worker()
        self.inflight: _InFlight | None = None
        self.stop = threading.Event()  # set on interrupt: the in-flight finish abandons its job
        self.stop_message = "interrupted"
        self.clock = _PhaseClock()
        self.overlap_off: str | None = None  # once set, the rest of the queue runs its finishes alone
        self.t_queue: float | None = None
        self.unsuccessful = 0  # failed + interrupted jobs when the overlapped loop last collected garbage

    # -- bookkeeping ------------------------------------------------------------------------------------------

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

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self, guard: "_InterruptGuard") -> None:
        for n, i in enumerate(self.order):
            guard.check()
            if self.renderer is None:
                self.current = i
                if not self._load():
                    return
                self.current = None
            if self.phased:
                stop = self._step_overlapped(i, self.order[n + 1] if n + 1 < len(self.order) else None)
            else:
                stop = self._step_sequential(i)
            if stop:
                break
        self._collect()

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
        if self.overlap:
            phased = callable(getattr(self.renderer, "begin", None)) and callable(getattr(self.renderer, "finish", None))
            if phased:
                self.phased = True
            else:
                reason = getattr(self.renderer, "overlap_unsupported", "the renderer has no begin/finish phases")
                self.report.overlap = {"enabled": False, "reason": reason}
                self.log.line(f"jobs run one after another: {reason}")
        return True

    def _step_sequential(self, i: int) -> bool:
        job, (mp4, sidecar) = self.jobs[i], self.targets[i]
        self.current = i
        ok = _render_one(self.renderer, job, mp4, sidecar, self.report.jobs[i])
        self.current = None
        _release_memory()
        self._job_done(i)
        return not ok and self._stop_for_failure()

    def _step_overlapped(self, i: int, following: int | None) -> bool:
        """Job i's begin (beside the in-flight finish of the job before, if any), then its finish on the worker."""
        job, (mp4, sidecar) = self.jobs[i], self.targets[i]
        outcome = self.report.jobs[i]
        self.current = i
        attempt = self.attempts[i] = _Attempt(job, mp4, sidecar, outcome)
        beside = self.inflight.index if self.inflight is not None and self.inflight.shared else None
        pending, failure = self._begin(i, attempt, shared=beside is not None)
        retried = None
        if failure is not None and failure.oom and beside is not None:
            # The two phases did not fit on the device together: let the finish end, then begin again alone.
            self._collect()
            self._overlap_off(f"out of memory in job {i + 1}'s begin beside job {beside + 1}'s finish")
            retried = failure.error
            _release_memory()
            pending, failure = self._begin(i, attempt, shared=False)
        self._collect()
        if failure is not None:
            attempt.fail(failure)
            outcome.seconds = attempt.busy
            self.current = None
            self._idle_release()
            self._job_done(i)
            return self._stop_for_failure()
        if self._stop_for_failure():  # the finish that ran beside this begin failed
            attempt.cleanup()
            self.current = None
            return True

        # The device is idle (both phases ended): return the cached blocks, so the free memory read below is
        # accurate. A garbage collection (0.1-0.3 s of idle device with a model loaded) only after a failure: the
        # cycles a failed phase's traceback leaves are what it is for.
        self._idle_release()
        check, skipped = None, None
        if following is None:
            shared = False
        elif self.overlap_off is not None:
            shared, skipped = False, self.overlap_off
        else:
            plan = getattr(self.renderer, "plan_overlap", None)
            check = plan(pending, self.jobs[following]) if plan is not None else None
            shared = check is None or check.ok
            if not shared:
                skipped = check.reason
                self.log.line(f"job {i + 1}: decode not overlapped with job {following + 1}: {skipped}")
        flight = _InFlight(i, attempt, pending, shared=shared, before=beside, after=following if shared else None,
                           skipped=skipped, check=check, retried=retried)
        self.inflight = flight
        self.worker.start(lambda: self._finish(flight))
        self.current = None
        if not shared:
            self._collect()
            self._idle_release()  # a failed finish's memory goes before the next begin
            return self._stop_for_failure()
        return False

    def _idle_release(self) -> None:
        unsuccessful = self.report.count(FAILED) + self.report.count(INTERRUPTED)
        _release_memory(collect=unsuccessful != self.unsuccessful)
        self.unsuccessful = unsuccessful

    def _begin(self, i: int, attempt: "_Attempt", shared: bool):
        job, (mp4, sidecar) = self.jobs[i], self.targets[i]
        self.clock.start(i, "begin")
        t0 = time.perf_counter()
        try:
            return self.renderer.begin(job, mp4, sidecar, shared=shared), None
        except Exception as exc:
            return None, _Failure.of(exc)
        finally:
            attempt.busy += time.perf_counter() - t0
            self.clock.end(i, "begin")

    def _finish(self, flight: "_InFlight") -> None:
        """On the worker thread: job ``flight.index``'s finish, then its outcome (unless it is to be retried)."""
        i, attempt = flight.index, flight.attempt
        self.clock.start(i, "finish")
        t0 = time.perf_counter()
        failure = None
        try:
            if flight.pending is None:
                raise RuntimeError("internal: no latents to finish")
            self.renderer.finish(flight.pending, shared=flight.shared, side_stream=True, cancel=self._cancel,
                                 overlap=lambda: self._sidecar_overlap(flight))
            attempt.check_written()
        except BaseException as exc:  # recorded below; an Interrupted from _cancel included
            failure = _Failure.of(exc, cancelled=self.stop.is_set())
        finally:
            attempt.busy += time.perf_counter() - t0
            self.clock.end(i, "finish")
        if failure is not None and failure.oom and flight.shared and not self.stop.is_set():
            flight.retry = failure  # the main thread runs it again alone once the begin beside it has ended
            return
        flight.pending = None  # the latents may go
        with self.lock:
            outcome = attempt.outcome
            outcome.seconds = attempt.busy
            outcome.overlap = self._outcome_overlap(flight)
            if failure is None:
                outcome.status = SUCCEEDED
            else:
                attempt.fail(failure, status=INTERRUPTED if failure.cancelled else FAILED)
            flight.done = True
            self._job_done(i)

    def _collect(self) -> None:
        """Wait for the in-flight finish (if any); re-run it alone if it ran out of memory beside a begin."""
        flight = self.inflight
        if flight is None:
            return
        self.worker.wait()
        if flight.retry is not None and not flight.done:
            self._overlap_off(f"out of memory in job {flight.index + 1}'s finish beside job "
                              f"{(flight.after or 0) + 1}'s begin")
            flight.retried, flight.retry, flight.shared = flight.retry.error, None, False
            flight.attempt.cleanup()
            _release_memory()
            self.worker.start(lambda: self._finish(flight))
            self.worker.wait()
        self.inflight = None

    def _overlap_off(self, why: str) -> None:
        if self.overlap_off is None:
            self.overlap_off = f"{why}: the rest of the queue runs without overlap"
            self.log.line(self.overlap_off)
            with self.lock:
                self.report.overlap["disabled_after"] = self.overlap_off

    def _cancel(self) -> None:
        if self.stop.is_set():
            raise Interrupted(f"{self.stop_message}; the job's decode was abandoned")

    def interrupted(self, exc: BaseException) -> None:
        """After an interrupt reached the main thread: stop the in-flight finish, then mark what did not finish."""
        self.stop_message = str(exc) if isinstance(exc, Interrupted) else "KeyboardInterrupt"
        self.stop.set()
        flight = self.inflight
        if flight is not None:
            self.worker.wait()  # the finish ends at its next decoded chunk (signals are ignored meanwhile)
            if not flight.done:  # never started, or waiting for an out-of-memory retry
                flight.attempt.fail(_Failure(_describe(exc), None), status=INTERRUPTED)
            self.inflight = None
        if self.current is not None and self.report.jobs[self.current].status == PENDING:
            outcome = self.report.jobs[self.current]
            outcome.status, outcome.error = INTERRUPTED, _describe(exc)
            attempt = self.attempts.get(self.current)
            if attempt is not None:
                attempt.cleanup()

    # -- overlap accounting -----------------------------------------------------------------------------------

    def _sidecar_overlap(self, flight: "_InFlight") -> dict[str, Any]:
        """``timings.overlap`` of job ``flight.index``'s sidecar, built on the worker when the sidecar is written.

        ``phases``: this job's begin and finish intervals (seconds from the start of its begin); ``waited_s``: the
        latents waited between the two for the previous job's finish; ``with``: the other jobs' phases that ran
        at the same time as this job's and for how many seconds (wall-clock intersection); ``overlapped_s``: their
        sum. The stage times in ``timings.stages`` are this job's alone; with ``with`` non-empty some of them ran
        while the device also ran the other job's work (and the peak memory figures are the device's, both jobs).
        """
        now = time.perf_counter()
        i = flight.index
        begin, finish = self.clock.intervals(i, "begin", now), self.clock.intervals(i, "finish", now)
        origin = begin[0][0]
        beside = []
        if flight.before is not None:
            beside.append(self._with(flight.before, "finish", "begin", begin, now))
        if flight.after is not None:
            beside.append(self._with(flight.after, "begin", "finish", finish, now))
        return {
            "finish": "overlapped" if flight.shared else "alone",
            "skipped": flight.skipped,
            "memory": None if flight.check is None else flight.check.to_dict(),
            "retried_alone_after": flight.retried,
            "phases": {"begin": [[round(s - origin, 6), round(e - origin, 6)] for s, e in begin],
                       "finish": [[round(s - origin, 6), round(e - origin, 6)] for s, e in finish]},
            "waited_s": round(max(0.0, finish[0][0] - begin[-1][1]), 6),
            "with": beside,
            "overlapped_s": round(sum(w["seconds"] for w in beside), 6),
        }

    def _with(self, other: int, other_phase: str, own_phase: str, own: list, now: float) -> dict[str, Any]:
        seconds = _overlap_seconds(self.clock.intervals(other, other_phase, now), own)
        return {"job": self.jobs[other].id, "output": self.report.jobs[other].output, "phase": other_phase,
                "while": own_phase, "seconds": round(seconds, 6)}

    def _outcome_overlap(self, flight: "_InFlight") -> dict[str, Any]:
        """The report line's ``overlap``: how job ``flight.index``'s finish ran and for how long it shared the
        device with the next job's begin (final: this finish has ended)."""
        now = time.perf_counter()
        i = flight.index
        seconds = 0.0
        if flight.after is not None:
            seconds = _overlap_seconds(self.clock.intervals(i, "finish", now),
                                       self.clock.intervals(flight.after, "begin", now))
        begin, finish = self.clock.intervals(i, "begin", now), self.clock.intervals(i, "finish", now)
        return {"finish": "overlapped" if flight.shared else "alone",
                "with": None if flight.after is None else self.jobs[flight.after].id,
                "overlapped_s": round(seconds, 3),
                "waited_s": round(max(0.0, finish[0][0] - begin[-1][1]), 3) if begin and finish else 0.0,
                "skipped": flight.skipped,
                "retried_alone_after": flight.retried}


@dataclass
class _InFlight:
    """A finish handed to the worker. ``shared``: it runs beside job ``after``'s begin; ``before``: the job whose
    finish ran beside this job's begin."""

    index: int
    attempt: "_Attempt"
    pending: Any
    shared: bool
    before: int | None
    after: int | None
    skipped: str | None
    check: Any
    retried: str | None = None  # the out-of-memory error after which a phase of this job was re-run alone
    retry: "_Failure | None" = None
    done: bool = False


@dataclass
class _Failure:
    """How a phase failed, as text only: the exception (and through its traceback the job's tensors) is dropped,
    so that memory can be given back."""

    error: str
    traceback: str | None
    oom: bool = False
    cancelled: bool = False

    @classmethod
    def of(cls, exc: BaseException, cancelled: bool = False) -> "_Failure":
        oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"  # torch.OutOfMemoryError
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(_describe(exc), tb, oom=oom, cancelled=cancelled or isinstance(exc, KeyboardInterrupt))


class _Attempt:
    """One job's render attempt: the files it may touch and the seconds it spent. Every end other than success
    removes the job's temp files and any final-named file written during the attempt."""

    def __init__(self, job, mp4: Path, sidecar: Path, outcome: JobOutcome):
        mp4.parent.mkdir(parents=True, exist_ok=True)
        self.job, self.mp4, self.sidecar, self.outcome = job, mp4, sidecar, outcome
        self.temps = temp_paths(mp4, sidecar)
        remove_files(*self.temps)  # left by an earlier queue killed with SIGKILL
        self.before = {p: _identity(p) for p in (mp4, sidecar)}
        self.busy = 0.0  # seconds in the renderer

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


class _PhaseClock:
    """Wall intervals (``time.perf_counter``) of every job's begin and finish, for the overlap accounting."""

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: dict[tuple[int, str], list[list[float | None]]] = {}

    def start(self, index: int, phase: str) -> None:
        with self._lock:
            self._intervals.setdefault((index, phase), []).append([time.perf_counter(), None])

    def end(self, index: int, phase: str) -> None:
        with self._lock:
            self._intervals[(index, phase)][-1][1] = time.perf_counter()

    def intervals(self, index: int, phase: str, now: float) -> list[tuple[float, float]]:
        """The phase's intervals; one still running ends at ``now``."""
        with self._lock:
            return [(s, now if e is None else e) for s, e in self._intervals.get((index, phase), [])]


def _overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sets of intervals (each set's intervals do not overlap each other)."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


class _Worker:
    """Runs one callable at a time on a background thread (the overlapped queue's finishes)."""

    def __init__(self):
        self._current: tuple[threading.Thread, threading.Event] | None = None

    def start(self, fn: Callable[[], None]) -> None:
        done = threading.Event()

        def run():
            try:
                fn()
            finally:
                done.set()

        thread = threading.Thread(target=run, name="h3render-finish", daemon=True)
        self._current = (thread, done)
        thread.start()

    def wait(self) -> None:
        """Block until the callable returns. Waits in short slices, so a signal handler can run in the main thread
        meanwhile."""
        if self._current is None:
            return
        thread, done = self._current
        while not done.wait(0.1):
            if thread.ident is None:  # interrupted before the thread was started: nothing runs
                break
        self._current = None


def _render_one(renderer, job, mp4: Path, sidecar: Path, outcome: JobOutcome) -> bool:
    """Render one job, recording the outcome; True on success. On any exit other than success (an Exception or
    an interrupt) the job's temp files and any final-named file written during the attempt are removed."""
    attempt = _Attempt(job, mp4, sidecar, outcome)
    t0 = time.perf_counter()
    try:
        renderer.render(job, mp4, sidecar)
        attempt.check_written()
    except Exception as exc:
        attempt.fail(_Failure.of(exc))
        return False
    except BaseException:
        attempt.cleanup()
        raise
    finally:
        outcome.seconds = time.perf_counter() - t0
    outcome.status = SUCCEEDED
    return True


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


def _release_memory(collect: bool = True) -> None:
    """Collect cycles (a failed job's traceback frames hold its tensors) and return cached CUDA blocks."""
    if collect:
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
