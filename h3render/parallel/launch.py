"""One command for every GPU: spawn one process per GPU, and keep the ranks of a queue in lock-step.

`h3render prompt` / `h3render batch` started as a plain process on a machine with several GPUs re-launch themselves
as one process per GPU (the same RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR variables torchrun sets), so the code
below the CLI is the same under torchrun, srun and a plain start. Rank 0 owns the queue: it decides which jobs to
render (resume, skips), and each render is announced to the other ranks, which follow until told to stop.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from h3render.parallel.groups import ParallelContext, launcher_env, largest_dividing_world


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_world(requested: int | None, device: str | None, num_heads: int,
               env: dict[str, str] | None = None) -> tuple[int, str | None]:
    """How many ranks a plain start should spawn, and a warning when GPUs are left idle.

    Args:
        requested: `--gpus N`, or None for every visible GPU.
        device: "cpu": `requested` CPU processes (gloo; default 1), the testable form of the multi-rank path.
        num_heads: DiT attention heads (Ulysses splits whole heads; released 56).
        env: the launcher's environment (default: this process's).
    Raises:
        ValueError: `--gpus` larger than the visible GPU count, or < 1; a launcher environment that is malformed
            or, for several ranks, names no rendezvous (`check_rendezvous`), before anything loads.
    """
    env = dict(os.environ) if env is None else env
    if launcher_env(env)[1] > 1:
        check_rendezvous(env)
        return 1, None
    if requested is not None and requested < 1:
        raise ValueError(f"--gpus must be >= 1, got {requested}")
    if device == "cpu":
        # CPU processes (gloo) only when asked for: how the one-command multi-rank path is tested without GPUs.
        want = requested or 1
        world = largest_dividing_world(want, num_heads)
        warning = None
        if world != want:
            warning = (f"using {world} of {want} CPU processes: Ulysses splits the {num_heads} attention heads "
                       f"evenly, and {world} is the largest count <= {want} that divides {num_heads}")
        return world, warning
    available = visible_gpus()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--gpus must be >= 1, got {requested}")
        if requested > max(available, 1):
            raise ValueError(f"--gpus {requested}: only {available} GPU(s) visible")
    want = requested or max(available, 1)
    world = largest_dividing_world(want, num_heads)
    warning = None
    if world != want:
        warning = (f"using {world} of {want} GPUs: Ulysses splits the {num_heads} attention heads evenly, "
                   f"and {world} is the largest count <= {want} that divides {num_heads}")
    return world, warning


def check_rendezvous(env: dict[str, str]) -> None:
    """A multi-rank launch (torchrun, or srun with several tasks) needs MASTER_ADDR and MASTER_PORT: torchrun sets
    them, srun does not (scripts/h3render.sbatch exports them). Checked before any weights load: without it the
    ranks failed inside `init_process_group` (a missing port) or after the imports (a missing address).

    Raises:
        ValueError: naming the variable.
    """
    if not env.get("MASTER_ADDR", "").strip():
        raise ValueError("MASTER_ADDR is not set: a multi-rank run needs a rendezvous address (torchrun sets it; under "
                         "srun export MASTER_ADDR and MASTER_PORT, as scripts/h3render.sbatch does)")
    port = env.get("MASTER_PORT", "")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"MASTER_PORT={port!r} is not a TCP port (1-65535): a multi-rank run needs one beside "
                         f"MASTER_ADDR")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, fn: Callable[..., int], *args: Any, device: str | None = None) -> int:
    """Run `fn(*args)` in `world` processes with torchrun-style variables; returns rank 0's exit code.

    `device="cpu"` (gloo ranks): the ranks fork from this process, which has imported torch, transformers and the
    model code already; a spawned rank imports them again, about 5 s of CPU each before it does anything, which
    made most of a small multi-rank CPU run. GPU ranks are spawned (a fresh interpreter each): a child forked after
    this process touched CUDA (the memory plan reads the free memory) cannot use CUDA.

    The parent only waits: it ignores SIGINT/SIGTERM (a terminal's Ctrl-C and SLURM's SIGTERM reach every process
    of the group, and rank 0 handles them: temp files removed, report written, exit 130). Once rank 0 has exited,
    followers still blocked in a collective of an interrupted job get `FOLLOWER_GRACE_S` to leave, then are
    terminated, so the command never hangs. The parent keeps ignoring those signals after the ranks are done.
    """
    import signal

    import torch.multiprocessing as mp

    # The rendezvous goes to the ranks, not into this process's environment (a caller that spawns in-process, a
    # test worker say, would otherwise see a rendezvous address in every later command).
    rendezvous = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
                  "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port())}
    forked = device == "cpu"
    ctx = mp.get_context("fork" if forked else "spawn")
    code = ctx.Value("i", 1)
    leader_done = ctx.Value("b", 0)  # set by rank 0 once `fn` returned, before its process (and sockets) go
    procs = [ctx.Process(target=_child, args=(rank, world, code, leader_done, fn, args, rendezvous, forked),
                         daemon=False)
             for rank in range(world)]
    sys.stdout.flush()  # a forked rank inherits unflushed output and would print it again
    sys.stderr.flush()
    for p in procs:
        p.start()
    # SIGUSR1/2 too: the sbatch script forwards SLURM's warning to the whole process group (rank 0 handles it).
    previous = {sig: signal.signal(sig, signal.SIG_IGN)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        procs[0].join()
        for p in procs[1:]:
            p.join(FOLLOWER_GRACE_S)
            if p.is_alive():
                p.terminate()
                p.join()
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    # Rank 0 has exited: its code is the outcome, and its report says so. The handlers are not given back (the
    # CLI's would turn a signal now into "interrupted", exit 130, beside a report that says 0): the parent
    # ignores them until it exits (issue #28 item 6).
    if procs[0].exitcode != 0 and code.value == 0:
        return 1  # rank 0 died before reporting
    return code.value


# After rank 0 exits, how long followers may take to leave (they finish their part of the last collective).
FOLLOWER_GRACE_S = 30.0


def _child(rank: int, world: int, code, leader_done, fn, args, rendezvous: dict[str, str],
           forked: bool = False) -> None:
    import signal

    if forked:
        _as_if_spawned()
    os.environ.update(rendezvous, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    _thread_lock_for_tqdm()
    if rank != 0:
        # Rank 0 owns interrupts; a follower would only print a traceback from inside a collective (and die of
        # SIGUSR1's default action).
        for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
    try:
        result = fn(*args)
    except Exception as exc:
        if rank != 0 and leader_done.value:
            # Rank 0 stopped (a signal) while this rank was still loading, warming up or inside a job: its next
            # collective failed on the closed connection. Rank 0's report says what happened; one line here.
            print(f"h3render rank {rank}: stopped: rank 0 has exited ({type(exc).__name__}: {_first_line(exc)})",
                  file=sys.stderr)
            hard_exit(1)
        raise
    if rank == 0:
        code.value = int(result)
        leader_done.value = 1
    hard_exit(0 if rank != 0 else int(result))


def _as_if_spawned() -> None:
    """In a forked rank: the signal handlers a spawned rank starts with. The CLI's (inherited with the fork) raise
    in Python code, which a rank blocked in a collective never reaches: the parent's `terminate` of a stuck
    follower would not end it. Python's defaults again, except that a signal the parent's own start left ignored
    (a background job's SIGINT) stays ignored, as it would across exec."""
    import signal

    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a plain thread lock in this rank process. Its default lock adds a multiprocessing semaphore, which
    `hard_exit` (no interpreter teardown) never releases, so the parent's resource tracker warned "There appear to
    be N leaked semaphore objects" after every N-rank run; bars only draw on rank 0, no process shares them."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def hard_exit(code: int) -> None:
    """Leave a rank process without interpreter teardown.

    After a multi-rank run the outputs are closed and fsynced and the process group is destroyed, but a C++
    thread of the communication backend can still be joinable when static destructors run, which aborts the
    process ("terminate called without an active exception", seen in about 1 of 3 two-rank CPU runs) and turns
    a finished job into a failed exit code. Skipping the teardown avoids that.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------------------------------
# Leader / followers over a job queue


class LeaderRenderer:
    """Rank 0's renderer: announces each job to the followers, renders its own part, and fails the job on every
    rank if any rank failed (no rank is left waiting in a collective).

    Its `render` waits for the whole job, MP4 tail included, before the ranks compare how it went: the failure
    check is itself a collective, so every rank must reach it for the same job.
    """

    def __init__(self, renderer, ctx: ParallelContext):
        self.renderer = renderer
        self.ctx = ctx

    def render(self, job, mp4_path, sidecar_path):
        _broadcast(("render", job), self.ctx)
        error = None
        try:
            result = self.renderer.render(job, mp4_path, sidecar_path)
        except Exception as exc:  # reported below, after every rank has said how it went
            error = exc
            result = None
        failed = _any_failed(error is not None, self.ctx)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("the job failed on another rank (see that rank's log)")
        return result

    def stop(self) -> None:
        _broadcast(("stop", None), self.ctx)


def follow(renderer, ctx: ParallelContext) -> bool:
    """Followers: render whatever rank 0 announces until it says stop (True), or until rank 0 has left without
    saying so (False: a signal stopped it mid-job or between jobs, and its report says so; this rank's next
    collective failed on the closed connection, which is said in one line, not a traceback)."""
    while True:
        try:
            kind, job = _receive(ctx)
        except RuntimeError as exc:
            return _leader_gone(ctx, exc)
        if kind == "stop":
            return True
        failed = False
        try:
            renderer.render(job, os.devnull, os.devnull)
        except Exception as exc:
            failed = True
            error = exc
        try:
            _any_failed(failed, ctx)
        except RuntimeError as exc:
            return _leader_gone(ctx, exc)
        if failed:
            print(f"h3render rank {ctx.rank}: job failed: {type(error).__name__}: {error}", file=sys.stderr)


def _leader_gone(ctx: ParallelContext, exc: BaseException) -> bool:
    print(f"h3render rank {ctx.rank}: stopped: rank 0 left the queue ({type(exc).__name__}: {_first_line(exc)})",
          file=sys.stderr)
    return False


def _first_line(exc: BaseException) -> str:
    """An error's first line, at most 200 characters (a follower's one-line exit)."""
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _broadcast(message, ctx: ParallelContext) -> None:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=ctx.group)


def _receive(ctx: ParallelContext):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def _any_failed(failed: bool, ctx: ParallelContext) -> bool:
    flag = torch.tensor([1 if failed else 0], device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
    return bool(flag.item())
