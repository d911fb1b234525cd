"""Run a test function on N spawned CPU ranks (gloo) and bring their results back by value.

Results travel as `torch.save` bytes, not as tensors: torch's multiprocessing pickler would send a tensor as a
shared-memory handle that the parent opens through the child's resource sharer, and a rank that has already exited
(it puts its result, then tears down) leaves the parent with EOFError. That race failed CI once (2026-12-01).
"""

from __future__ import annotations

import io
import socket

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def put_result(queue, obj) -> None:
    """Called in a rank: send `obj` (tensors, tuples, ints) by value."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    queue.put(buf.getvalue())


def run_ranks(target, world: int, args: tuple = (), results: int | None = None, timeout: float = 180) -> list:
    """Start `target(rank, port, *args, queue)` on `world` spawned ranks; return the `results` objects they put
    (default: one per rank), then check that every rank exited 0."""
    ctx = mp.get_context("spawn")
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
