"""The value rules of a FastH3 adapter's tensors (issue #28 item 7), apart from its names and shapes
(`h3render.checkpoint.adapter`): what the checkpoint loader refuses in a checkpoint, the adapter loader refuses in
an adapter, naming the adapter file and the tensor.

- dtype, from the header alone: every fused tensor (LoRA factors, diffs, assigned gates) is floating point. A
  cast would turn stored integers or booleans (a quantized or corrupt export) into garbage weights silently, as
  ``checkpoint.stream`` says for checkpoint tensors. An alpha scalar may be an integer (it is a count-like
  number, read as a value and never fused).
- values, from the data: finite, and no entry above `MAX_ABS`. A NaN or Inf factor (or a NaN VSA gate) made
  every job fail later with "non-finite latents" naming nothing; a fused weight that overflows is refused too.

`scan_file` checks every value in the CLI's one check, before any weights load, in the same single pass over the
file that computes its sha256 (the sidecar's `extra.fasth3.sha256`, which the load used to read the whole file for
anyway). The digest is remembered (`known_digest`) so the load in the same process does not hash again: the
adapter is read twice per run (the check, then the fusion), as it was before the check (the hash, then the fusion).
Measured (CPU time, one thread, page cache warm, a 1.23 GB bf16 file): hashing alone 1.1 GB/s, the scan 0.9-1.0
GB/s, i.e. the value check adds 0.2 s per 1.23 GB. The released VSA adapter is 5.3 GB (vsa.md §2) of a ~130 GB load:
the check adds about 1 s of CPU and no I/O (a separate value pass would have added 5.3 GB of reads, a third pass).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
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
    if t.element_size() == 1:
        t = t.float()  # fp8: CPU kernels for abs/max on it are not a given
    # One reduction for the common, good case (aminmax: 2.5x faster than abs().max() on bf16 here); both propagate
    # NaN, so the bound fails for NaN and Inf too.
    if not t.numel():
        return
    low, high = torch.aminmax(t)
    if -MAX_ABS <= float(low) and float(high) <= MAX_ABS:
        return
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


# safetensors' dtype names -> torch dtypes (the format's own table; little-endian, as the format states).
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# The digests `scan_file` computed, by the file's identity (device, inode, size, modification time in ns): a file
# rewritten after the check is hashed again.
_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def known_digest(path: Path) -> str | None:
    """The sha256 `scan_file` computed for this very file (same identity), else None."""
    try:
        return _DIGESTS.get(_identity(path))
    except OSError:
        return None


def scan_file(path: Path, what: Callable[[str], str] = lambda key: "") -> str:
    """One sequential pass over a safetensors file: its sha256, and every floating-point tensor's values checked
    (`check_values`; ``what(key)`` says what the tensor is). The header must already have been read and validated
    by `safetensors.safe_open` (`read_adapter` does): this reads the data in the order it is stored.

    hashlib and torch both release the GIL on large buffers: a helper thread hashes tensor i while this thread checks
    it and reads tensor i + 1 (two tensors in memory at most), so the scan takes about as long as the hash alone.

    Returns: the file's sha256 (hex), also remembered for `known_digest`.
    Raises:
        AdapterError: the first bad tensor (as `check_values`), or a file that changed under the scan.
    """
    identity = _identity(path)
    digest = hashlib.sha256()
    with ThreadPoolExecutor(1, thread_name_prefix="h3render-adapter-sha256") as hasher:
        pending = [hasher.submit(lambda: None)]

        def hash_in_order(data) -> None:
            pending[0].result()  # the previous piece is hashed (and its buffer free) before the next is queued
            pending[0] = hasher.submit(digest.update, data)

        with path.open("rb") as stream:
            head = stream.read(8)
            hash_in_order(head)
            header_bytes = stream.read(int.from_bytes(head, "little"))
            hash_in_order(header_bytes)
            try:
                header = json.loads(header_bytes)
                header.pop("__metadata__", None)
                tensors = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from None
            position = 0
            for key, entry in tensors:
                begin, end = entry["data_offsets"]
                if begin > position:
                    hash_in_order(stream.read(begin - position))
                data = bytearray(end - begin)
                if stream.readinto(data) != len(data):
                    raise AdapterError(f"{path}: tensor {key!r}: the file ends inside its data (changed while read?)")
                hash_in_order(data)
                position = end
                dtype = _TORCH_DTYPES.get(entry["dtype"])
                if dtype is not None and data:
                    check_values(path, key, torch.frombuffer(data, dtype=dtype), what(key))
            for chunk in iter(lambda: stream.read(1 << 23), b""):
                hash_in_order(chunk)
        pending[0].result()
    _DIGESTS[identity] = digest.hexdigest()
    return _DIGESTS[identity]
