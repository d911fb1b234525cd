"""The window plan of a clip longer than one pass (`h3render.windows`) and its seams (`h3render.seams`): every
frame and sample of the clip written once, the overlap cross-faded (video linear, audio equal power)."""

from __future__ import annotations

import math

import pytest
import torch

from h3render.seams import Splicer, audio_gains, back_to_back, video_weights
from h3render.spec import Limits, audio_samples, is_snapped, latent_first_frame, latent_frames
from h3render.windows import (DEFAULT_OVERLAP, MAX_CLIP_FRAMES, default_window, plan_windows, resolve_frames)

RELEASED = Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50)


def test_plans_cover_every_clip_up_to_120_s_with_trained_windows():
    window = default_window(RELEASED)
    assert window == 345  # the longest 17n + 5 within 15 s
    assert [(w.start, w.frames, w.overlap, w.keep) for w in plan_windows(720, window)] == [
        (0, 260, 0, 238), (238, 260, 22, 238), (476, 260, 22, 244)]
    for frames in range(363, MAX_CLIP_FRAMES + 1, 7):
        plan = plan_windows(frames, window)
        assert sum(w.keep for w in plan) == frames and plan[0].start == 0
        for w in plan:
            assert is_snapped(w.frames) and RELEASED.min_frames <= w.frames <= window, (frames, w)
        for a, b in zip(plan, plan[1:]):
            # the next window starts where this one stops writing, and redraws exactly its held tail
            assert b.start == a.start + a.keep and a.frames - a.keep == b.overlap == DEFAULT_OVERLAP
        assert plan[-1].keep <= plan[-1].frames
    assert len(plan_windows(MAX_CLIP_FRAMES, window)) == 9


def test_the_overlap_keeps_the_tail_latents_in_phase():
    # 22 frames = the last 7 latent frames of a 17n + 5 window, which start a VAE group (latent index 5m)
    tail = plan_windows(720, 345)[1].tail_latents
    for frames in (107, 260, 345):
        first_tail_latent = latent_frames(frames) - tail
        assert first_tail_latent % 5 == 0
        assert frames - latent_first_frame(first_tail_latent) == DEFAULT_OVERLAP
    with pytest.raises(ValueError, match="17j"):
        plan_windows(720, 345, overlap=20)
    with pytest.raises(ValueError, match="at least 61"):
        plan_windows(720, 56, overlap=22)


def test_resolve_frames_one_pass_windows_and_the_limit():
    assert resolve_frames(None, 10.0, RELEASED) == (243, None)
    assert resolve_frames(None, 30.0, RELEASED) == (720, 345)  # exact, not snapped
    assert resolve_frames(2880, None, RELEASED) == (2880, 345)
    for frames, duration, text in ((2881, None, "frames 2881 is 2881 frames (120.042 s), longer than the 120 s"),
                                   (None, 120.5, "duration 120.5 s is 2892 frames"),
                                   (50, None, "outside this checkpoint's range 107–362")):
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            resolve_frames(frames, duration, RELEASED)


def _render(plan, height=2, width=2):
    """Feed a Splicer windows whose frame j of window i is the constant 100 * i + j, in chunks of 5 frames; and
    soundtracks of constant (i + 1) / 10. Returns the written frames' values and the written audio."""
    splicer = Splicer(plan)
    frames, audio = [], []
    for w in plan:
        wave = torch.full((2, audio_samples(w.frames) + 300), (w.index + 1) / 10)
        audio.append(splicer.audio(w.index, wave))
        values = torch.arange(w.frames, dtype=torch.float32) + 100 * w.index
        for first in range(0, w.frames, 5):
            chunk = values[first:first + 5][None, :, None, None].expand(3, -1, height, width).contiguous()
            out = splicer.frames(w.index, first, chunk)
            if out is not None:
                frames.append(out[0, :, 0, 0])
    return torch.cat(frames), torch.cat(audio, dim=1)


def test_the_splicer_writes_each_frame_once_and_cross_fades_the_overlap():
    plan = plan_windows(140, 73, overlap=22)  # small windows: 73, 73, 39 frames
    assert len(plan) == 3
    frames, audio = _render(plan)
    assert frames.numel() == 140 and audio.shape == (2, audio_samples(140))
    second = plan[1]
    # before the seam: window 0's own frames; after the fade: window 1's own frames
    assert torch.equal(frames[: second.start], torch.arange(second.start, dtype=torch.float32))
    fade_end = second.start + second.overlap
    assert torch.equal(frames[fade_end: plan[2].start], torch.arange(22, second.keep, dtype=torch.float32) + 100)
    # the fade: frame j blends window 0's frame (keep + j) and window 1's frame j with weight (j + 1) / 23
    j = torch.arange(22, dtype=torch.float32)
    w = (j + 1) / 23
    expected = (1 - w) * (plan[0].keep + j) + w * (100 + j)
    assert torch.allclose(frames[second.start:fade_end], expected, atol=1e-5)
    assert torch.equal(video_weights(22), w)
    # audio: window 0's level, then an equal-power fade into window 1's (cos^2 + sin^2 = 1)
    start, end = audio_samples(second.start), audio_samples(fade_end)
    assert torch.all(audio[:, :start] == 0.1) and torch.allclose(audio[:, end:audio_samples(plan[2].start)],
                                                                   torch.tensor(0.2))
    cos, sin = audio_gains(end - start)
    assert torch.allclose(cos ** 2 + sin ** 2, torch.ones(end - start))
    assert torch.allclose(audio[0, start:end], 0.1 * cos + 0.2 * sin)
    assert float(audio[0, start]) == pytest.approx(0.1, abs=1e-4) and float(audio[0, end - 1]) == pytest.approx(
        0.2, abs=1e-4)
    assert math.isclose(float(sin[len(sin) // 2] ** 2), 0.5, abs_tol=1e-3)  # half power each at the middle


def test_back_to_back_windows_pass_through_untouched():
    plan = back_to_back([22, 39])
    splicer = Splicer(plan)
    chunk = torch.rand(3, 22, 4, 4)
    out = splicer.frames(0, 0, chunk)
    assert torch.equal(out, chunk) and out.data_ptr() == chunk.data_ptr()  # a view: no copy, no blend
    wave = torch.rand(2, 1000)
    assert splicer.audio(0, wave) is wave
    assert splicer.keeps == [22, 39]


def test_window_and_overlap_are_manifest_fields_checked_before_load():
    from h3render.manifest import job_from_fields
    from h3render.manifest_formats import ManifestError

    tiny = Limits(min_frames=22, max_frames=362, default_canvas=(128, 96), default_frames=39, default_steps=8)
    job = job_from_fields({"prompt": "p", "duration": 20, "window": 243, "overlap": 5}, tiny)
    assert (job.window, job.overlap, [w.frames for w in job.windows]) == (243, 5, [243, 243])
    assert job.params()["window"] == 243 and job.params()["overlap"] == 5
    assert job_from_fields({"prompt": "p", "duration": 10, "window": 243}, tiny).window is None  # one pass
    for fields, text in (({"window": 100}, "window: window 100 must be 17n + 5 frames and at least 61"),
                         ({"window": 379}, "window: window 379 is outside this checkpoint's range 22–362"),
                         ({"overlap": 20}, "overlap: overlap 20 must be 17j + 5"),
                         ({"overlap": -5}, "overlap: must be a positive integer number of frames")):
        with pytest.raises(ManifestError) as info:
            job_from_fields({"prompt": "p", "duration": 20, **fields}, tiny)
        assert len(info.value.errors) == 1 and text in info.value.errors[0], info.value.errors
