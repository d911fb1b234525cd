"""Inputs at their documented limits (issue #28 items 5 and 10): the canvas x time bound of each checkpoint, and the
canvas, frames, seed and steps integers at both ends and at bit boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h3render.manifest import job_from_fields, load_manifest
from h3render.manifest_formats import ManifestError
from h3render.windows import MAX_CLIP_FRAMES
from h3render.spec import Limits, video_rows

RELEASED = Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50)
TINY = Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=8,
              canvas_short_edge=128, canvas_max_pixels=128 * 224)


# --- 5: canvas x frames bound -----------------------------------------------------------------------------------------

def test_the_bound_follows_each_checkpoints_canvas_rule():
    assert RELEASED.max_video_rows == 8 * video_rows(1344, 768, 362) == 862_848
    assert TINY.max_video_rows == 8 * video_rows(224, 128, 362) == 23_968
    assert Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=8,
                  max_video_rows=5000).max_video_rows == 5000
    with pytest.raises(ValueError, match="default canvas 1344x768 at 243 frames is more than max_video_rows 10"):
        Limits(min_frames=107, max_frames=362, default_canvas=(1344, 768), default_frames=243, default_steps=50,
               max_video_rows=10)


def test_the_probes_32000_square_canvas_is_refused_before_load(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "p", "width": 32000, "height": 32000}\n', encoding="utf-8")
    with pytest.raises(ManifestError) as info:
        load_manifest(path, RELEASED)
    assert info.value.errors == [f"{path}:1: width: canvas 32000x32000 at 243 frames is 72,000,000 packed video rows, "
                                 "more than this checkpoint's limit of 862,848 (Limits.max_video_rows)"]


def test_the_bound_is_inclusive_and_counts_frames():
    # 4032 x 2048 at 362 frames is exactly 8x the released largest canvas (1344 x 768) at its longest duration
    job = job_from_fields({"prompt": "p", "width": 4032, "height": 2048, "frames": 362}, RELEASED)
    assert job.video_rows == 862_848
    with pytest.raises(ManifestError, match=r"<command line>: width: canvas 4064x2048 at 362 frames"):
        job_from_fields({"prompt": "p", "width": 4064, "height": 2048, "frames": 362}, RELEASED)
    # the same canvas is fine at fewer frames; the tiny model's bound is its own
    assert job_from_fields({"prompt": "p", "width": 4064, "height": 2048, "frames": 243}, RELEASED)
    assert job_from_fields({"prompt": "p", "preset": "fast-960x544"}, TINY)
    with pytest.raises(ManifestError, match="limit of 23,968"):
        job_from_fields({"prompt": "p", "width": 1344, "height": 768, "frames": 107}, TINY)


_EDGES = [0, 1, -1, 31, 32, 33, 2**7, 2**8, 2**15, 2**16, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
          -(2**63), 10**100, 10**101]
_INTS = st.one_of(st.sampled_from(_EDGES), st.sampled_from(_EDGES).map(lambda v: v * 32), st.integers(-2**70, 2**70))


@settings(max_examples=50, deadline=None)
@given(_INTS, _INTS, _INTS)
def test_any_canvas_and_frames_are_a_bounded_job_or_an_error(width, height, frames):
    for limits in (RELEASED, TINY):
        try:
            job = job_from_fields({"prompt": "p", "width": width, "height": height, "frames": frames}, limits)
        except ManifestError as exc:
            assert all("\n" not in e for e in exc.errors)
            continue
        # past one pass a clip is windows (h3render.windows), each within the checkpoint's range, up to 120 s
        assert job.video_rows <= limits.max_video_rows and limits.min_frames <= job.pass_frames <= limits.max_frames
        assert job.frames <= MAX_CLIP_FRAMES and (job.window is None) == (job.frames <= limits.max_frames)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(["seed", "steps", "frames", "duration"]), _INTS)
def test_any_integer_field_is_in_range_or_an_error(name, value):
    try:
        job = job_from_fields({"prompt": "p", name: value}, RELEASED)
    except ManifestError as exc:
        assert len(exc.errors) == 1 and exc.errors[0].startswith(f"<command line>: {name}:")
        return
    assert 0 <= job.seed < 2**64 and (job.steps is None or 2 <= job.steps <= RELEASED.max_sigma_points)
