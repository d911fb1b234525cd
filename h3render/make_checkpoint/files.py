"""Tensor files of the checkpoints and adapters that make-checkpoint writes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from safetensors.torch import save_file
from torch import Tensor


def save_tensors(tensors: Mapping[str, Tensor], path: Path | str, metadata: Mapping[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, then the mode a plain `open()` would have given (0o666 minus the umask).

    safetensors 0.8 creates its files 0600, which hides a checkpoint folder written for a cluster from everyone
    but its owner (seen 2026-12-01: every shard of `h3render make-checkpoint` came out -rw-------).
    """
    save_file(dict(tensors), str(path), metadata=dict(metadata) if metadata is not None else None)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
