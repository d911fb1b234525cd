"""fl2va job fields: first_frame / last_frame resolved against the manifest's folder, validated before anything loads
(file:line: field errors), the canvas from the leading keyframe, fasth3 refused, and the resume key's content hash."""

import json

import numpy as np
import pytest
from PIL import Image

from h3render.checkpoint.releases import RELEASES
from h3render.dry_run import plan_lines
from h3render.jobs import Job
from h3render.manifest import job_from_fields, read_manifest
from h3render.manifest_formats import ManifestError
from h3render.spec import canvas_for_aspect

LIMITS = RELEASES["released"].limits()


def _png(path, size=(640, 480), mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8), mode).save(path)
    return path


def _manifest(folder, jobs, name="m.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def test_relative_paths_resolve_against_the_manifest_folder_and_canvas_follows_the_first_keyframe(tmp_path):
    shots = tmp_path / "shots"
    shots.mkdir()
    _png(shots / "a.png", (640, 480))
    _png(shots / "b.jpg", (480, 640), seed=1)
    manifest = _manifest(shots, [
        {"id": "auto", "prompt": "p", "first_frame": "a.png"},
        {"id": "last-only", "prompt": "p", "last_frame": "b.jpg"},
        {"id": "both", "prompt": "p", "first_frame": "a.png", "last_frame": "b.jpg", "aspect": "16:9"},
        {"id": "plain", "prompt": "p"},
    ])
    jobs = {j.id: j for j in read_manifest(manifest, LIMITS).jobs}
    assert (jobs["auto"].width, jobs["auto"].height) == canvas_for_aspect(4, 3) == (1024, 768)
    assert jobs["auto"].first_frame.path == str(shots / "a.png") and jobs["auto"].task == "fl2va"
    # a last-frame-only job: the last frame leads and sets the canvas (3:4 -> 768 x 1024)
    assert (jobs["last-only"].width, jobs["last-only"].height) == (768, 1024)
    assert jobs["last-only"].keyframes[0].anchor == "last"
    # an explicit canvas choice wins over the keyframe's aspect
    assert (jobs["both"].width, jobs["both"].height) == (1344, 768)
    assert [k.anchor for k in jobs["both"].keyframes] == ["first", "last"]
    assert jobs["plain"].task == "t2va" and "task" not in jobs["plain"].params()
    assert jobs["auto"].canvas_note() == "first frame's aspect (640x480) → 1024x768"
    assert "fl2va (first frame a.png 640x480)" in plan_lines([jobs["auto"]])[0]


def test_params_carry_the_content_hash(tmp_path):
    """The resume key changes when the picture's bytes change under the same name, and not when only the name
    changes."""
    _png(tmp_path / "a.png", seed=0)
    before = job_from_fields({"prompt": "p", "first_frame": str(tmp_path / "a.png")}, LIMITS).params()
    _png(tmp_path / "a.png", seed=1)
    after = job_from_fields({"prompt": "p", "first_frame": str(tmp_path / "a.png")}, LIMITS).params()
    assert before["task"] == "fl2va" and before["first_frame_sha256"] != after["first_frame_sha256"]
    (tmp_path / "a.png").rename(tmp_path / "renamed.png")
    renamed = job_from_fields({"prompt": "p", "first_frame": str(tmp_path / "renamed.png")}, LIMITS).params()
    assert renamed == after


def test_errors_name_file_line_and_field(tmp_path):
    _png(tmp_path / "ok.png")
    _png(tmp_path / "wide.png", (500, 100))
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    _png(tmp_path / "alpha.png", (64, 64), mode="RGBA")
    manifest = _manifest(tmp_path, [
        {"prompt": "p", "first_frame": "missing.png"},
        {"prompt": "p", "first_frame": "corrupt.png"},
        {"prompt": "p", "last_frame": "wide.png"},
        {"id": "student", "prompt": "p", "first_frame": "ok.png", "mode": "fasth3"},
        {"prompt": "p", "first_frame": 3},
        {"prompt": "p", "first_frame": "alpha.png"},  # fine: flattened, and said so
    ])
    with pytest.raises(ManifestError) as info:
        read_manifest(manifest, LIMITS, adapter_available=True)
    errors = info.value.errors
    assert len(errors) == 5, errors
    assert errors[0].startswith(f"{manifest}:1: first_frame: ") and "missing.png: keyframe image not found" in errors[0]
    assert errors[1].startswith(f"{manifest}:2: first_frame: ") and "corrupt.png: not a decodable image" in errors[1]
    assert errors[2].startswith(f"{manifest}:3: last_frame: ") and "(5:1) is outside the supported 1:4" in errors[2]
    assert errors[3].startswith(f"{manifest}:4: first_frame: job 'student' is fl2va") and "t2va-only" in errors[3]
    assert errors[4] == f"{manifest}:5: first_frame: must be a string, got an integer"


def test_rgba_is_flattened_and_said_so(tmp_path):
    _png(tmp_path / "alpha.png", (64, 64), mode="RGBA")
    job = job_from_fields({"prompt": "p", "first_frame": str(tmp_path / "alpha.png")}, LIMITS)
    assert job.first_frame.alpha_flattened and job.first_frame.mode == "RGBA"
    assert "RGBA → RGB, alpha flattened onto white" in job.first_frame.describe()


def test_fasth3_from_defaults_and_keyframes_in_defaults_are_refused(tmp_path):
    _png(tmp_path / "ok.png")
    path = tmp_path / "m.yaml"
    path.write_text("defaults:\n  mode: fasth3\n  last_frame: ok.png\njobs:\n  - prompt: p\n    first_frame: ok.png\n")
    with pytest.raises(ManifestError) as info:
        read_manifest(path, LIMITS, adapter_available=True)
    assert info.value.errors == [f"{path}:3: last_frame: may only be set on a job, not in defaults"]
    path.write_text("defaults:\n  mode: fasth3\njobs:\n  - prompt: p\n    first_frame: ok.png\n")
    with pytest.raises(ManifestError) as info:
        read_manifest(path, LIMITS, adapter_available=True)
    assert info.value.errors[0].startswith(f"{path}:5: first_frame: job is fl2va") and f"(from {path}:2: mode)" \
        in info.value.errors[0]
    with pytest.raises(ValueError, match="t2va-only"):
        Job(id=None, prompt="p", width=1344, height=768, frames=124, seed=0, steps=None, mode="fasth3", output="x",
            first_frame=job_from_fields({"prompt": "p", "first_frame": str(tmp_path / "ok.png")}, LIMITS).first_frame)
