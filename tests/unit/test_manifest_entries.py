"""A problem in one entry of a manifest list (`loras`, `references`, `keyframes`) is named one way, as a field path
with a 0-based index (`loras[1].strength`, `references[0]`). A fresh-user trial: `references` said "entry 1" where
`loras` said "[0]"."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from h3render.manifest import read_manifest
from h3render.manifest_formats import ManifestError
from h3render.spec import Limits

LIMITS = Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=7)

# (job fields, the problem's field path, its message's start); every job has one problem, in a list entry.
JOBS = [
    ({"loras": [{"path": "x.safetensors", "strength": 0.5}, {"path": "y.safetensors", "strength": "strong"}]},
     "loras[1].strength", "must be a finite number, got 'strong'"),
    ({"loras": [{"strength": 0.5, "path": "missing.safetensors"}]},
     "loras[0].path", "missing.safetensors: no such LoRA file"),
    ({"loras": ["still.png", ""]}, "loras[1]", "path must not be empty"),
    ({"loras": [{"path": "x.safetensors", "strenght": 1}]},
     "loras[0].strenght", "unknown key; allowed: path, strength, schedule"),
    ({"references": ["still.png", {"path": "still.png", "type": "picture"}]},
     "references[1].type", "'picture' is not one of image, video, audio"),
    ({"references": ["still.png", "gone.png"]}, "references[1]", "{dir}/gone.png: reference file not found"),
    ({"keyframes": ["0:still.png", "zz"]}, "keyframes[1]", "'zz' must be \"FRAME:IMAGE\""),
    ({"keyframes": ["20:gone.png", "0:still.png"]}, "keyframes[0]", "{dir}/gone.png: keyframe image not found"),
]


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (128, 64), (200, 40, 40)).save(tmp_path / "still.png")
    return tmp_path


def _errors(path) -> list[str]:
    with pytest.raises(ManifestError) as info:
        read_manifest(path, LIMITS)
    return info.value.errors


def test_jsonl_entry_problems_use_the_same_field_paths(folder):
    manifest = folder / "m.jsonl"
    manifest.write_text("".join(json.dumps({"prompt": "p", **fields}) + "\n" for fields, _, _ in JOBS))
    errors = _errors(manifest)
    assert [e.split(": ", 2)[:2] for e in errors] == [[f"{manifest}:{n}", field]
                                                       for n, (_, field, _) in enumerate(JOBS, start=1)], errors
    assert not any("entry " in e or ": [" in e for e in errors), errors  # one style: no "entry 1", no "loras: [0]"
