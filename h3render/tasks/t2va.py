"""t2va: the prompt alone conditions the clip. Text rows, then audio, then video (`packing.t2va_layout`); one CPU
generator seeded with the job's seed draws the video noise, then the audio noise (`sampling.draw_noise`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from h3render.packing import patchify_video, t2va_layout
from h3render.sampling import Schedule, draw_noise, schedule_timesteps
from h3render.spec import FRAMES_REMAINDER
from h3render.tasks.base import BASE_PARTITION, Encoded, Prepared
from h3render.text_graph import encode_prompt

NAME = "t2va"
ENCODE_STAGE = "text encode"  # the progress line of `prepare`
FEW_STEP = True  # the FastH3 students (4 / 8 forwards) are t2va students
PARTITION = BASE_PARTITION


def timesteps(schedule: Schedule) -> torch.Tensor:
    """Every distinct timestep a t2va job's forwards see, `[K]` float32 ascending (the AdaLN tables' rows)."""
    return schedule_timesteps(schedule.video, schedule.audio)


@torch.no_grad()
def prepare(engine, job, timer) -> Prepared:
    """Encode the prompt (stage `text_encode`), lay out the rows and draw the noise for `job` on `engine`'s device.

    Args:
        engine: `h3render.engine.Engine` (its components `c` and `device`).
        job: `h3render.jobs.Job`.
        timer: `h3render.timing.StageTimer` of the job.
    """
    dev = engine.device
    text = engine.encoded_text(job, timer).states  # [Nt, text_dim]: encoded now, or in the text phase
    layout = t2va_layout(text.shape[0], job.height, job.width, job.frames).to(dev)
    video_noise, audio_rows = draw_noise(job.seed, layout)  # CPU generator, as released
    return Prepared(text=text, layout=layout, output_layout=layout, video_rows=patchify_video(video_noise[0]).to(dev),
                    audio_rows=audio_rows.to(dev))


def text_key(job):
    """What the encoding depends on (jobs with equal keys share one encode in the text phase)."""
    return (NAME, job.prompt)


def encode_text(host, job) -> Encoded:
    """The prompt's text-encoder states `[Nt, text_dim]` on `host`'s device (`host.c.text_encoder`).

    Raises:
        ValueError: an empty prompt or one with no tokens (`TextEncoder.tokenize`).
    """
    # Padded to its token bucket and replayed from the engine's graph when it has one (`h3render.text_graph`); the
    # text phase's host (`text_phase.TextHost`) has none and runs the same padded encode eagerly.
    return Encoded(encode_prompt(host.c.text_encoder, job.prompt, getattr(host, "text_graphs", None)))


def warm_job(job):
    """The job the engine warms this task up on (`Engine.prepare`): `job` itself on the shortest clip."""
    return replace(job, frames=FRAMES_REMAINDER)
