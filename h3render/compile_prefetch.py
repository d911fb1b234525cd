"""Import torch's compile stack on a background thread while the weights load (issue 26, item 4).

The first `torch.compile` of a process (the video VAE decoder's blocks, in `Engine.prepare`) imports Dynamo's and
Inductor's modules and registers Inductor's ops before it traces anything: most of the 4.2 s the VAE compile took in
a new process on the H200 host with every on-disk cache warm (cProfile of that prepare: `torch.library` definitions
and `inductor_prims`, docs/performance.md §22). A SLURM array task pays it on every start. The load that comes first
spends its time in file reads and device copies, so the import runs beside it; the warm-up waits for it.
"""

from __future__ import annotations

import sys
import threading

_thread: threading.Thread | None = None
MODULE = "torch._inductor.compile_fx"  # pulls in Dynamo, AOTAutograd, Inductor's lowerings and its prims


def _import() -> None:
    try:
        __import__(MODULE)
    except Exception:  # noqa: BLE001  the compile in prepare then imports it again on its own thread, and raises there
        pass


def start() -> bool:
    """Begin the import on a daemon thread, once per process; False when it ran or is loaded already."""
    global _thread
    if _thread is not None or MODULE in sys.modules:
        return False
    _thread = threading.Thread(target=_import, name="h3render-compile-import", daemon=True)
    _thread.start()
    return True


def wait() -> None:
    """Block until a started import is done (a no-op when none was started)."""
    if _thread is not None:
        _thread.join()
