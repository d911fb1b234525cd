"""Shards of a batch: `--shard i/n` and SLURM job arrays split one manifest's jobs between tasks."""

from __future__ import annotations

import re
from typing import Any, Mapping

from h3render.spec import is_int


_SLURM_INT = re.compile(r"[0-9]+", flags=re.ASCII)


def shard_jobs(jobs: list[Any], index: int, count: int) -> list[Any]:
    """The jobs of shard `index` (0-based) of `count`: job i goes to shard i % count, so the shards of any count
    cover every job exactly once and a shard's jobs keep manifest order.

    Raises:
        ValueError: count < 1 or index outside 0 … count − 1.
    """
    _check_shard(index, count)
    return [job for position, job in enumerate(jobs) if position % count == index]


def _check_shard(index: int, count: int) -> None:
    if not is_int(count) or count < 1:
        raise ValueError(f"shard count {count!r} must be a positive integer")
    if not is_int(index) or not 0 <= index < count:
        raise ValueError(f"shard index {index!r} must be within 0 … {count - 1} (shards are numbered from 0)")


def parse_shard(text: str) -> tuple[int, int]:
    """Parse `--shard i/n` (0-based i): "0/4" … "3/4" → (i, n).

    Raises:
        ValueError: not of the form i/n, or i outside 0 … n − 1.
    """
    # ASCII digits only: \d and int() also take other scripts' digits ("٠/٤" read as 0/4).
    match = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", text, flags=re.ASCII)
    if not match:
        raise ValueError(f'--shard {text!r} must look like "0/4" (0-based index / count)')
    index, count = int(match[1]), int(match[2])
    _check_shard(index, count)
    return index, count


def shard_from_slurm(env: Mapping[str, str]) -> tuple[int, int] | None:
    """The shard of a SLURM array task, or None outside an array job.

    index = (SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, count = SLURM_ARRAY_TASK_COUNT,
    so `--array=0-3`, `--array=1-4` and `--array=0-6:2` all give shards 0 … 3 of 4. MIN defaults to 0, STEP to 1.

    Raises:
        ValueError: a non-integer variable, a missing count, or an array that is not an evenly spaced range (e.g.
            `--array=1,4,9`): pass `--shard i/n` instead.
    """
    if not env.get("SLURM_ARRAY_TASK_ID"):
        return None
    values = {}
    for name, default in (("ID", None), ("COUNT", None), ("MIN", "0"), ("STEP", "1")):
        raw = env.get(f"SLURM_ARRAY_TASK_{name}", default)
        if raw is None:
            raise ValueError(f"SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_{name} is not; pass --shard i/n")
        if not _SLURM_INT.fullmatch(raw):  # SLURM writes plain decimal; int() would also take "1_0", "+3", "٣"
            raise ValueError(f"SLURM_ARRAY_TASK_{name}={raw!r} is not an integer")
        values[name] = int(raw)
    offset, step, count = values["ID"] - values["MIN"], values["STEP"], values["COUNT"]
    if step < 1 or offset % step or not 0 <= offset // step < max(count, 1):
        raise ValueError(f"SLURM array task {values['ID']} (min {values['MIN']}, step {step}, count {count}) is not "
                         f"part of an evenly spaced range; pass --shard i/n")
    index = offset // step
    _check_shard(index, count)
    return index, count
