import os

# Triton kernels run under the interpreter on CPU-only machines (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

# The AdaLN table cache (h3render.adaln_cache) of this test process and the renders it starts: a fresh folder, never
# the user's ~/.cache.
if "H3RENDER_ADALN_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["H3RENDER_ADALN_CACHE"] = tempfile.mkdtemp(prefix="h3render-adaln-")
    atexit.register(shutil.rmtree, os.environ["H3RENDER_ADALN_CACHE"], ignore_errors=True)

# Under pytest-xdist every core already runs a worker: one intra-op thread per worker (and per render subprocess it
# starts, which inherits this) instead of each of them spinning up a thread per core and contending for the cores.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def pytest_configure(config):
    """Under pytest-xdist, on an install whose modules are not byte-compiled yet (.ci/run installs without it):
    import the heavy modules every worker imports, once, here in the controller before the workers start, so that
    the .pyc files are written once instead of by each worker at the same time (on two cores, four workers each
    compiling torch and transformers for about 16 s of CPU)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    import importlib.util

    spec = importlib.util.find_spec("torch")  # top level: finding it imports nothing
    if spec is None or spec.origin is None or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return
    import h3render.cli  # noqa: F401
    import h3render.engine  # noqa: F401
    import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: F401
