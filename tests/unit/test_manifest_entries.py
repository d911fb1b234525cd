"""A problem in one entry of a manifest list (`loras`, `references`, `keyframes`) is named one way, as a field path
with a 0-based index (`loras[1].strength`, `references[0]`), and in YAML blamed on the entry's own line (the key's,
when it is one key's value), not on the line of the list's key. Two fresh-user trials: `references` said "entry 1"
where `loras` said "[0]", and both pointed at the `loras:` / `references:` line."""

from __future__ import annotations

import json
import textwrap

import pytest
from PIL import Image

from h3render.manifest import read_manifest
from h3render.manifest_formats import Layer, ManifestError, Value
from h3render.spec import Limits

LIMITS = Limits(min_frames=22, max_frames=362, default_canvas=(224, 128), default_frames=39, default_steps=7)

# (job fields, the problem's field path, its message's start); every job has one problem, in a list entry.
JOBS = [
    ({"loras": [{"path": "x.safetensors", "strength": 0.5}, {"path": "y.safetensors", "strength": "strong"}]},
     "loras[1].strength", "must be a finite number, got 'strong'"),
    ({"loras": [{"strength": 0.5, "path": "missing.safetensors"}]},
     "loras[0].path", "{dir}/missing.safetensors: LoRA file not found"),
    ({"loras": ["x.safetensors", ""]}, "loras[1]", "path must not be empty"),
    ({"loras": [{"path": "x.safetensors", "strenght": 1}]},
     "loras[0].strenght", "unknown field (did you mean strength?)"),
    ({"references": ["still.png", {"path": "still.png", "type": "picture"}]},
     "references[1].type", "'picture' is not one of image, video, audio"),
    ({"references": ["still.png", "gone.png"]}, "references[1]", "{dir}/gone.png: reference file not found"),
    ({"keyframes": ["0:still.png", "zz"]}, "keyframes[1]", "'zz' must be \"FRAME:IMAGE\""),
    ({"keyframes": ["20:gone.png", "0:still.png"]}, "keyframes[0]", "{dir}/gone.png: keyframe image not found"),
]


@pytest.fixture
def folder(tmp_path):
    from h3render.checkpoint.releases import RELEASES
    from h3render.make_checkpoint.synthetic_lora import write_synthetic_lora

    Image.new("RGB", (128, 64), (200, 40, 40)).save(tmp_path / "still.png")
    # every well-formed entry's file is read, beside the other entries' problems: a real one keeps each job at one
    write_synthetic_lora(tmp_path / "x.safetensors", RELEASES["tiny"].dit, "peft", seed=0)
    return tmp_path


def _errors(path) -> list[str]:
    with pytest.raises(ManifestError) as info:
        read_manifest(path, LIMITS)
    return info.value.errors


def _yaml_job(fields: dict) -> list[str]:
    """One job in block style, every list entry and key on a line of its own (an entry mapping starts on the line
    after its dash)."""
    lines = ["  - prompt: p"]
    for name, entries in fields.items():
        lines.append(f"    {name}:")
        for entry in entries:
            if isinstance(entry, dict):
                lines.append("      -")
                lines += [f"        {key}: {json.dumps(value)}" for key, value in entry.items()]
            else:
                lines.append(f"      - {json.dumps(entry)}")
    return lines


def test_yaml_entry_problems_name_the_entry_on_its_own_line(folder):
    text = ["jobs:"] + [line for fields, _, _ in JOBS for line in _yaml_job(fields)]
    manifest = folder / "m.yaml"
    manifest.write_text("\n".join(text) + "\n")
    # the key's line ("strength:", "path:", "type:"), else the entry's (a path string's; its first key's after a
    # lone dash): lines 9, 14, ... of the text above, not those of `loras:` (3, 11, ...)
    lines = [9, 14, 18, 23, 29, 33, 37, 40]
    assert [text[n - 1].strip().split(":")[0] for n in lines] == [
        "strength", "path", '- ""', "strenght", "type", '- "gone.png"', '- "zz"', '- "20']
    errors = _errors(manifest)
    assert len(errors) == len(JOBS), errors
    for error, line, (_, field, message) in zip(errors, lines, JOBS):
        assert error.startswith(f"{manifest}:{line}: {field}: {message.format(dir=folder)}"), (error, line)


def test_jsonl_entry_problems_use_the_same_field_paths(folder):
    manifest = folder / "m.jsonl"
    manifest.write_text("".join(json.dumps({"prompt": "p", **fields}) + "\n" for fields, _, _ in JOBS))
    errors = _errors(manifest)
    assert [e.split(": ", 2)[:2] for e in errors] == [[f"{manifest}:{n}", field]
                                                       for n, (_, field, _) in enumerate(JOBS, start=1)], errors
    assert not any("entry " in e or ": [" in e for e in errors), errors  # one style: no "entry 1", no "loras: [0]"


def test_defaults_flow_lists_and_merges(folder):
    manifest = folder / "m.yaml"
    manifest.write_text(textwrap.dedent("""\
        x-lora: &lora {path: x.safetensors, strength: 2}
        defaults:
          loras:
            - path: a.safetensors
            - {path: b.safetensors,
               strength: .nan}
        jobs:
          - prompt: a
            loras:
              - <<: *lora
                strenght: 1
          - prompt: b
            references: [still.png,
                         {path: still.png, audio: "no"}]
          - 7
        """))
    assert _errors(manifest) == [
        f"{manifest}:4: loras[0].path: {folder}/a.safetensors: LoRA file not found",  # the defaults' (job b's)
        f"{manifest}:6: loras[1].strength: must be a finite number, got nan",  # the key's line in a flow mapping
        f"{manifest}:11: loras[0].strenght: unknown field (did you mean strength?)",  # beside a merge
        f"{manifest}:14: references[1].audio: must be true or false, got 'no'",
        f"{manifest}:15: each job must be a mapping of fields",  # a jobs: item: its own line, as before
    ]


def test_a_place_without_a_line_falls_back_to_its_entry_then_the_field():
    layer = Layer("m.yaml", 3, {"loras": Value([{}], 4, {"[0]": 5, "[0].path": 6}), "seed": Value(1, 0)})
    assert str(layer.where("loras", "[0].path")) == "m.yaml:6: loras[0].path"
    assert str(layer.where("loras", "[0].strength")) == "m.yaml:5: loras[0].strength"  # merged in: the entry's
    assert str(layer.where("loras", "[1]")) == "m.yaml:4: loras[1]"
    assert str(layer.where("seed")) == "m.yaml:3: seed" and str(layer.where("mode", "[0]")) == "m.yaml:3: mode[0]"


def test_a_typo_in_an_entry_key_gets_the_same_hint_as_a_job_field(folder):
    """A trial: `strenght` in a LoRA entry said "unknown key; allowed: ..." where `sed` on a job said "unknown field
    (did you mean seed?)": one wording, with difflib's suggestion, for both."""
    manifest = folder / "m.jsonl"
    manifest.write_text(json.dumps({"prompt": "p", "sed": 1, "loras": [{"path": "x.safetensors", "strenght": 1}],
                                    "references": [{"path": "still.png", "typ": "image"}]}) + "\n")
    assert _errors(manifest) == [f"{manifest}:1: sed: unknown field (did you mean seed?)",
                                 f"{manifest}:1: loras[0].strenght: unknown field (did you mean strength?)",
                                 f"{manifest}:1: references[0].typ: unknown field (did you mean type?)"]


def test_missing_files_print_one_absolute_path_for_loras_references_and_keyframes(folder, monkeypatch):
    """A trial: for `batch sub/m.jsonl` a missing LoRA printed `sub/gone.safetensors` (relative to the working
    folder) where a missing reference or keyframe printed its absolute path. All three resolve against the
    manifest's folder and print it absolute."""
    sub = folder / "sub"
    sub.mkdir()
    (sub / "m.jsonl").write_text(json.dumps({"prompt": "p", "loras": ["gone.safetensors"]}) + "\n" +
                                 json.dumps({"prompt": "q", "references": ["gone.png"]}) + "\n" +
                                 json.dumps({"prompt": "r", "first_frame": "gone.jpg"}) + "\n")
    monkeypatch.chdir(folder)
    assert _errors("sub/m.jsonl") == [f"sub/m.jsonl:1: loras[0]: {sub}/gone.safetensors: LoRA file not found",
                                      f"sub/m.jsonl:2: references[0]: {sub}/gone.png: reference file not found",
                                      f"sub/m.jsonl:3: first_frame: {sub}/gone.jpg: keyframe image not found"]


def test_every_bad_entry_and_every_missing_file_of_a_job_is_reported_at_once(folder):
    """A trial with a 500-job manifest: a job with several bad list entries reported only the first, and its
    missing files only once its other fields were fixed. Now every bad entry names its own place and line, and the
    well-formed entries' files are read beside the field errors."""
    manifest = folder / "m.yaml"
    manifest.write_text(textwrap.dedent("""\
        jobs:
          - prompt: p
            seed: lots
            loras:
              - {path: gone.safetensors}
              - {path: x.safetensors, strength: strong, shedule: x}
              - also-gone.safetensors
            references:
              - {path: still.png, type: picture}
              - gone.png
              - lost.png
          - prompt: q
            first_frame: gone.jpg
            keyframes: ["zz", "5:lost.png", "9:still.png", "yy"]
        """))
    assert _errors(manifest) == [
        f"{manifest}:3: seed: must be an integer, got a string",
        f"{manifest}:5: loras[0].path: {folder}/gone.safetensors: LoRA file not found",
        f"{manifest}:6: loras[1].shedule: unknown field (did you mean schedule?)",
        f"{manifest}:6: loras[1].strength: must be a finite number, got 'strong'",
        f"{manifest}:7: loras[2]: {folder}/also-gone.safetensors: LoRA file not found",
        f"{manifest}:9: references[0].type: 'picture' is not one of image, video, audio",
        f"{manifest}:10: references[1]: {folder}/gone.png: reference file not found",
        f"{manifest}:11: references[2]: {folder}/lost.png: reference file not found",
        f"{manifest}:13: first_frame: {folder}/gone.jpg: keyframe image not found",
        f"{manifest}:14: keyframes[0]: 'zz' must be \"FRAME:IMAGE\" (a 0-based frame index, ':' and an image path, "
        "e.g. \"240:mid.png\")",
        f"{manifest}:14: keyframes[3]: 'yy' must be \"FRAME:IMAGE\" (a 0-based frame index, ':' and an image path, "
        "e.g. \"240:mid.png\")",
        f"{manifest}:14: keyframes[1]: {folder}/lost.png: keyframe image not found",
    ]


def test_a_keyframe_past_the_clips_end_names_its_entry(folder):
    """A trial: `keyframes: [..., "500:b.png"]` on a 22-frame clip said `keyframes: frame 500 is past ...` without
    the entry, where the list's other problems name theirs (`keyframes[2]`); each such entry is named."""
    manifest = folder / "m.jsonl"
    manifest.write_text(json.dumps({"prompt": "p", "frames": 22, "keyframes": ["0:still.png", "600:still.png",
                                                                               "10:still.png", "500:still.png"]})
                        + "\n" + json.dumps({"prompt": "q", "frames": 22, "first_frame": "still.png",
                                             "keyframes": ["0:still.png"]}) + "\n")
    assert _errors(manifest) == [
        f"{manifest}:1: keyframes[3]: frame 500 is past the clip's last frame 21 (22 frames)",
        f"{manifest}:1: keyframes[1]: frame 600 is past the clip's last frame 21 (22 frames)",
        f"{manifest}:2: keyframes[0]: keyframe 0:still.png and first_frame still.png both anchor frame 0; give one "
        "picture per frame"]
