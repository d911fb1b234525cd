"""Run a test function on N spawned CPU ranks (gloo) and bring their results back by value.

Results travel as `torch.save` bytes, not as tensors: torch's multiprocessing pickler would send a tensor as a
shared-memory handle that the parent opens through the child's resource sharer, and a rank that has already exited
(it puts its result, then tears down) leaves the parent with EOFError. That race failed CI once (2026-12-01).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
from typing import Iterator

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_rank(rank: int, port: int, world: int) -> Iterator:
    """In a rank: join a `world`-rank gloo group on 127.0.0.1:`port` with one intra-op thread (the ranks share the
    cores) and yield this rank's `h3render.parallel.groups.ParallelContext` on the CPU; leave the group after."""
    import torch.distributed as dist

    from h3render.parallel.groups import ParallelContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield ParallelContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                              group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def put_result(queue, obj) -> None:
    """Called in a rank: send `obj` (tensors, tuples, ints) by value."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    queue.put(buf.getvalue())


# The ranks start from a fork server that has imported torch, transformers and the model code once (per test
# process): a spawned rank re-imports them, ~4-6 s of CPU each, which on CI's two cores was most of a 2-rank test's
# cost. A fork server is single-threaded and holds no process group, so its children start as clean as spawned ones.
_PRELOAD = ["torch", "torch.distributed", "h3render.parallel.groups", "h3render.models.dit",
            "h3render.checkpoint.load", "h3render.cli", "h3render.engine", "h3render.runner", "h3render.media",
            "tests._spawn", "tests._cli"]


def context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(target, world: int, args: tuple = (), results: int | None = None, timeout: float = 180) -> list:
    """Start `target(rank, port, *args, queue)` on `world` ranks (forked from a server that has preloaded torch and
    h3render); return the `results` objects they put (default: one per rank), then check that every rank exited 0."""
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        out = [torch.load(io.BytesIO(queue.get(timeout=timeout))) for _ in range(world if results is None else results)]
    finally:
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * world
    return out
