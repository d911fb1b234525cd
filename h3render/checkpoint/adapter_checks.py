"""The value rules of a FastH3 adapter's tensors (issue #28 item 7), apart from its names and shapes
(`h3render.checkpoint.adapter`): what the checkpoint loader refuses in a checkpoint, the adapter loader refuses in
an adapter, naming the adapter file and the tensor.

- dtype, from the header alone: every fused tensor (LoRA factors, diffs, assigned gates) is floating point. A
  cast would turn stored integers or booleans (a quantized or corrupt export) into garbage weights silently, as
  ``checkpoint.stream`` says for checkpoint tensors. An alpha scalar may be an integer (it is a count-like
  number, read as a value and never fused).
- values, from the data: finite, and no entry above `MAX_ABS`. A NaN or Inf factor (or a NaN VSA gate) made
  every job fail later with "non-finite latents" naming nothing; a fused weight that overflows is refused too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from h3render.checkpoint.errors import AdapterError

# safetensors' dtype names of the floating-point types (the header's ``dtype``), as `safe_open` reports them.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "float64", "float32", "float16",
                          "bfloat16", "float8_e4m3fn", "float8_e5m2"})
# float16's largest finite value: a larger adapter entry overflows once the fused weight is cast to fp16, and no
# trained factor, diff or gate comes within orders of magnitude of it (the released students stay below 10).
MAX_ABS = 65504.0


def _plain(dtype: str) -> str:
    return dtype.removeprefix("torch.")


def check_dtypes(path: Path, entries: Mapping[str, "object"], alpha_keys: frozenset[str]) -> None:
    """Header-only: every tensor but an alpha is floating point.

    Args:
        entries: file key -> an entry with ``dtype`` (the header's).
        alpha_keys: the file keys of alpha scalars (an integer alpha is allowed; a boolean one is not).
    Raises:
        AdapterError: naming the file, the tensor and its dtype.
    """
    for key, entry in entries.items():
        dtype = _plain(entry.dtype)
        if dtype in FLOAT_DTYPES:
            continue
        if key in alpha_keys and dtype.upper() not in ("BOOL",):
            continue
        raise AdapterError(f"{path}: tensor {key!r} is stored as {dtype}; adapter tensors must be floating point "
                           f"(refusing to cast integers or booleans into weights, as the checkpoint loader does)")


def check_values(path: Path, key: str, tensor: torch.Tensor, what: str = "") -> None:
    """Finite and within `MAX_ABS`. ``what`` says what the tensor is (e.g. "the VSA gate of block 3").

    Raises:
        AdapterError: naming the file, the tensor, what is wrong and where (the first bad entry's index).
    """
    t = tensor.detach()
    if not t.is_floating_point():
        return  # an integer alpha (`check_dtypes` allowed only those)
    finite = torch.isfinite(t)
    label = f"tensor {key!r}" + (f" ({what})" if what else "")
    if not bool(finite.all()):
        index = int((~finite).flatten().nonzero()[0])
        value = float(t.flatten()[index])
        raise AdapterError(f"{path}: {label} holds {'NaN' if value != value else value} at flat index {index} "
                           f"({int((~finite).sum())} non-finite of {t.numel()}); refusing a corrupt adapter")
    if t.numel():
        peak = float(t.abs().max())
        if peak > MAX_ABS:
            raise AdapterError(f"{path}: {label} has an entry of magnitude {peak:.3g}, above {MAX_ABS:g} (float16's "
                               f"largest); no trained adapter comes near it: refusing a corrupt adapter")


def check_fused(path: Path, native_name: str, weight: torch.Tensor) -> None:
    """The weight after the adapter's contribution (fp32) is finite and within `MAX_ABS`: factors within bounds can
    still give a product far outside any trained weight (a fused entry of 1e10 renders noise, or overflows fp16).

    Raises:
        AdapterError: naming the file and the parameter.
    """
    peak = float(weight.abs().max()) if weight.numel() else 0.0
    if not peak <= MAX_ABS:  # NaN compares false
        raise AdapterError(f"{path}: fusing the adapter into {native_name!r} gives non-finite weights or entries of "
                           f"magnitude {peak:.3g} (above {MAX_ABS:g}): its factors' product is corrupt; refusing it")
