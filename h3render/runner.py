"""Running a resolved run on 1..N ranks: plan the ranks, spawn them (or join torchrun's), load the engine once per
rank, then rank 0 renders (`h3render prompt`: one job; `h3render batch`: the queue) and the others follow it.

The CLI hands over a checked `RunSettings` and resolved jobs; nothing here parses options. Imports torch when a
function runs (the CLI's `--help` stays torch-free).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from h3render.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_REQUEUE
from h3render.settings import RunSettings, SettingsError

_ran_distributed = False  # set once this process took part in a multi-rank run


def ran_distributed() -> bool:
    """Whether this process was a rank of a multi-rank run (then it must leave through `parallel.launch.hard_exit`)."""
    return _ran_distributed


@dataclass(frozen=True)
class Queue:
    """`h3render batch`'s queue arguments for `batch.run_batch` (the resume key is `RunSettings.record()`)."""

    out_dir: str
    shard: tuple[int, int] | None = None
    overwrite: bool = False
    fail_fast: bool = False
    resume: str | None = None  # the command that resumes the queue (`batch.run_batch`'s `resume`)


def plan_ranks(run: RunSettings, heads: int) -> tuple[int, str | None]:
    """How many ranks to run (`parallel.launch.plan_world`: --gpus, the visible GPUs, heads divisible), and a
    warning when some are left idle.

    Raises:
        SettingsError: --gpus < 1 or more than the visible GPUs.
    """
    from h3render.parallel.launch import plan_world

    try:
        return plan_world(run.gpus, run.device, heads)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def run_jobs(run: RunSettings, jobs: Sequence, world: int, heads: int, *, quiet: bool = False,
             single: tuple[Path, Path] | None = None, queue: Queue | None = None) -> int:
    """Render `jobs` on `world` ranks (spawned here when > 1); rank 0's exit code.

    Args:
        run: checked settings (`RunSettings.check`).
        heads: the DiT's attention heads (Ulysses splits whole heads).
        single: `h3render prompt`'s (MP4, sidecar) for its one job; else `queue` runs `jobs` as a batch.
    """
    if queue is not None and not to_render(jobs, queue):
        # A resumed queue with every job rendered: no ranks to start, no weights to load, no torch to import (7 s
        # before a trial's "nothing to render" report).
        from h3render.batch import run_batch

        return run_batch(list(jobs), _never_loaded, queue.out_dir, overwrite=queue.overwrite,
                         fail_fast=queue.fail_fast, quiet=quiet, shard=queue.shard, render_order=render_order(jobs),
                         current=run.record(), resume=queue.resume).exit_code
    if world > 1:
        from h3render.parallel.launch import spawn

        return spawn(world, _rank_main, run, list(jobs), heads, quiet, single, queue, device=run.device)
    return _rank_main(run, list(jobs), heads, quiet, single, queue)


def _rank_main(run: RunSettings, jobs: list, heads: int, quiet: bool, single, queue: Queue | None) -> int:
    """Every rank: join the group, load once, then rank 0 runs the queue and the others follow it."""
    import torch

    from h3render.batch import run_batch
    from h3render.engine import Engine
    from h3render.parallel.groups import init_parallel, largest_dividing_world, restrict, shutdown
    from h3render.parallel.launch import LeaderRenderer, follow

    ctx = init_parallel(run.device)
    if ctx.distributed:
        global _ran_distributed
        _ran_distributed = True
    if ctx.device.type == "cpu":
        # Random tiny weights drive activations into denormal floats, which x86 CPUs process 10-100x slower;
        # flushing them to zero left the rendered frames byte-identical in our runs.
        torch.set_flush_denormal(True)
    usable = largest_dividing_world(ctx.world_size, heads)
    if usable != ctx.world_size:
        if ctx.is_main:
            print(f"h3render: warning: using {usable} of {ctx.world_size} ranks: Ulysses splits the {heads} attention "
                  f"heads evenly; ranks {usable}..{ctx.world_size - 1} sit this run out", file=sys.stderr)
        ctx = restrict(ctx, usable)
        if ctx is None:
            shutdown()
            return EXIT_OK
    run = replace(run, progress=_progress(ctx.is_main and not quiet, single=single is not None))

    def load():
        # A queue with t2va jobs beside a student adapter renders them on the base weights first, then fuses the
        # student once (Engine.fuse_student) for the fasth3 jobs.
        said = ctx.is_main and not quiet  # a real checkpoint loads for minutes: say so, and when it is done
        if said:  # through the progress object: on a terminal, above batch's queue bar
            fp8 = " (fp8 DiT)" if run.precision == "fp8" else ""
            ranks = f" x {ctx.world_size}" if ctx.distributed else ""
            run.progress.write(f"h3render: loading {run.checkpoint}{fp8} on {ctx.device.type}{ranks}, then warming "
                               f"up ...")
        t0 = time.perf_counter()
        base_first = run.adapter is not None and any(j.mode == "t2va" for j in jobs)
        engine = Engine.load(run, ctx, base_jobs_first=base_first, jobs=to_render(jobs, queue))
        engine.prepare(distinct_setups(jobs))
        if said:
            run.progress.write(f"h3render: loaded and warmed up in {time.perf_counter() - t0:.1f} s")
        return engine

    # Whether the followers wait for rank 0's next word: after a signal (or an error outside a job) they may be
    # inside one of the job's collectives, where a "stop" broadcast would hang both sides (Ctrl-C on `--gpus 2` hung
    # until killed). Then rank 0 leaves without it, and the followers' next collective fails on its closed
    # connection (`follow` ends quietly; the spawn parent, torchrun or srun ends what is left).
    in_step = False
    try:
        if not ctx.is_main:
            in_step = follow(load(), ctx)
            return EXIT_OK
        loaded = []

        def factory():
            r = load()
            loaded.append(r)
            return LeaderRenderer(r, ctx) if ctx.distributed else r

        try:
            if single is not None:
                code = _render_single(factory, jobs[0], *single, quiet=quiet)
            else:
                report = run_batch(jobs, factory, queue.out_dir, overwrite=queue.overwrite,
                                   fail_fast=queue.fail_fast, quiet=quiet, shard=queue.shard,
                                   render_order=render_order(jobs), current=run.record(), resume=queue.resume)
                code = report.exit_code
            in_step = code not in (EXIT_INTERRUPTED, EXIT_REQUEUE)
            return code
        finally:
            if ctx.distributed and in_step:
                if not loaded:  # followers are waiting to load; let them load and stop
                    factory()
                LeaderRenderer(loaded[0], ctx).stop()
    finally:
        if in_step or not ctx.distributed:
            shutdown()


def _progress(shown: bool, single: bool):
    """Stage progress (h3render.progress): bars on a terminal (under batch's queue bar, one row down); in a log a
    line per stage for `prompt`, and for `batch` (which logs a line per job) only stages of 10 s or longer."""
    from h3render.progress import Progress

    if not shown:
        return Progress("off")
    if sys.stderr.isatty():
        return Progress("bar", position=0 if single else 1)
    return Progress("lines" if single else "slow")


def _render_single(factory, job, mp4: Path, sidecar: Path, *, quiet: bool = False) -> int:
    """`h3render prompt`: one job. The renderer writes `<name>.tmp.mp4` / sidecar temp files and renames them on
    success; on failure or Ctrl-C nothing is left under either name, nor a folder made for them that is still empty.
    `quiet`: no "wrote" line (errors still print)."""
    from h3render.outputs import make_folders, remove_empty_folders, temp_paths
    from h3render.report import remove_files

    made = make_folders(mp4.parent)  # only these may go again: a folder that was there before stays
    t0 = time.perf_counter()
    rendered = False
    try:
        factory().render(job, mp4, sidecar)
        rendered = True
    except KeyboardInterrupt:
        print("h3render: interrupted; no output written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"h3render: failed: {type(exc).__name__}: {first}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if not rendered:  # `-o out/new/x.mp4` left an empty `out/new/` behind (a trial)
            remove_files(*temp_paths(mp4, sidecar))
            remove_empty_folders(made)
    if not quiet:
        print(f"h3render: wrote {mp4} and {sidecar} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return EXIT_OK


def _never_loaded():
    """The engine factory of a queue found complete: only reached when its outputs changed since that check (another
    process removed one); those jobs then fail with this line and the next run renders them."""
    from h3render.errors import RenderError

    raise RenderError("the queue's outputs changed after it was found complete (another process?); run it again")


def to_render(jobs, queue: Queue | None) -> list:
    """The jobs the queue will render (resume: finished, current ones left out), for the text phase of the phased
    and streamed memory plans, which encodes only those."""
    if queue is None:
        return list(jobs)
    from h3render.outputs import output_paths, render_reason

    out = Path(queue.out_dir)
    return [j for j in jobs if render_reason(j, *output_paths(out, j), overwrite=queue.overwrite) is not None]


def distinct_setups(jobs):
    """One representative job per distinct (schedule, canvas, length, window plan): AdaLN tables are built, the VAE
    warmed (a bf16 one compiled) for its batch sizes and the audio decode's CUDA graphs captured for each before the
    first job, outside job timings. The window and overlap set the windows' lengths, which set those batch sizes and
    graph lengths."""
    seen, out = set(), []
    for job in jobs:
        key = (job.mode, job.task, job.steps, job.width, job.height, job.frames, job.window, job.overlap)
        if key not in seen:
            seen.add(key)
            out.append(job)
    return out


def render_order(jobs: list) -> list[int]:
    """The order a queue renders in (indices into `jobs`; the report keeps the manifest's): t2va / fl2va jobs
    first, then the ref2va jobs (their own DiT partition: one swap where the device cannot hold both), then fasth3
    (a student adapter is fused in place once, after the base jobs); within each group jobs grouped by LoRA set in
    order of first appearance, so a queue alternating two sets switches the DiT once per set rather than once per
    job (issue #25). Stable otherwise."""
    first_seen: dict = {}
    for job in jobs:
        first_seen.setdefault(job.lora_set, len(first_seen))
    return sorted(range(len(jobs)), key=lambda i: (jobs[i].mode == "fasth3", jobs[i].task == "ref2va",
                                                   first_seen[jobs[i].lora_set]))
