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

Audio clips (32 kHz) are labelled `"<Audio j>: "` in the presentation (their waveform never reaches the
conditioner), cut to the target's duration, made stereo, encoded by the audio VAE (posterior mean, normalized) and
put clean, at t = 1.0, in front of the target audio. Video references (the conditioner's per-block video
presentation) and other sample rates (diffusers resamples with torchaudio) are validated (`job_references`) but not
rendered yet: the front end refuses them before anything loads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from h3render import spec
from h3render.errors import RenderError
from h3render.keyframes import keyframe_pixels
from h3render.packing import REFERENCE_AUDIO_T, audio_to_rows, noise_conditions, patchify_video
from h3render.ref_packing import ReferenceBlock, ref2va_layout
from h3render.references import (AUDIO_RATE, decode_audio, fit_reference_image, load_image_reference, normalize_audio,
                                 probe_sha256)
from h3render.sampling import Schedule, draw_noise, schedule_timesteps
from h3render.tasks.base import Encoded, Prepared

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


def read_job_references(job) -> list:
    """The job's references decoded again, request order: an image as `keyframes.Keyframe`
    (`references.load_image_reference`), an audio clip as its `[2, samples]` 32 kHz waveform cut to the job's
    duration (`references.decode_audio`, `normalize_audio`).

    Raises:
        ReferenceChanged: a file's sha256 is not the one recorded in the job (edited after validation).
        ValueError: the file can no longer be read or decoded; a type this module cannot render.
    """
    loaded = []
    for ref in job.references:
        if ref.type not in ("image", "audio"):
            raise ValueError(f"{ref.given}: {ref.type} references are not rendered by h3render yet")
        try:
            sha256 = probe_sha256(ref.path)
        except OSError as exc:
            raise ValueError(f"{ref.path}: cannot read the reference any more ({exc.strerror or exc})") from None
        if sha256 != ref.sha256:
            raise ReferenceChanged(f"{ref.path}: reference changed since the job was validated (sha256 "
                                   f"{sha256[:12]}... instead of {ref.sha256[:12]}...); run again")
        if ref.type == "image":
            loaded.append(load_image_reference(ref.path))
        else:
            loaded.append(normalize_audio(*decode_audio(ref.path), job.frames))
    return loaded


@torch.no_grad()
def prepare(engine, job, timer) -> Prepared:
    """Steps 1-5 of the module docstring for `job` on `engine`, timing the presentation encode (vision tower
    included) as stage `text_encode` and the reference encode as `vae_encode`.

    Raises:
        RenderError: a reference changed since validation or can no longer be read.
        CheckpointError: no vision tower or processor config (`Engine.ensure_vision`); no `transformer_ref`.
    """
    c, dev = engine.c, engine.device
    if c.text_encoder is not None:  # resident: the vision tower's first load is this job's warm-up, timed apart
        engine.ensure_vision(timer)
    loaded, kinds, images = _references(engine, job)
    encoded_text = engine.encoded_text(job, timer)  # encoded now, or in the text phase
    text, presentation = encoded_text.states.to(dev), encoded_text.extra  # [N, text_dim]
    with timer.stage("vae_encode"), engine.vae_on_device():
        latents = [c.video_vae.encode_condition(keyframe_pixels(image).to(dev)) for image in images]  # [24,1,h,w]
        sounds = [audio_to_rows(c.audio_vae.encode(item.to(dev))) for kind, item in zip(kinds, loaded)
                  if kind == "audio"]  # [2 * Tref, 32] each: the posterior mean, normalized, channel-major
    pictures, clips, blocks = iter(latents), iter(sounds), []
    for kind in kinds:
        if kind == "image":
            latent = next(pictures)
            blocks.append(ReferenceBlock("image", 1, latent.shape[-2], latent.shape[-1]))
        else:
            blocks.append(ReferenceBlock("audio", audio_latents=next(clips).shape[0] // 2))
    layout = ref2va_layout(presentation.tags, blocks, job.height, job.width, job.frames).to(dev)
    generator = torch.Generator("cpu").manual_seed(job.seed)
    rows = noise_conditions(latents, generator)  # one draw per visual reference, before the target noise
    target = layout.target_layout()
    video_noise, audio_rows = draw_noise(generator, target)
    encoded = iter(images)
    record = {
        "references": [_reference_record(i + 1, ref, item, encoded, job.frames)
                       for i, (ref, item) in enumerate(zip(job.references, loaded))],
        "presentation": presentation.describe(),
        "text_rows": int(presentation.token_ids.numel()),
        "image_tokens": list(presentation.image_tokens),
        "condition_rows": layout.num_condition_rows,
        "condition_audio_rows": layout.num_condition_audio_rows,
        "partition": PARTITION,
    }
    return Prepared(text=text, layout=layout, output_layout=target,
                    video_rows=patchify_video(video_noise[0]).to(dev), audio_rows=audio_rows.to(dev),
                    condition_rows=rows, audio_condition_rows=torch.cat(sounds).float() if sounds else None,
                    partition=PARTITION, record={"ref2va": record})


def _references(host, job):
    """The job's reference files re-read and checked (`read_job_references`), their kinds in request order, and the
    images put on their encode size (`references.fit_reference_image`).

    Raises:
        RenderError: a reference changed since validation or can no longer be read.
    """
    try:
        loaded = read_job_references(job)
    except ValueError as exc:
        raise RenderError(f"job {job.output!r}: {exc}") from None
    kinds = [ref.type for ref in job.references]
    short_edge = host.c.info.release.reference_short_edge
    images = [fit_reference_image(item.image, short_edge) for kind, item in zip(kinds, loaded) if kind == "image"]
    return loaded, kinds, images


def text_key(job):
    """What the presentation's encoding depends on: the prompt and the references (content and order)."""
    return (NAME, job.prompt, tuple((ref.type, ref.sha256, ref.use_audio) for ref in job.references))


def encode_text(host, job) -> Encoded:
    """Step 2 of the module docstring on `host` (the engine, or `text_phase.TextHost`): `"<Picture i>: "` + vision
    block per image, `"<Audio j>: "` per audio clip, request order, then the prompt; the states `[N, text_dim]` with
    the `Presentation` as `extra`. Loads the vision tower first if needed.

    Raises:
        RenderError: a reference changed since validation or can no longer be read.
    """
    host.ensure_vision(None)
    _, kinds, images = _references(host, job)
    text, presentation = host.c.text_encoder.encode_presentation(job.prompt, images, kinds)
    return Encoded(text, presentation)


def _reference_record(index: int, ref, item, encoded, frames: int) -> dict:
    """One reference for the sidecar's `extra.ref2va.references` (docs/sidecar.md)."""
    out = {"index": index, "type": ref.type, "path": ref.path, "given": ref.given, "sha256": ref.sha256}
    if ref.type == "image":
        return {**out, "duration_s": None, "size": [ref.info["width"], ref.info["height"]],
                "encoded_size": list(next(encoded).size), "used": "image"}
    used, target = item.shape[-1] / AUDIO_RATE, frames / spec.FPS
    cut = ref.info.get("audio_duration_s") is None or ref.info["audio_duration_s"] > used + 1e-3
    how = f"the clip cut to the {target:.3f} s target" if cut else f"all of it; the target is {target:.3f} s"
    return {**out, "duration_s": ref.info.get("audio_duration_s"), "sample_rate": ref.info.get("sample_rate"),
            "channels": ref.info.get("channels"), "used": f"audio: first {used:.3f} s ({how}), stereo"}


def warm_job(job):
    """The job the engine warms this task up on (`Engine.prepare` runs `prepare` on it and one DiT forward of the
    `transformer_ref` partition, loading it): `job` itself on the shortest clip."""
    return replace(job, frames=spec.FRAMES_REMAINDER)
