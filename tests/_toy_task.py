"""A toy third task for tests/e2e/test_task_seam.py: t2va with the seed shifted by the job's `seed_offset`.

It is what a new task is: one module with the task interface (`h3render.tasks`), registered in `tasks.TASKS`, and a
job that names it. Nothing in render.py, engine.py or sampling.py knows it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from h3render.jobs import Job
from h3render.tasks import t2va

NAME = "t2va-seed-offset"
ENCODE_STAGE = "text encode"
FEW_STEP = True
PARTITION = t2va.PARTITION
timesteps = t2va.timesteps
text_key = t2va.text_key  # the prompt alone conditions it, as t2va
encode_text = t2va.encode_text
calls: list[str] = []  # what the job path asked of this task, in order


@dataclass(frozen=True)
class OffsetJob(Job):
    """A `Job` of the toy task: its own field, `seed_offset`, is part of its params (the resume key)."""

    seed_offset: int = 0

    @property
    def task(self) -> str:
        return NAME

    def params(self):
        return {**super().params(), "task": NAME, "seed_offset": self.seed_offset}


def prepare(engine, job, timer):
    calls.append(f"prepare {job.frames}")
    base = Job(**{f: getattr(job, f) for f in Job.__dataclass_fields__})
    return t2va.prepare(engine, replace(base, seed=job.seed + job.seed_offset), timer)


def warm_job(job):
    return t2va.warm_job(job)
