"""fl2va: a first and/or last keyframe, or pictures anchored at any frame index, condition the clip, beside the
prompt (a keyframe at frame 0 / F - 1 is diffusers' first / last image, bit for bit).

The recipe is diffusers 0.42.1's fl2va chain (research/conditioning.md §1), each step a tested component:

1. the job's keyframe files, re-read and checked against the sha256 recorded when the manifest was validated, put
   onto the job's canvas (`keyframes.prepare_keyframes`: leading one stretched, follower cover-cropped);
2. the prompt presented with one vision block per keyframe and encoded with the vision tower
   (`TextEncoder.encode_presentation`): text states `[N, text_dim]` and row tags (1 text, 0 vision block);
3. each keyframe through the video VAE encoder (`VideoVAE.encode_condition`: tiled, fp32, posterior sampled with
   its own seed-42 CPU generator): one normalized latent frame `[24, 1, H/16, W/16]`;
4. the packed layout `[text | keyframe rows | audio | target video]` (`packing.fl2va_layout`);
5. the job's CPU generator, seeded with the job's seed, draws the keyframe noise first (`packing.noise_keyframes`,
   t = 0.999), then the video and audio noise (`sampling.draw_noise`).

Every rank of a parallel render runs this for the same job (the keyframe work is milliseconds next to the DiT), so
the condition rows are just more rows of the layout that Ulysses shards like any other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from h3render import spec
from h3render.errors import RenderError
from h3render.keyframes import keyframe_pixels, load_keyframe, prepare_keyframe_list
from h3render.packing import fl2va_layout, noise_keyframes, patchify_video
from h3render.sampling import Schedule, draw_noise, schedule_timesteps
from h3render.tasks.base import BASE_PARTITION, Encoded, Prepared

NAME = "fl2va"
ENCODE_STAGE = "text + keyframes encode"
FEW_STEP = False  # the FastH3 students are t2va-only
PARTITION = BASE_PARTITION  # official layout: the FL2VA/ partition's transformer, the same DiT as t2va


class KeyframeChanged(ValueError):
    """A keyframe file's content differs from what the manifest validation hashed."""


def timesteps(schedule: Schedule) -> torch.Tensor:
    """Every distinct timestep of an fl2va job's forwards, `[K]` float32 ascending: the schedule's, plus the
    keyframe rows' `packing.condition_timestep` of every step (0.999)."""
    return schedule_timesteps(schedule.video, schedule.audio, keyframes=True)


def read_job_keyframes(job) -> list[Any]:
    """The job's keyframe files decoded again (`keyframes.Keyframe`), in packed order (`Job.keyframes`: by frame).

    Raises:
        KeyframeChanged: a file's sha256 is not the one recorded in the job (it was edited after validation).
        ValueError: the file can no longer be read or decoded (`keyframes.load_keyframe`).
    """
    loaded = []
    for ref in job.keyframes:
        keyframe = load_keyframe(ref.path, ref.anchor)
        if keyframe.sha256 != ref.sha256:
            raise KeyframeChanged(f"{ref.path}: {ref.label} changed since the job was validated (sha256 "
                                  f"{keyframe.sha256[:12]}... instead of {ref.sha256[:12]}...); run again")
        loaded.append(keyframe)
    return loaded


@torch.no_grad()
def prepare(engine, job, timer) -> Prepared:
    """Steps 1-5 of the module docstring for `job` on `engine` (`h3render.engine.Engine`), timing the prompt
    encode (vision tower included) as stage `text_encode` and the keyframe encode as `vae_encode`.

    Raises:
        RenderError: a keyframe changed since validation or can no longer be read.
        CheckpointError: the checkpoint has no vision tower or processor config (`Engine.ensure_vision`).
    """
    c, dev = engine.c, engine.device
    prepared, text, _, info = encode_keyframes(engine, job, timer)
    presentation = info["presentation_object"]
    with timer.stage("vae_encode"), engine.vae_on_device():
        latents = [c.video_vae.encode_condition(keyframe_pixels(image).to(dev)) for image in prepared.images]
    layout = fl2va_layout(presentation.tags, prepared.height, prepared.width, job.frames, prepared.anchors).to(dev)
    generator = torch.Generator("cpu").manual_seed(job.seed)
    rows = noise_keyframes(latents, generator)  # [Nc, 96]; drawn before the video and audio noise
    video_noise, audio_rows = draw_noise(generator, layout)
    record = {**{k: v for k, v in info.items() if k != "presentation_object"},
              "condition_rows": layout.num_condition_rows}
    return Prepared(text=text, layout=layout, output_layout=layout.target_layout(),
                    video_rows=patchify_video(video_noise[0]).to(dev), audio_rows=audio_rows.to(dev),
                    condition_rows=rows, record={"fl2va": record})


def encode_keyframes(engine, job, timer) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Steps 1-2 of the module docstring: the job's keyframes on its canvas (`keyframes.PreparedKeyframes`), the
    presented prompt's states `[N, text_dim]` on the device (stage `text_encode`: encoded now, or read back from the
    text phase's store, `Engine.encoded_text`), their row tags `[N]` and the sidecar's record of both (`keyframes`,
    `presentation`, `text_rows`, `image_tokens`; `presentation_object`: the `Presentation` itself, not for the
    sidecar).

    Raises:
        RenderError: a keyframe changed since validation or can no longer be read.
        CheckpointError: the checkpoint has no vision tower or processor config (`Engine.ensure_vision`).
    """
    if engine.c.text_encoder is not None:  # resident: the vision tower's first load is this job's warm-up, timed apart
        engine.ensure_vision(timer)
    prepared = _keyframes(engine, job)
    encoded = engine.encoded_text(job, timer)  # encoded now, or in the text phase
    text, presentation = encoded.states, encoded.extra  # [N, text_dim]
    givens = {ref.anchor: ref.given for ref in job.keyframes}
    info = {"keyframes": [{**item, "given": givens[item["anchor"]]} for item in prepared.info],
            "presentation": presentation.describe(), "text_rows": int(presentation.token_ids.numel()),
            "image_tokens": list(presentation.image_tokens), "presentation_object": presentation}
    return prepared, text, presentation.tags, info


def _keyframes(host, job):
    """The job's keyframes re-read, checked and put onto its canvas (`keyframes.prepare_keyframe_list`).

    Raises:
        RenderError: a keyframe changed since validation or can no longer be read.
    """
    try:
        loaded = read_job_keyframes(job)
    except ValueError as exc:
        raise RenderError(f"job {job.output!r}: {exc}") from None
    limits = host.c.info.release
    return prepare_keyframe_list(loaded, job.width, job.height, short_edge=limits.canvas_short_edge,
                                 max_pixels=limits.canvas_max_pixels)


def text_key(job):
    """What the presentation's encoding depends on: the prompt, the keyframes' content and anchors, the canvas."""
    return (NAME, job.prompt, tuple((ref.anchor, ref.sha256) for ref in job.keyframes), job.width, job.height)


def encode_text(host, job) -> Encoded:
    """Step 2 of the module docstring on `host` (the engine, or `text_phase.TextHost`): the presentation's states
    `[N, text_dim]` on its device, with the `Presentation` as `extra`. Loads the vision tower first if needed.

    Raises:
        RenderError: a keyframe changed since validation or can no longer be read.
        CheckpointError: the checkpoint has no vision tower or processor config.
    """
    host.ensure_vision(None)
    prepared = _keyframes(host, job)
    text, presentation = host.c.text_encoder.encode_presentation(job.prompt, prepared.images)
    return Encoded(text, presentation)


def warm_job(job):
    """The job the engine warms this task up on before the queue (`Engine.prepare` runs `prepare` on it and one DiT
    forward): `job` itself on the shortest clip, so the vision tower's load, the presentation encode of the job's
    own keyframes on its canvas and the Triton specialization of the longer row count stay out of the first fl2va
    job, at milliseconds of DiT time.

    Keyframes anchored at frame indices (`--keyframe 240:mid.png`) move onto the short clip in their order, spread
    at least 4 pixel frames apart (one latent frame each): left at 240 they were past its last frame, and the warm-up
    failed after the load, and with it every job of a batch whose first fl2va job had one."""
    keyframes = job.keyframes
    frames = spec.snap_frames_up(4 * max(len(keyframes) - 1, 1) + 1)  # 5 for one or two keyframes
    if not job.frame_keyframes:
        return replace(job, frames=frames)
    spread = {id(ref): round(i * (frames - 1) / max(len(keyframes) - 1, 1)) for i, ref in enumerate(keyframes)}
    moved = tuple(replace(ref, anchor=spread[id(ref)]) for ref in job.frame_keyframes)
    return replace(job, frames=frames, frame_keyframes=moved)
