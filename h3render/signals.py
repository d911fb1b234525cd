"""Signals and the exit codes they give (`h3render.exits`): the queue's interrupt guard and the process-wide start-up handler.

Which signal means what (the batch queue, `h3render batch`):

=========================  ====  ===================================================================================
SIGINT (Ctrl-C)            130   stop now: the job being rendered is abandoned (its files removed, ``interrupted``),
SIGTERM (scancel, limit)         the report is written. 130 = 128 + SIGINT, the shell's code for Ctrl-C.
SIGHUP (terminal closed)
SIGUSR1, SIGUSR2            75   SLURM's warning before the time limit (``--signal=B:USR1@120``): the same clean
                                 stop, then exit 75 (EX_TEMPFAIL from BSD sysexits.h, "try again later"), which
                                 scripts/h3render.sbatch answers with ``scontrol requeue``: resume does the rest.
=========================  ====  ===================================================================================

A writer tail already running (the MP4's trailer, fsync, rename and sidecar: milliseconds) finishes in every case,
so its job is ``succeeded`` or ``failed``, never half written.

`InterruptGuard` turns those signals into `Interrupted` (a KeyboardInterrupt, so they unwind through the renderer's
own ``except BaseException`` cleanup) while the queue runs. `ProcessGuard`, installed once by the CLI before
anything loads, does the same from start-up on, so a Ctrl-C while torch imports gives 130 and one line instead of
click's "Aborted!" and exit 1; once the queue has written its final report (`settle`), later signals are ignored
and the process exits with the code the report holds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from h3render.exits import REQUEUE_SIGNALS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HANDLED = STOP_SIGNALS + REQUEUE_SIGNALS


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when a handled signal arrives; ``signum`` says which (None: a plain Ctrl-C
    KeyboardInterrupt raised by Python's default handler)."""

    def __init__(self, message: str = "", signum: int | None = None):
        super().__init__(message)
        self.signum = signum


def signal_name(signum: int | None) -> str:
    return "SIGINT" if signum is None else signal.Signals(signum).name


def signum_of(exc: BaseException) -> int | None:
    return getattr(exc, "signum", None)


class InterruptGuard:
    """While the queue runs, the handled signals raise `Interrupted` in the main thread, once: a second signal
    while the queue cleans up (SLURM signals the batch shell and the task; the sbatch script forwards it) is
    recorded and ignored, so it cannot break the cleanup half way.

    Python drops an exception raised while a ``__del__`` or a weakref callback runs and hands it to
    ``sys.unraisablehook`` (seen under SLURM: the SIGTERM landed in ``regex``'s ``Group.__del__`` during a garbage
    collection, and the queue went on rendering). The guard's hook marks the signal lost and a helper thread sends
    it again a moment later, when the main thread is out of the ``__del__``; the loop also checks for it between
    jobs (`check`). Handlers are only installed from the main thread (Python allows no other); an ignored SIGINT
    (a background job) stays ignored.
    """

    RESEND_DELAY_S = 0.05

    def __init__(self):
        self.received: int | None = None
        self._lost = threading.Event()
        self._resending = False  # the re-sent signal must raise again
        self._acknowledged = threading.Event()
        self._lock = threading.Lock()  # no re-send once acknowledged
        self._previous: dict[int, Any] = {}
        self._previous_hook = None

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
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
        if self._acknowledged.is_set():
            return
        if self.received is None:
            self.received = signum
            threading.Thread(target=self._resend_lost, name="h3render-resend-signal", daemon=True).start()
        elif not self._resending:
            return  # a second signal: the first one's unwinding is under way
        self._resending = False
        raise Interrupted(f"{signal_name(self.received)} received", self.received)

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
                        self._resending = True
                        print(f"h3render batch: {signal_name(self.received)} was dropped inside a __del__; "
                              f"sending it again", file=sys.stderr, flush=True)
                        os.kill(os.getpid(), self.received)

    def check(self) -> None:
        """Raise `Interrupted` if a signal arrived whose exception got lost on the way."""
        if self.received is not None and not self._acknowledged.is_set():
            raise Interrupted(f"{signal_name(self.received)} received", self.received)

    def acknowledge(self) -> None:
        """The queue's outcome is decided: ignore further signals while it writes the report and returns
        (milliseconds; leaving the guard restores the previous handlers)."""
        with self._lock:
            self._acknowledged.set()
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)


class ProcessGuard:
    """The CLI's handlers from start-up to exit: a handled signal raises `Interrupted` (so the CLI exits 130 or 75
    with one line) until `settle` says the outcome is written; after that signals are ignored, and the process
    exits with the code its report holds. The queue's `InterruptGuard` takes over while it runs."""

    def __init__(self):
        self.settled = False

    def install(self) -> "ProcessGuard":
        global _process_guard
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    signal.signal(signum, self._handle)
        _process_guard = self
        return self

    def _handle(self, signum, frame) -> None:
        if self.settled:
            return
        self.settled = True  # one raise: a second signal must not break the unwinding of the first
        raise Interrupted(f"{signal_name(signum)} received", signum)


_process_guard: ProcessGuard | None = None


def settle() -> None:
    """The process's outcome (report and exit code) is written: the CLI ignores later signals (no-op without
    an installed `ProcessGuard`, as in library use and tests)."""
    if _process_guard is not None:
        _process_guard.settled = True
