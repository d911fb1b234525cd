"""fl2va conditioning of one job: keyframes -> prompt presentation + text states, condition latents, layout, noise.

The recipe is diffusers 0.42.1's fl2va chain (research/conditioning.md §1), each step a tested component:

1. the job's keyframe files, re-read and checked against the sha256 recorded when the manifest was validated, put
   onto the job's canvas (`keyframes.prepare_keyframes`: leading one stretched, follower cover-cropped);
2. the prompt presented with one vision block per keyframe and encoded with the vision tower
   (`TextEncoder.encode_presentation`): text states `[N, text_dim]` and row tags (1 text, 0 vision block);
3. each keyframe through the video VAE encoder (`VideoVAE.encode_condition`: tiled, fp32, posterior sampled with
   its own seed-42 CPU generator): one normalized latent frame `[24, 1, H/16, W/16]`;
4. the packed layout `[text | keyframe rows | audio | target video]` (`packing.fl2va_layout`);
5. the job's CPU generator, seeded with the job's seed, draws the keyframe noise first (`packing.noise_keyframes`,
   t = 0.999); the caller then draws the video and audio noise from the same generator (`sampling.draw_noise`).

Every rank of a parallel render runs this for the same job (the keyframe work is milliseconds next to the DiT), so
the condition rows are just more rows of the layout that Ulysses shards like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from h3render.keyframes import keyframe_pixels, load_keyframe, prepare_keyframes
from h3render.packing import ConditionedLayout, fl2va_layout, noise_keyframes


class KeyframeChanged(ValueError):
    """A keyframe file's content differs from what the manifest validation hashed."""


@dataclass(eq=False)
class Condition:
    """What an fl2va job adds to the t2va flow.

    Attributes:
        text: `[N, text_dim]` text-encoder states of the presentation, on the engine's device.
        layout: the `ConditionedLayout` on the engine's device.
        rows: `[Nc, 96]` float32 noised keyframe rows on the device (fixed for the whole loop).
        generator: the job's CPU generator after the keyframe noise; draw the video and audio noise from it next.
        record: the sidecar's `extra.fl2va`: each keyframe (path, size, sha256, how it was resized) and the prompt
            presentation.
    """

    text: torch.Tensor
    layout: ConditionedLayout
    rows: torch.Tensor
    generator: torch.Generator
    record: dict[str, Any] = field(default_factory=dict)


def read_job_keyframes(job) -> dict[str, Any]:
    """The job's keyframe files decoded again, as `{"first": Keyframe | None, "last": Keyframe | None}`.

    Raises:
        KeyframeChanged: a file's sha256 is not the one recorded in the job (it was edited after validation).
        ValueError: the file can no longer be read or decoded (`keyframes.load_keyframe`).
    """
    loaded: dict[str, Any] = {"first": None, "last": None}
    for ref in job.keyframes:
        keyframe = load_keyframe(ref.path, ref.anchor)
        if keyframe.sha256 != ref.sha256:
            raise KeyframeChanged(f"{ref.path}: {ref.anchor}_frame changed since the job was validated (sha256 "
                                  f"{keyframe.sha256[:12]}... instead of {ref.sha256[:12]}...); run again")
        loaded[ref.anchor] = keyframe
    return loaded


@torch.no_grad()
def prepare_condition(engine, job, timer) -> Condition:
    """Run steps 1-5 of the module docstring for `job` on `engine` (`h3render.engine.Engine`), timing the prompt
    encode (vision tower included) as stage `text_encode` and the keyframe encode as `vae_encode`.

    Raises:
        KeyframeChanged, ValueError: as `read_job_keyframes`.
        CheckpointError: the checkpoint has no vision tower or processor config (`Engine.ensure_vision`).
    """
    c, dev = engine.c, engine.device
    engine.ensure_vision(timer)
    loaded = read_job_keyframes(job)
    limits = c.info.release
    prepared = prepare_keyframes(loaded["first"], loaded["last"], job.width, job.height,
                                 short_edge=limits.canvas_short_edge, max_pixels=limits.canvas_max_pixels)
    with timer.stage("text_encode"):
        text, presentation = c.text_encoder.encode_presentation(job.prompt, prepared.images)
        text = text.to(dev)  # [N, text_dim]
    with timer.stage("vae_encode"):
        latents = [c.video_vae.encode_condition(keyframe_pixels(image).to(dev)) for image in prepared.images]
    layout = fl2va_layout(presentation.tags, prepared.height, prepared.width, job.frames, prepared.anchors)
    generator = torch.Generator("cpu").manual_seed(job.seed)
    rows = noise_keyframes(latents, generator)  # [Nc, 96]; drawn before the video and audio noise
    givens = {ref.anchor: ref.given for ref in job.keyframes}
    record = {
        "keyframes": [{**info, "given": givens[info["anchor"]]} for info in prepared.info],
        "presentation": presentation.describe(),
        "text_rows": int(presentation.token_ids.numel()),
        "image_tokens": list(presentation.image_tokens),
        "condition_rows": layout.num_condition_rows,
    }
    return Condition(text=text, layout=layout.to(dev), rows=rows, generator=generator, record=record)
