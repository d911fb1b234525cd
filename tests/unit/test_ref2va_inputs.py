"""ref2va inputs before anything loads: reference files probed and typed (Pillow / PyAV), the manifest's
`references:` list (paths relative to the manifest, `type` and `audio` overrides), the request rules, and every
refusal of issue #23 as one `h3render: error` line, exit 2, nothing written. Media are made here, tiny."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3render.checkpoint.releases import RELEASES
from h3render.job_references import read_reference, references_problem
from h3render.manifest import job_from_fields, read_manifest
from h3render.manifest_formats import ManifestError
from tests._cli import invoke, one_error_line
from tests._media import mp4, png, wav

LIMITS = RELEASES["tiny"].limits()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    png(d / "wide.png", (64, 40))
    png(d / "portrait.png", (40, 64), seed=1)
    png(d / "too_wide.png", (164, 40))  # 4.1 : 1
    wav(d / "mono44k.wav", 0.5, 44100, 1)
    wav(d / "stereo32k.wav", 0.5, 32000, 2)
    mp4(d / "clip24.mp4", frames=24, fps=24)
    mp4(d / "clip30.mp4", frames=30, fps=30, sound_rate=None)
    mp4(d / "portrait.mp4", frames=24, fps=24, size=(48, 64), sound_rate=44100, channels=1)
    mp4(d / "short.mp4", frames=10, fps=24, sound_rate=None)
    (d / "notes.mp4").write_text("not a video\n")
    (d / "folder.png").mkdir()
    return d


def test_types_and_measurements(media):
    image = read_reference("wide.png", media)
    assert (image.type, image.use_audio, image.info["width"], image.info["height"]) == ("image", False, 64, 40)
    mono = read_reference("mono44k.wav", media)
    assert (mono.type, mono.use_audio, mono.info["sample_rate"], mono.info["channels"]) == ("audio", True, 44100, 1)
    assert read_reference("stereo32k.wav", media).info["channels"] == 2
    clip = read_reference("clip24.mp4", media)
    assert (clip.type, clip.use_audio, clip.info["fps"], clip.info["frames"]) == ("video", True, 24.0, 24)
    assert clip.describe().endswith("+ sound")
    silent = read_reference("clip30.mp4", media)
    assert (silent.info["fps"], silent.info["frames"], silent.use_audio) == (30.0, 30, False)
    portrait = read_reference({"path": "portrait.mp4"}, media, no_audio=True)
    assert (portrait.info["width"], portrait.info["height"], portrait.use_audio) == (48, 64, False)
    assert read_reference({"path": "portrait.mp4", "audio": True}, media, no_audio=True).use_audio  # entry wins
    as_audio = read_reference({"path": "clip24.mp4", "type": "audio"}, media)  # the soundtrack as an audio clip
    assert (as_audio.type, as_audio.type_given) == ("audio", True)
    assert image.sha256 != read_reference("portrait.png", media).sha256
    assert image.params() == {"type": "image", "sha256": image.sha256, "audio": False}


@pytest.mark.parametrize("entry,message", [
    ("missing.png", "reference file not found"),
    ("folder.png", "must be a file, not a folder"),
    ("notes.mp4", "not a decodable image, video or audio file"),
    ("too_wide.png", "outside the supported 1:4 ... 4:1"),
    ("short.mp4", "needs at least 13 frames at 24 fps"),
    ({"path": "clip30.mp4", "audio": True}, "has no audio stream"),
    ({"path": "wide.png", "type": "video"}, "type video, but the file is a still image"),
    ({"path": "stereo32k.wav", "type": "image"}, "Pillow decodes no image"),
])
def test_file_refusals(media, entry, message):
    with pytest.raises(ValueError, match=message):
        read_reference(entry, media)


def test_request_rules(media):
    image, clip, sound = (read_reference(p, media) for p in ("wide.png", "clip24.mp4", "mono44k.wav"))
    assert references_problem([image] * 9 + [clip] * 3) is None
    assert "10 image references" in references_problem([image] * 10)
    assert "4 video references" in references_problem([clip] * 4)
    assert "13 references" in references_problem([image] * 9 + [clip] * 3 + [sound])
    assert "audio references alone" in references_problem([sound, sound])


def test_manifest_references_relative_to_the_manifest(media, tmp_path):
    manifest = media / "jobs.yaml"
    manifest.write_text("jobs:\n  - prompt: two stills\n    references: [wide.png, {path: portrait.png}]\n"
                        "  - prompt: reordered\n    references: [portrait.png, wide.png]\n"
                        "  - prompt: plain\n")
    jobs = read_manifest(manifest, LIMITS).jobs
    mixed = job_from_fields({"prompt": "p", "output": "o", "references": ["stereo32k.wav", "wide.png"]}, LIMITS,
                            source=str(media / "cli"))
    assert [r.type for r in mixed.references] == ["audio", "image"] and mixed.task == "ref2va"
    assert [j.task for j in jobs] == ["ref2va", "ref2va", "t2va"]
    assert [r.given for r in jobs[0].references] == ["wide.png", "portrait.png"]
    assert (jobs[0].width, jobs[0].height) == LIMITS.default_canvas  # references never set the canvas
    # order is part of the request (resume key), the paths are not
    assert jobs[0].params()["references"] != jobs[1].params()["references"]
    assert jobs[0].params()["task"] == "ref2va" and "references" not in jobs[2].params()


@pytest.mark.parametrize("fields,message", [
    ({"references": ["wide.png"] * 10}, "10 image references; MiniMax-H3 takes at most 9"),
    ({"references": ["mono44k.wav"]}, "audio references alone are not supported"),
    ({"references": ["clip24.mp4"]}, "references[0]: clip24.mp4: video references (the conditioner's video "
                                     "presentation)"),
    ({"references": ["wide.png", "mono44k.wav"]}, "references[1]: mono44k.wav: audio at 44100 Hz needs resampling to "
                                                  "32000 Hz"),
    ({"references": ["wide.png"], "mode": "fasth3"}, "FastH3 students are t2va-only"),
    ({"references": ["wide.png"], "first_frame": "wide.png"}, "cannot be combined"),
    ({"references": []}, "must be a non-empty list"),
    ({"references": [{"file": "wide.png"}]}, "references[0].file: unknown field; allowed: path, type, audio"),
    ({"references": ["wide.png", {"path": "wide.png", "type": "picture"}]},
     "references[1].type: 'picture' is not one of image, video, audio"),
    ({"references": ["wide.png", "missing.png"]}, "references[1]: "),
    ({"references": ["wide.png"], "reference_audio": "no"}, "must be true or false"),
])
def test_job_refusals(media, monkeypatch, fields, message):
    monkeypatch.chdir(media)
    with pytest.raises(ManifestError) as caught:
        job_from_fields({"prompt": "p", "output": "o", **fields}, LIMITS, adapter_available=True)
    assert message in str(caught.value), str(caught.value)


@pytest.mark.parametrize("args,message", [
    (("--reference", "missing.png"), "missing.png: reference file not found"),
    (("--reference", "folder.png"), "must be a file, not a folder"),
    (("--reference", "notes.mp4"), "not a decodable image, video or audio file"),
    (("--reference", "too_wide.png"), "4.1:1) is outside"),
    (("--reference", "short.mp4"), "needs at least 13 frames"),
    (("--reference", "stereo32k.wav", "--reference-no-audio"), "audio references alone"),
])
def test_cli_refusals_are_one_line_before_load(media, monkeypatch, args, message):
    monkeypatch.chdir(media)
    result = invoke("prompt", "a fox", *args, "-o", str(media / "out.mp4"), "--device", "cpu")
    line = one_error_line(result)
    assert message in line, line
    assert not (media / "out.mp4").exists() and not (media / "out.json").exists()
    assert "encode done" not in result.stderr  # refused before the engine


def test_the_sidecar_says_whether_an_audio_reference_was_cut():
    """A trial: a 0.5 s voice on a 1.625 s job was recorded as "the clip cut to the 1.625 s target"."""
    from types import SimpleNamespace

    import torch

    from h3render.tasks.ref2va import _reference_record

    def used(seconds: float, frames: int) -> str:
        ref = SimpleNamespace(type="audio", path="/v.wav", given="v.wav", sha256="0" * 64,
                              info={"audio_duration_s": seconds, "sample_rate": 32000, "channels": 2})
        kept = min(seconds, frames / 24)
        return _reference_record(1, ref, torch.zeros(2, round(kept * 32000)), iter(()), frames)["used"]

    assert used(0.5, 39) == "audio: first 0.500 s (all of it; the target is 1.625 s), stereo"
    assert used(3.0, 39) == "audio: first 1.625 s (the clip cut to the 1.625 s target), stereo"
