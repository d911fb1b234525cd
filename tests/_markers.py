"""Skip markers for the two ways the kernel tests run: CPU tensors through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 unless the environment says otherwise), and compiled kernels on CUDA tensors (a GPU machine run
with TRITON_INTERPRET=0: the interpreter on CUDA tensors would test numpy again, slowly)."""

from __future__ import annotations

import os

import pytest
import torch

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="CPU Triton needs TRITON_INTERPRET=1")
compiled_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "0",
                                   reason="needs CUDA and TRITON_INTERPRET=0")
