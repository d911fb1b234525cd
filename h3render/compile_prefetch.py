"""Import torch's compile stack on a background thread while the weights load (issue 26, item 4).

The first `torch.compile` of a process (the video VAE decoder's bf16 blocks, in `Engine.prepare`; FP8 blocks run
eagerly, `VideoVAE.compile_pays`) imports Dynamo's and Inductor's modules and registers Inductor's ops before it
traces anything: most of the 4.2 s the VAE compile took in a new process on the H200 host with every on-disk cache
warm (cProfile of that prepare: `torch.library` definitions and `inductor_prims`, docs/performance.md §22). A SLURM
array task pays it on every start. `Engine.load` of a non-fp8 run starts the import once its own imports are done
(they share many modules with this one, and two threads importing the same modules only take turns), just before the
weights stream, which is file reads and device copies; the warm-up waits for it and records what went wrong, if
anything.
"""

from __future__ import annotations

import sys
import threading

import torch

_thread: threading.Thread | None = None
_error: BaseException | None = None
MODULE = "torch._inductor.compile_fx"  # pulls in Dynamo, AOTAutograd, Inductor's lowerings and its prims
WAIT_S = 300.0  # an import that long is stuck: the compile then imports on the main thread, where it raises


def _import(device: torch.device | None) -> None:
    global _error
    try:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # whatever the import touches, on this rank's GPU, not on GPU 0
        __import__(MODULE)
    except BaseException as exc:  # noqa: BLE001  kept for `wait`, which reports it; the compile imports again
        _error = exc


def wanted(device_type: str, compile_vae: bool, precision: str) -> bool:
    """Whether a load should start the import: on CUDA, with `compile_vae`, and not for fp8, whose video decoder
    blocks run their fused kernels eagerly (`models.video_vae.VideoVAE.compile_pays`), so nothing compiles."""
    return device_type == "cuda" and compile_vae and precision != "fp8"


def start(device: torch.device | None = None) -> bool:
    """Begin the import on a daemon thread, once per process; False when it ran or is loaded already."""
    global _thread
    if _thread is not None or MODULE in sys.modules:
        return False
    _thread = threading.Thread(target=_import, args=(device,), name="h3render-compile-import", daemon=True)
    _thread.start()
    return True


def wait(timeout: float = WAIT_S) -> str | None:
    """Block until a started import is done (at most `timeout` seconds); None when it succeeded or none was started,
    else what went wrong, one line (the caller records it and compiles anyway)."""
    if _thread is None:
        return None
    _thread.join(timeout)
    if _thread.is_alive():
        return f"the compile stack's background import was still running after {timeout:.0f} s"
    if _error is not None:
        return f"the compile stack's background import failed: {type(_error).__name__}: {_error}"[:300]
    return None
