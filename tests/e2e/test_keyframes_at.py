"""Keyframes at any frame index (`keyframes: ["240:mid.png"]`, `--keyframe 240:mid.png`): the fl2va condition rows
anchored by time (`packing.keyframe_time`). A keyframe at frame 0 / the last frame is today's first_frame /
last_frame bit for bit; an interior one sits at t = text_len + f * 5/3."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from PIL import Image

from h3render.checkpoint.info import read_checkpoint_info
from h3render.engine import Engine
from h3render.manifest import job_from_fields
from h3render.manifest_formats import ManifestError
from h3render.parallel.groups import ParallelContext
from h3render.packing import fl2va_layout
from h3render.render import generate
from h3render.sampling import Schedule
from h3render.settings import RunSettings
from h3render.spec import latent_first_frame
from h3render.tasks import fl2va
from h3render.timing import StageTimer
from tests._cli import invoke, one_error_line, run_here

LIMITS = read_checkpoint_info("tiny").limits()


@pytest.fixture(scope="module")
def engine():
    return Engine.load(RunSettings(progress=False), ParallelContext(0, 1, 0, torch.device("cpu")))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    rng = np.random.default_rng(3)
    for name, size in (("a.png", (128, 96)), ("b.png", (96, 128)), ("c.png", (128, 64))):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / name)
    return folder


def _job(pictures, **fields):
    base = {"prompt": "A kite over a beach", "frames": 39, "steps": 3, "seed": 11, "output": "k"}
    return job_from_fields({**base, **{k: v for k, v in fields.items()}}, LIMITS, source=str(pictures / "m.yaml"))


def _same(x, y) -> bool:
    return x.dtype == y.dtype and torch.equal(x, y)


def test_keyframes_at_the_ends_are_first_and_last_frame_bit_for_bit(engine, pictures):
    today = _job(pictures, first_frame="a.png", last_frame="b.png")
    anchored = _job(pictures, keyframes=["38:b.png", "0:a.png"])  # any order: packed by frame
    assert anchored.task == "fl2va" and [k.anchor for k in anchored.keyframes] == [0, 38]
    # the earliest keyframe sets the canvas, as first_frame does
    assert (anchored.width, anchored.height) == (today.width, today.height) == (160, 128)
    assert anchored.canvas_note() == "frame 0's aspect (128x96) → 160x128"
    timer = StageTimer("cpu")
    a, b = fl2va.prepare(engine, today, timer), fl2va.prepare(engine, anchored, timer)
    for name in ("text", "video_rows", "audio_rows", "condition_rows"):
        assert _same(getattr(a, name), getattr(b, name)), name
    for name in ("positions", "token_tags", "video_index", "audio_index"):
        assert _same(getattr(a.layout, name), getattr(b.layout, name)), name
    schedule = Schedule.base(2, 12.0, 3.0)  # one forward: the inputs are what must match
    la, lb = (generate(engine, job, p, schedule, timer) for job, p in ((today, a), (anchored, b)))
    assert _same(la.video, lb.video) and _same(la.audio, lb.audio)
    # the sidecar record names where each picture went
    assert [k["anchor"] for k in b.record["fl2va"]["keyframes"]] == [0, 38]
    assert b.record["fl2va"]["keyframes"][1]["given"] == "b.png"


def test_an_interior_keyframe_sits_at_its_frame_time():
    tags = torch.ones(7, dtype=torch.int64)
    layout = fl2va_layout(tags, 64, 128, 39, ("first", 20, 17))
    rows = layout.rows_per_frame
    times = layout.positions[layout.condition_index, 0].reshape(3, rows)
    assert torch.all(times[0] == 7) and torch.all(times[1] == 7 + 20 * 5 / 3)
    # frame 17 starts latent frame 5: that keyframe sits exactly on the latent's own t (cumulative spans)
    target = layout.positions[layout.target_video_index, 0].reshape(-1, rows)[:, 0]
    assert torch.all(times[2] == target[5]) and latent_first_frame(5) == 17
    assert layout.num_condition_rows == 3 * rows and layout.keyframe_anchors == ("first", 20, 17)
    with pytest.raises(ValueError, match="frame index in 0..38"):
        fl2va_layout(tags, 64, 128, 39, (39,))


def test_keyframe_mistakes_are_field_errors(pictures):
    for fields, text in (({"keyframes": ["39:a.png"]}, "frame 39 is past the clip's last frame 38"),
                         ({"keyframes": ["0:a.png"], "first_frame": "b.png"},
                          "keyframe 0:a.png and first_frame b.png both anchor frame 0"),
                         ({"keyframes": ["x:a.png"]}, 'must be "FRAME:IMAGE"'),
                         ({"keyframes": "0:a.png"}, "must be a non-empty list"),
                         ({"keyframes": ["0:missing.png"]}, "keyframe image not found"),
                         ({"keyframes": ["720:a.png"], "frames": 720}, "frame 720 is past the clip's last frame 719")):
        with pytest.raises(ManifestError) as info:
            _job(pictures, **fields)
        assert len(info.value.errors) == 1 and text in info.value.errors[0], (fields, info.value.errors)
        assert info.value.errors[0].split(": ")[1] in ("keyframes", "keyframes[0]", "first_frame"), info.value.errors


def test_prompt_keyframe_option_reaches_the_job(pictures):
    result = invoke("prompt", "x", "-o", str(pictures / "o.mp4"), "--frames", "22", "--keyframe",
                    f"30:{pictures / 'a.png'}")
    assert "frame 30 is past the clip's last frame 21" in one_error_line(result)


def test_the_warm_up_moves_interior_keyframes_onto_its_short_clip(pictures, tmp_path):
    """A trial: `--keyframe 20:b.png` on a 39-frame clip failed after the load ("frame 20 is past the clip's last
    frame 4 (5 frames)"): the warm-up job kept the keyframe on its 5-frame clip. In a batch whose first fl2va job
    had one, the warm-up failed and with it every job, a plain t2va one included."""
    two = fl2va.warm_job(_job(pictures, keyframes=["0:a.png", "20:b.png"]))
    assert two.frames == 5 and [k.frame(5) for k in two.keyframes] == [0, 4]
    four = fl2va.warm_job(_job(pictures, first_frame="a.png", keyframes=["10:b.png", "20:c.png"], last_frame="b.png"))
    assert four.frames == 22 and [k.frame(22) for k in four.keyframes] == [0, 7, 14, 21]  # a latent frame apart
    assert [k.given for k in four.keyframes] == ["a.png", "b.png", "c.png", "b.png"]  # the job's own pictures
    manifest = pictures / "m.jsonl"
    manifest.write_text('{"id": "mid", "prompt": "a", "frames": 39, "steps": 2, "keyframes": ["20:b.png", '
                        '"30:c.png", "38:a.png"]}\n'
                        '{"id": "plain", "prompt": "b", "frames": 22, "steps": 2}\n')
    r = run_here("batch", str(manifest), "--out-dir", str(tmp_path), "--device", "cpu", "--quiet")
    assert r.returncode == 0 and "2 succeeded, 0 failed" in r.stderr, r.stderr[-3000:]
    # and its sidecar passes the published schema, which allowed only "first" / "last" as an anchor, and two pictures
    import json

    import jsonschema

    from tests._env import REPO

    side = json.loads((tmp_path / "mid.json").read_text())
    assert [k["anchor"] for k in side["extra"]["fl2va"]["keyframes"]] == [20, 30, 38]
    schema = json.loads((REPO / "docs" / "schema" / "sidecar.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(side)
