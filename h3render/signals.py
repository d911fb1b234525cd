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
own ``except BaseException`` cleanup) while the queue runs. `ProcessGuard`, installed once by the CLI's `main`
before anything heavy is imported, does the same from start-up on, so a Ctrl-C at start-up gives 130 (SIGUSR1 75)
and one line instead of click's "Aborted!" and exit 1.

The edges (measured with the tiny model, issue #28 item 6):

* While a module is being imported (torch takes 0.3–2 s of the start-up) neither guard raises: an exception thrown
  into a half-run module body left a half-initialised ``torch`` in ``sys.modules`` (the next import failed with
  "partially initialized module", exit 1) or crashed the interpreter (exit -11). The signal is kept and sent again
  every `RESEND_DELAY_S` until it lands outside an import, which is where it raises.
* Once the outcome is written (`settle`: the queue's final report, or the command's return), the handled signals
  are set to ``SIG_IGN`` at the OS level. A Python handler is not enough: interpreter finalization (about 1.3 s
  after the report with torch loaded) resets Python-level handlers to ``SIG_DFL``, and a signal then killed the
  process (rc -15/-2/-10, so sbatch saw no 75 and the report's exit 0 was contradicted). ``SIG_IGN`` survives
  finalization, so the exit code is always the one the report holds.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from h3render.exits import REQUEUE_SIGNALS

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HANDLED = STOP_SIGNALS + REQUEUE_SIGNALS
RESEND_DELAY_S = 0.05  # a signal that arrived inside an import is sent again this often until it can raise

_IMPORT_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def inside_import(frame) -> bool:
    """Whether the main thread is running a module's import (its frame stack passes through importlib): raising
    there leaves a half-initialised module behind."""
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_FILES:
            return True
        frame = frame.f_back
    return False


def _resend_until(signum: int, done) -> None:
    """Send `signum` to this process every `RESEND_DELAY_S` until ``done()`` (the signal raised, or the outcome
    is settled): how a signal that arrived inside an import reaches the first bytecode outside it."""

    def loop():
        while not done():
            time.sleep(RESEND_DELAY_S)
            if not done():
                os.kill(os.getpid(), signum)

    threading.Thread(target=loop, name="h3render-resend-signal", daemon=True).start()


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
        self._in_import = False  # the first signal came inside an import: it is being re-sent until outside
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
            # A settled process keeps ignoring them (the ProcessGuard's handler would be reset by finalization).
            signal.signal(signum, signal.SIG_IGN if settled() else handler)
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook

    def _handle(self, signum, frame) -> None:
        if self._acknowledged.is_set():
            return
        if self.received is None:
            self.received = signum
            if inside_import(frame):  # a lazy import of the model load: raise once it is done
                self._in_import = True
                _resend_until(signum, lambda: not self._in_import or self._acknowledged.is_set())
                return
            threading.Thread(target=self._resend_lost, name="h3render-resend-signal", daemon=True).start()
        elif self._in_import:
            if inside_import(frame):
                return
            self._in_import = False
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
    with one line) until `settle` says the outcome is written; after that the signals are ignored (``SIG_IGN``),
    and the process exits with the code its report holds. A signal inside an import is re-sent until it lands
    outside one, and so is one whose `Interrupted` Python dropped (raised inside a ``__del__`` or a garbage
    collection callback: the render went on to exit 0, and every later Ctrl-C was ignored as "already raised").
    The queue's `InterruptGuard` takes over while it runs."""

    def __init__(self):
        self.settled = False
        self.pending: int | None = None  # the first signal, kept while it waits for the end of an import
        self.raised = False
        self._previous_hook = sys.unraisablehook

    def install(self) -> "ProcessGuard":
        global _process_guard
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    signal.signal(signum, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        _process_guard = self
        return self

    def _unraisable(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, Interrupted) and self.pending is not None and not self.settled:
            self.raised = False  # it never reached the command: raise it again, from outside the __del__
            _resend_until(self.pending, lambda: self.raised or self.settled)
            return
        self._previous_hook(unraisable)

    def _handle(self, signum, frame) -> None:
        if self.settled or self.raised:
            return  # one raise: a second signal must not break the unwinding of the first
        if self.pending is None:
            self.pending = signum
            if inside_import(frame):
                _resend_until(signum, lambda: self.raised or self.settled)
        if inside_import(frame):
            return
        self.raised = True
        raise Interrupted(f"{signal_name(self.pending)} received", self.pending)

    def settle(self) -> None:
        self.settled = True
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                signal.signal(signum, signal.SIG_IGN)


_process_guard: ProcessGuard | None = None


def settle() -> None:
    """The process's outcome (report and exit code) is written: the CLI ignores later signals, at the OS level so
    that interpreter finalization cannot reset them (no-op without an installed `ProcessGuard`, as in library use
    and tests)."""
    if _process_guard is not None:
        _process_guard.settle()


def settled() -> bool:
    return _process_guard is not None and _process_guard.settled
