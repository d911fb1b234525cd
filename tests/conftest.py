import os

# Triton kernels run under the interpreter on CPU-only machines (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
