"""continuation: a clip longer than one pass, rendered as windows that each continue the one before.

The plan is `h3render.windows` (window length, overlap and why). Window 0 is a plain t2va render of its length with
the job's seed, bit for bit what rendering that clip alone gives. Window i > 0 (seed + i) is the fl2va machinery with
the previous window's last K latent frames as its condition rows (vLLM-Omni's latent-tail continuation, PR #7838):

1. the prompt encoded as t2va does (stage `text_encode`);
2. the layout `[text | K tail latent frames | audio | target video]` (`packing.fl2va_layout`), the tail's frames
   anchored at the window's latent frames 0 .. K - 1 (`spec.latent_first_frame`), so each tail latent sits where
   the window regenerates it and keeps its place in the VAE's 1, 4, 4, 4, 4 frame grouping (K = 5j + 2);
3. the window's CPU generator draws the tail's noise first, one latent frame at a time, and the tail rows are noised
   once to t = 0.999 as keyframes are (`packing.noise_keyframes`), then the video and audio noise
   (`sampling.draw_noise`).

The clip's keyframes (`keyframes:`, first / last frame) go to the windows they fall in, at their frame there
(`window_keyframes`): window 0 is then a plain fl2va render; a later window adds fl2va's keyframe rows after the
tail's, with the prompt presented with their pictures (`fl2va.encode_keyframes`).

Each window regenerates its K overlap latents; the MP4 cross-fades the overlap's frames and samples (`seams`).
Positions restart at every window (each window is a clip of the trained length; vLLM-Omni's PR #7838 shifts them by
the window's start instead, beyond the trained range).

Not conditioned on: the previous window's audio. The model takes reference audio only through the Ref2VA DiT
(`transformer_ref`, research/conditioning.md §2.5), which main does not load yet; audio carries across by the
cross-fade alone. FastH3 students are t2va students: their windows are plain t2va windows (seed + i), joined by the
cross-fade only, and the sidecar's windows say so (task "t2va").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import replace
from typing import Any

import torch

from h3render.packing import TEXT_TAG, fl2va_layout, noise_keyframes, patchify_video
from h3render.sampling import Schedule, draw_noise, schedule_timesteps
from h3render.spec import FRAMES_REMAINDER, SPATIAL_COMPRESSION, VIDEO_LATENT_CHANNELS, latent_first_frame
from h3render.keyframes import keyframe_pixels
from h3render.tasks import fl2va, t2va
from h3render.tasks.base import BASE_PARTITION, Encoded, Prepared

NAME = "continuation"
ENCODE_STAGE = "text encode"
FEW_STEP = True  # a fasth3 clip renders plain t2va windows (`windows`), which the students can
PARTITION = BASE_PARTITION
SEED_MODULUS = 2**64  # window i draws with seed + i, wrapped into torch.Generator's range


def timesteps(schedule: Schedule) -> torch.Tensor:
    """Every distinct timestep of a conditioned window's forwards, `[K]` float32 ascending: the schedule's plus the
    tail rows' `packing.condition_timestep` (0.999), as fl2va."""
    return schedule_timesteps(schedule.video, schedule.audio, keyframes=True)


@functools.cache
def _window_type(base: type) -> type:
    """A frozen dataclass subclass of the job's own class (`h3render.jobs.Job`, which this layer does not import)
    for windows i > 0: `window_index`, `tail_latents` (K) and `tail` (the previous window's last K video latent
    frames `[24, K, h, w]`, set by `follow`; not part of the job's identity)."""

    def task(self) -> str:
        return NAME

    def params(self) -> dict[str, Any]:
        return {**base.params(self), "task": NAME, "window_index": self.window_index,
                "tail_latents": self.tail_latents}

    return dataclasses.make_dataclass(
        "ContinuationWindow",
        [("window_index", int, 1), ("tail_latents", int, 0),
         ("tail", Any, dataclasses.field(default=None, compare=False, repr=False))],
        bases=(base,), frozen=True, eq=False, namespace={"task": property(task), "params": params})


def window_keyframes(job, window) -> tuple:
    """The job's keyframes that fall in `window` (`windows.Window`), re-anchored at their frame in it (a keyframe in
    an overlap conditions both windows; the job's last frame lies inside its last window)."""
    inside = []
    for ref in job.keyframes:
        frame = ref.frame(job.frames) - window.start
        if 0 <= frame < window.frames:
            inside.append(replace(ref, anchor=frame))
    return tuple(inside)


def windows(job) -> tuple[tuple, tuple]:
    """The windows of `job` (`job.windows`, its plan) as jobs: window 0 a plain job of its length with the job's
    seed (fl2va when a keyframe falls in it); window i > 0 seeded seed + i, conditioned on the previous window's
    tail (and its keyframes) unless the job is fasth3."""
    plan = job.windows
    out = []
    for w in plan:
        plain = replace(job, frames=w.frames, seed=(job.seed + w.index) % SEED_MODULUS, window=None, overlap=0,
                        first_frame=None, last_frame=None, frame_keyframes=window_keyframes(job, w))
        if w.index == 0 or job.mode == "fasth3":
            out.append(plain)
        else:
            fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(plain) if f.init}
            out.append(_window_type(type(job))(**fields, window_index=w.index, tail_latents=w.tail_latents))
    return tuple(out), plan


def follow(window, previous) -> Any:
    """`window` with its tail: the last `tail_latents` latent frames of the previous window's video latents
    (`render.Latents.video` `[24, T, h, w]`)."""
    if not getattr(window, "tail_latents", 0):
        return window
    return replace(window, tail=previous.video[:, -window.tail_latents:].detach())


@torch.no_grad()
def prepare(engine, job, timer) -> Prepared:
    """Steps 1-3 of the module docstring for a window with a tail; a window without one is t2va's `prepare`.

    Raises:
        RenderError: as t2va's.
    """
    tail = getattr(job, "tail", None)
    if tail is None:
        return fl2va.prepare(engine, job, timer) if job.keyframes else t2va.prepare(engine, job, timer)
    dev = engine.device
    count = tail.shape[1]
    anchors = tuple(latent_first_frame(k) for k in range(count))
    latents = [tail[:, k:k + 1].to(dev) for k in range(count)]  # [24, 1, h, w] each
    record: dict[str, Any] = {"conditioned_on": f"the last {count} latent frames of window {job.window_index - 1}"}
    if job.keyframes:  # the clip's keyframes in this window: fl2va's rows after the tail's
        keyframes, text, tags, info = fl2va.encode_keyframes(engine, job, timer)
        anchors += keyframes.anchors
        with timer.stage("vae_encode"):
            latents += [engine.c.video_vae.encode_condition(keyframe_pixels(image).to(dev))
                        for image in keyframes.images]
        record.update(keyframes=info["keyframes"], presentation=info["presentation"])
    else:
        text = engine.encoded_text(job, timer).states  # [Nt, text_dim]: encoded now, or in the text phase
        tags = torch.full((text.shape[0],), TEXT_TAG, dtype=torch.int64)
    layout = fl2va_layout(tags, job.height, job.width, job.frames, anchors).to(dev)
    generator = torch.Generator("cpu").manual_seed(job.seed)
    rows = noise_keyframes(latents, generator)  # [Nc, 96]: the tail's, then the keyframes'
    video_noise, audio_rows = draw_noise(generator, layout)
    record = {"continuation": {**record, "anchor_frames": list(anchors), "condition_rows": layout.num_condition_rows,
                               "audio": "not conditioned (cross-fade only; reference audio needs the Ref2VA DiT)"}}
    return Prepared(text=text, layout=layout, output_layout=layout.target_layout(),
                    video_rows=patchify_video(video_noise[0]).to(dev), audio_rows=audio_rows.to(dev),
                    condition_rows=rows, record=record)


def text_key(job):
    """What a window's text conditioning depends on: its prompt (t2va's key), or its prompt, keyframes and canvas
    when keyframes fall in it (fl2va's)."""
    return fl2va.text_key(job) if job.keyframes else t2va.text_key(job)


def encode_text(host, job) -> Encoded:
    """A window's text conditioning on `host`'s device (`tasks.base.Encoded`), as t2va or fl2va encode it.

    Raises:
        ValueError: a clip of several windows with keyframes in the text phase (the phased and streamed memory
            plans): each window presents its own keyframes, and windows exist only at render time.
    """
    if job.keyframes and getattr(job, "window_index", None) is None and len(windows(job)[0]) > 1:
        raise ValueError("a long clip's keyframes are presented window by window, which the phased and streamed "
                         "memory plans cannot encode ahead: render it with --memory-plan resident")
    return fl2va.encode_text(host, job) if job.keyframes else t2va.encode_text(host, job)


def warm_job(job):
    """The job the engine warms this task up on: a conditioned window of the job's canvas on the shortest clip
    with a 2-latent zero tail (a fasth3 clip: a plain t2va window), at milliseconds of DiT time."""
    windows_, _ = windows(job)
    last = windows_[-1]
    if not getattr(last, "tail_latents", 0):
        return t2va.warm_job(last)
    tail = torch.zeros(VIDEO_LATENT_CHANNELS, 2, job.height // SPATIAL_COMPRESSION, job.width // SPATIAL_COMPRESSION)
    return replace(last, frames=FRAMES_REMAINDER, tail_latents=2, tail=tail)
