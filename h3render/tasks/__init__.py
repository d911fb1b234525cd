"""The task seam: what conditions a job's generation, one module per task.

A task module has:

    NAME           the `Job.task` it renders ("t2va", "fl2va")
    ENCODE_STAGE   the progress label of its encode stage ("text encode", "text + keyframes encode")
    FEW_STEP       whether the FastH3 few-step students can render it (they are t2va students)
    PARTITION      the checkpoint's DiT partition it runs (`base.BASE_PARTITION`; ref2va: "transformer_ref")
    timesteps(schedule) -> [K] float32   every distinct timestep its forwards see (the AdaLN tables' rows)
    text_key(job) -> hashable        what its text conditioning depends on (equal keys share one encode)
    encode_text(host, job) -> Encoded   its text conditioning on `host.c.text_encoder` (the engine, or
                                    `text_phase.TextHost` in the phased memory plans' text phase, issue #27)
    prepare(engine, job, timer) -> Prepared   text rows (`engine.encoded_text(job, timer)`), layout, noise,
                                    condition rows, sidecar record
    warm_job(job) -> Job            the cheap job (same canvas, shortest clip) the engine's warm-up runs the task's
                                    own `prepare` and one DiT forward on, so first-call costs stay out of job timings

and optionally, for a job rendered in several windows (`windows_of`):

    windows(job) -> (window jobs, plan)   the windows to render in order and where each sits in the MP4
                                          (`h3render.windows.Window`); without it a job is one window
    follow(window, previous) -> window    the window to prepare, given the previous window's `render.Latents`
                                          (continuation: its tail latents condition the next window)

`render.generate` and `Engine.prepare` call these and nothing task-specific, so the next task (ref2va, windowed
continuation) is one more module here plus its job fields; `render.py`, `engine.py` and `sampling.py` stay as they
are (tests/e2e/test_task_seam.py adds a toy task that way).
"""

from __future__ import annotations

from types import ModuleType

from h3render.errors import RenderError
from h3render.tasks import continuation, fl2va, ref2va, t2va

TASKS: dict[str, ModuleType] = {module.NAME: module for module in (t2va, fl2va, ref2va, continuation)}


def task_of(job) -> ModuleType:
    """The task module that renders `job` (by `job.task`).

    Raises:
        RenderError: no task of that name is installed.
    """
    name = getattr(job, "task", "t2va")
    try:
        return TASKS[name]
    except KeyError:
        raise RenderError(f"job {getattr(job, 'output', '?')!r}: task {name!r} is not one of "
                          f"{', '.join(sorted(TASKS))}") from None


def windows_of(job) -> tuple[tuple, tuple | None]:
    """The windows `job` renders in, in order, and their plan (`h3render.windows.Window` each; None: back to
    back): `(job,), None` unless the job's task splits it (`windows`)."""
    split = getattr(task_of(job), "windows", None)
    return split(job) if split is not None else ((job,), None)
