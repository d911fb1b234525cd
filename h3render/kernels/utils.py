"""Launch sizes and backend choice shared by every kernel folder.

`calculate_settings` is the one place that turns a problem width into a block size and warp count, in the manner
of Liger Kernel's `ops/utils.py`. `use_triton_for` decides per call whether the Triton launcher or the plain-torch
reference runs.
"""

from __future__ import annotations

import os

import torch

# Triton caps one block at 2**16 elements; every fused width here (hidden 5376, head dim 128) is far below it.
MAX_FUSED_SIZE = 65536


def interpreting() -> bool:
    """Whether Triton launches run in its CPU interpreter (TRITON_INTERPRET=1, which the tests set) rather than
    compiled: kernels pick interpreter-safe forms of a few operations on it (fp8 rounding, sin, fp32 upcasts)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def calculate_settings(n: int) -> tuple[int, int]:
    """Block size and warp count for a kernel whose program covers `n` contiguous elements.

    Returns:
        (BLOCK, num_warps): BLOCK = next power of two >= n; num_warps grows with BLOCK so that each thread holds
        at most ~32 fp32 values (4 warps up to 2048 elements, 8 up to 8192, 16 up to 32768, then 32).

    Raises:
        ValueError: n exceeds MAX_FUSED_SIZE (one row no longer fits one block).
    """
    block = next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"kernel row of {n} elements exceeds the fused limit of {MAX_FUSED_SIZE}")
    if block >= 32768:
        num_warps = 32
    elif block >= 8192:
        num_warps = 16
    elif block >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    return block, num_warps


def triton_available() -> bool:
    """True when `import triton` works (CUDA torch wheels ship it; CPU installs may not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton_for(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Whether a kernel call on `x` runs the Triton launcher.

    Args:
        x: the call's main input tensor.
        use_triton: None picks Triton exactly when `x` is on CUDA; True forces it (CPU tensors then need
            TRITON_INTERPRET=1, which the tests set); False forces the plain-torch reference.

    Raises:
        ValueError: Triton is forced or `x` is on CUDA but triton cannot be imported.
    """
    want = x.is_cuda if use_triton is None else bool(use_triton)
    if want and not triton_available():
        raise ValueError("triton is not installed: pass use_triton=False to run the torch reference")
    return want


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels address rows by stride but assume unit stride along the last axis."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tuple(t.stride())}")
