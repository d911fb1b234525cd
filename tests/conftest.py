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
