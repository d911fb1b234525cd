"""The command's own stderr lines: `say` prints on the launcher's rank 0 only; `status` puts a transient line on a
terminal that the next line printed erases (`end_status`). Torch-free: an error line prints at once."""

from __future__ import annotations

import sys

_status_shown = False


def say(message: str) -> None:
    """Print on the launcher's rank 0 only (under torchrun/srun every rank parses the command line). A rank variable
    that is no number (RANK=x) prints everywhere: the rank is unknown, and the one check (`plan_ranks`) refuses the
    variable as a usage error, whose line must print rather than raise a second ValueError from its handler."""
    if _rank0():
        end_status()
        print(message, file=sys.stderr)


def status(message: str) -> None:
    """On a terminal only: `message` on a line that the next line printed (`say`, `end_status`) erases. The checks
    after parsing import torch and transformers (about 5 s), in which the command said nothing; an error found
    there is still its one line, and a log never sees this."""
    global _status_shown
    if sys.stderr.isatty() and _rank0():
        sys.stderr.write(message)
        sys.stderr.flush()
        _status_shown = True


def end_status() -> None:
    """Erase the status line, if one stands (before output that does not go through `say`)."""
    global _status_shown
    if _status_shown:
        sys.stderr.write("\r\033[K")
        _status_shown = False


def _rank0() -> bool:
    from h3render.parallel.launcher import launcher_env

    try:
        return launcher_env()[0] == 0
    except ValueError:
        return True
