"""ref2va: ordered references condition the clip, beside the prompt; the Ref2VA DiT (`transformer_ref`) runs it.

The recipe is diffusers 0.42.1's ref2va chain (research/conditioning.md §2), each step a tested component:

1. the job's reference files, re-read and checked against the sha256 recorded when the job was validated; each
   image put on its own encode size (`references.fit_reference_image`: short edge `reference_short_edge`, released
   2048, LANCZOS); references never set the canvas (the job's, 16:9 unless given);
2. the prompt presented with one `"<Picture i>: "` label and vision block per image, in request order, and encoded
   with the vision tower (`TextEncoder.encode_presentation`, as fl2va: the image-only presentation is the same);
3. each image through the video VAE encoder (`VideoVAE.encode_condition`: one latent frame at the image's own size,
   posterior sampled with its own seed-42 CPU generator);
4. the packed layout `[text | reference blocks | target audio | target video]` on the shared rotary clock
   (`ref_packing.ref2va_layout`);
5. the job's CPU generator draws one noise per visual reference first (`packing.noise_conditions`, t = 0.999), then
   the target video and audio noise (`sampling.draw_noise`).

Video references (the conditioner's per-block video presentation) and audio-bearing references (the audio VAE's
encoder) are validated (`job_references`) but not rendered yet: the front end refuses them before anything loads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from h3render import spec
from h3render.errors import RenderError
from h3render.keyframes import keyframe_pixels
from h3render.packing import REFERENCE_AUDIO_T, noise_conditions, patchify_video
from h3render.ref_packing import ReferenceBlock, ref2va_layout
from h3render.references import fit_reference_image, load_image_reference
from h3render.sampling import Schedule, draw_noise, schedule_timesteps
from h3render.tasks.base import Prepared

NAME = "ref2va"
ENCODE_STAGE = "text + references encode"
FEW_STEP = False  # the FastH3 students are t2va-only
PARTITION = "transformer_ref"  # official layout: Ref2VA/transformer/


def timesteps(schedule: Schedule) -> torch.Tensor:
    """Every distinct timestep of a ref2va job's forwards, `[K]` float32 ascending: the schedule's, the visual
    references' `packing.condition_timestep` of every step (0.999) and the reference audio's 1.0 (tabulated even
    for a job without audio references: one AdaLN row more, so one table serves every ref2va job of a schedule)."""
    base = schedule_timesteps(schedule.video, schedule.audio, keyframes=True)
    return torch.unique(torch.cat([base, torch.tensor([REFERENCE_AUDIO_T], dtype=torch.float32)]), sorted=True)


class ReferenceChanged(ValueError):
    """A reference file's content differs from what the job's validation hashed."""


def read_job_images(job) -> list:
    """The job's image references decoded again (`references.load_image_reference`), request order.

    Raises:
        ReferenceChanged: a file's sha256 is not the one recorded in the job (edited after validation).
        ValueError: the file can no longer be read or decoded; a type this module cannot render.
    """
    images = []
    for ref in job.references:
        if ref.type != "image":
            raise ValueError(f"{ref.given}: {ref.type} references are not rendered by h3render yet")
        image = load_image_reference(ref.path)
        if image.sha256 != ref.sha256:
            raise ReferenceChanged(f"{ref.path}: reference changed since the job was validated (sha256 "
                                   f"{image.sha256[:12]}... instead of {ref.sha256[:12]}...); run again")
        images.append(image)
    return images


@torch.no_grad()
def prepare(engine, job, timer) -> Prepared:
    """Steps 1-5 of the module docstring for `job` on `engine`, timing the presentation encode (vision tower
    included) as stage `text_encode` and the reference encode as `vae_encode`.

    Raises:
        RenderError: a reference changed since validation or can no longer be read.
        CheckpointError: no vision tower or processor config (`Engine.ensure_vision`); no `transformer_ref`.
    """
    c, dev = engine.c, engine.device
    engine.ensure_vision(timer)
    try:
        loaded = read_job_images(job)
    except ValueError as exc:
        raise RenderError(f"job {job.output!r}: {exc}") from None
    short_edge = c.info.release.reference_short_edge
    images = [fit_reference_image(image.image, short_edge) for image in loaded]
    with timer.stage("text_encode"):
        text, presentation = c.text_encoder.encode_presentation(job.prompt, images)  # "<Picture i>: " + vision
        text = text.to(dev)  # [N, text_dim]
    with timer.stage("vae_encode"):
        latents = [c.video_vae.encode_condition(keyframe_pixels(image).to(dev)) for image in images]  # [24,1,h,w]
    blocks = [ReferenceBlock("image", 1, latent.shape[-2], latent.shape[-1]) for latent in latents]
    layout = ref2va_layout(presentation.tags, blocks, job.height, job.width, job.frames).to(dev)
    generator = torch.Generator("cpu").manual_seed(job.seed)
    rows = noise_conditions(latents, generator)  # one draw per visual reference, before the target noise
    target = layout.target_layout()
    video_noise, audio_rows = draw_noise(generator, target)
    record = {
        "references": [{"index": i + 1, "type": ref.type, "path": ref.path, "given": ref.given,
                        "sha256": ref.sha256, "duration_s": None, "size": [ref.info["width"], ref.info["height"]],
                        "encoded_size": list(image.size), "used": "image"}
                       for i, (ref, image) in enumerate(zip(job.references, images))],
        "presentation": presentation.describe(),
        "text_rows": int(presentation.token_ids.numel()),
        "image_tokens": list(presentation.image_tokens),
        "condition_rows": layout.num_condition_rows,
        "condition_audio_rows": layout.num_condition_audio_rows,
        "partition": PARTITION,
    }
    return Prepared(text=text, layout=layout, output_layout=target,
                    video_rows=patchify_video(video_noise[0]).to(dev), audio_rows=audio_rows.to(dev),
                    condition_rows=rows, partition=PARTITION, record={"ref2va": record})


def warm_job(job):
    """The job the engine warms this task up on (`Engine.prepare` runs `prepare` on it and one DiT forward of the
    `transformer_ref` partition, loading it): `job` itself on the shortest clip."""
    return replace(job, frames=spec.FRAMES_REMAINDER)
