"""Process groups for 1..N ranks: one code path under torchrun, srun, or a plain single process.

Rank discovery follows the launchers' own variables: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (+ MASTER_ADDR /
MASTER_PORT); srun sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID. A plain process is rank 0 of 1.

Every collective runs with a timeout, so a rank that dies or hangs fails the job on all ranks instead of hanging the
queue (default 600 s: longer than one FastH3 job at release size, far shorter than an unattended night).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from h3render.parallel.launcher import launcher_env

# Long enough for the slowest legitimate wait (rank 0 encoding an MP4 while the others wait at the next job's
# barrier), short enough that a dead rank is reported within minutes.
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits among the ranks of one render.

    Attributes:
        rank: global rank, 0..world_size-1. Rank 0 owns the queue, the sidecars and the MP4 writing.
        world_size: number of ranks taking part.
        local_rank: rank within the node; selects the CUDA device.
        device: this rank's torch device.
        group: the process group (None when world_size == 1).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_parallel(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Join the ranks named by the launcher's environment (or run alone) and pick this rank's device.

    Args:
        device: "cuda" or "cpu"; None picks cuda when available.
        timeout_s: collective timeout in seconds.

    Returns:
        The ParallelContext; NCCL on CUDA, gloo on CPU.
    """
    rank, world, local = launcher_env()
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if world == 1:
        return ParallelContext(0, 1, 0, dev, None)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            # srun does not set a rendezvous address; the batch script exports it (scripts/h3render.sbatch).
            raise ValueError("MASTER_ADDR/MASTER_PORT must be set for a multi-rank run (torchrun sets them)")
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
    return ParallelContext(rank, world, local, dev, dist.group.WORLD)


def largest_dividing_world(world_size: int, num_heads: int) -> int:
    """The largest rank count <= world_size that divides num_heads (Ulysses splits whole heads).

    56 heads (released): 1, 2, 4, 7, 8 ranks work as they are; 3 → 2, 5 or 6 → 4.
    """
    for n in range(min(world_size, num_heads), 0, -1):
        if num_heads % n == 0:
            return n
    return 1


def restrict(ctx: ParallelContext, size: int) -> ParallelContext | None:
    """The first `size` ranks as a new group (every rank must call this); None on the ranks left out.

    Used when the launcher started more ranks than Ulysses can use (the world size must divide the head count):
    those ranks sit the render out.
    """
    if size >= ctx.world_size:
        return ctx
    group = dist.new_group(list(range(size)))
    if ctx.rank >= size:
        return None
    return ParallelContext(ctx.rank, size, ctx.local_rank, ctx.device, group)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
