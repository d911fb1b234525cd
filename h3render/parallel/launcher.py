"""The launcher's view of this process (torchrun's or srun's variables), torch-free: the command line reads it to
print on rank 0 only, before anything heavy is imported; `h3render.parallel.groups` joins the ranks it names."""

from __future__ import annotations

import os


def launcher_env(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or srun's variables; (0, 1, 0) for a plain process.

    Raises:
        ValueError: a variable is set but is not a non-negative integer, or rank >= world_size.
    """
    env = dict(os.environ) if env is None else env

    def _int(name: str) -> int:
        try:
            value = int(env[name])
        except ValueError:
            raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
        if value < 0:
            raise ValueError(f"environment variable {name}={value} is negative")
        return value

    if "WORLD_SIZE" in env and "RANK" in env:
        rank, world, local = _int("RANK"), _int("WORLD_SIZE"), _int("LOCAL_RANK") if "LOCAL_RANK" in env else 0
    elif "SLURM_NTASKS" in env and "SLURM_PROCID" in env and _int("SLURM_NTASKS") > 1:
        # srun with several tasks: one task per GPU. A one-task srun/sbatch step is a plain process.
        rank, world = _int("SLURM_PROCID"), _int("SLURM_NTASKS")
        local = _int("SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    else:
        return 0, 1, 0
    if world < 1 or rank >= world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    return rank, world, local
