"""Every exit code of `h3render`, and which error gives which (one home: the CLI, the batch report and the signal
handlers import them from here).

====  ==================  ==========================================================================================
code  name                when
====  ==================  ==========================================================================================
0     `EXIT_OK`           every job succeeded or was already rendered (an empty shard too, and a job another
                          queue finished while this one waited for it); `--dry-run`
1     `EXIT_FAILED`       a job failed (any other exception inside a job: `engine.RenderError`,
                          `colour.MediaError`, a `CheckpointError` while loading, ...), a job was left
                          ``elsewhere`` (still held by another live queue after the end-of-queue wait), or the
                          final batch report could not be written; the other jobs still ran
2     `EXIT_USAGE`        bad input found before anything renders, one line each: a `UsageError`, that is
                          `settings.SettingsError` (options, checkpoint, adapter, precision, attention, --gpus,
                          a `prompt -o` that exists without --overwrite),
                          `manifest.ManifestError` (one line per problem), `outputs.BatchUsageError` (two jobs
                          sharing an output, a bad --out-dir); and click's own bad option values
75    `EXIT_REQUEUE`      stopped by SIGUSR1/SIGUSR2 (SLURM's warning before the time limit): requeue and resume;
                          EX_TEMPFAIL of BSD sysexits.h, "try again later"
130   `EXIT_INTERRUPTED`  SIGINT, SIGTERM or SIGHUP (128 + SIGINT, the shell's code for Ctrl-C)
====  ==================  ==========================================================================================
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REQUEUE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request before the time limit; requeue and resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT

# The signals that mean "stop cleanly, then requeue" (h3render.signals handles them; scripts/h3render.sbatch sends
# SIGUSR1 before the time limit and answers exit 75 with `scontrol requeue`).
REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


class UsageError(ValueError):
    """Bad input found before anything renders: printed as one line (`h3render: error: ...`), exit 2, no
    traceback. Subclasses name where the input came from (options, a manifest, an out dir)."""


def signal_exit_code(signum: int | None) -> int:
    """The code a stop by signal `signum` gives: 75 for SIGUSR1/SIGUSR2 (requeue), else 130 (None: a plain
    KeyboardInterrupt)."""
    return EXIT_REQUEUE if signum in REQUEUE_SIGNALS else EXIT_INTERRUPTED


def error_exit_code(exc: BaseException) -> int:
    """The code an exception that ends the command gives: a signal's (`signal_exit_code`, read from the
    `signals.Interrupted`'s ``signum``), 2 for a `UsageError`, else 1."""
    if isinstance(exc, KeyboardInterrupt):
        return signal_exit_code(getattr(exc, "signum", None))
    if isinstance(exc, UsageError):
        return EXIT_USAGE
    return EXIT_FAILED
