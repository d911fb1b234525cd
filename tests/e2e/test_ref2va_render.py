"""ref2va through the CLI with the tiny model: `prompt --reference` and a mixed manifest through `batch` (one
engine: the base DiT and `transformer_ref` each loaded once), the sidecar's record of every reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._cli import run_here
from tests._media import png, wav
from tests._numerics import rel_err

ARGS = ("--steps", "3", "--seed", "5", "--device", "cpu", "--save-latents", "--vae-batch", "1")


def _latents(mp4: Path) -> dict:
    return torch.load(mp4.with_name(mp4.stem + ".latents.pt"))


def test_prompt_and_batch_render_ref2va(tmp_path):
    png(tmp_path / "wide.png", (64, 40), seed=0)
    png(tmp_path / "tall.png", (40, 64), seed=1)
    wav(tmp_path / "voice.wav", 1.5, 32000, 2)  # longer than the 0.917 s target: cut
    out = tmp_path / "fox.mp4"
    r = run_here("prompt", "A red fox", "--reference", "wide.png", "--reference", "voice.wav", "--reference",
                 "tall.png", "-o", str(out), *ARGS, "--frames", "22", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ref2va: image wide.png 64x40; audio voice.wav 1.50 s; image tall.png 40x64" in r.stderr
    assert "fox: text + references encode done in" in r.stderr
    side = json.loads(out.with_suffix(".json").read_text())
    record = side["extra"]["ref2va"]
    assert side["job"]["task"] == "ref2va"
    assert [(r["type"], r["audio"]) for r in side["job"]["references"]] == [("image", False), ("audio", True),
                                                                           ("image", False)]
    first = record["references"][0]
    assert (first["type"], first["given"], first["size"], first["encoded_size"]) == ("image", "wide.png", [64, 40],
                                                                                      [96, 64])
    assert first["sha256"] == side["job"]["references"][0]["sha256"] and first["used"] == "image"
    assert record["presentation"].startswith("<Picture 1>: <|vision_start|><|image_pad|>x")
    assert "<|vision_end|><Audio 1>: <Picture 2>: " in record["presentation"]
    assert record["partition"] == "transformer_ref"
    voice = record["references"][1]
    assert (voice["type"], voice["sample_rate"], voice["channels"], voice["duration_s"]) == ("audio", 32000, 2, 1.5)
    assert voice["used"].startswith("audio: first 0.917 s")
    # 22 frames = 29,333 samples -> 37 latents per channel, clean rows in front of the target audio
    assert record["condition_rows"] == (64 // 32) * (96 // 32) * 2 and record["condition_audio_rows"] == 2 * 37
    assert side["extra"]["warmup"]["dit_partitions"]["transformer_ref"] == "resident"
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs/schema/sidecar.schema.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator(schema).validate(side)
    side["job"].pop("references")
    with pytest.raises(jsonschema.ValidationError):  # a ref2va job names its references
        jsonschema.Draft202012Validator(schema).validate(side)

    # a mixed queue: the same references reordered, and a t2va job; one engine, each partition once
    (tmp_path / "jobs.jsonl").write_text(
        json.dumps({"defaults": {"frames": 22}}) + "\n"
        + json.dumps({"id": "swapped", "prompt": "A red fox", "references": ["tall.png", "wide.png"]}) + "\n"
        + json.dumps({"id": "plain", "prompt": "A red fox"}) + "\n")
    r = run_here("batch", "jobs.jsonl", "--out-dir", "renders", *ARGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    swapped, plain = tmp_path / "renders" / "swapped.mp4", tmp_path / "renders" / "plain.mp4"
    warmup = json.loads(plain.with_suffix(".json").read_text())["extra"]["warmup"]
    assert warmup["dit_partitions"] == {"transformer": "resident", "transformer_ref": "resident"}
    assert "transformer_ref_load_s" in warmup and "partition_swaps" not in warmup  # CPU: both stay resident
    # the queue renders its base-partition jobs before the ref2va ones (fewer swaps); the report keeps manifest order
    started = {p.stem: json.loads(p.with_suffix(".json").read_text())["run"]["started_at"] for p in (swapped, plain)}
    assert started["plain"] < started["swapped"]
    report = json.loads((tmp_path / "renders" / "batch-report.json").read_text())
    assert [j["id"] for j in report["jobs"]] == ["swapped", "plain"]
    # the order is part of the request; the references condition the video; the t2va job runs the base DiT
    assert rel_err(_latents(swapped)["video"], _latents(out)["video"]) > 1e-3
    assert rel_err(_latents(plain)["video"], _latents(out)["video"]) > 1e-3
    assert "ref2va" not in json.loads(plain.with_suffix(".json").read_text())["extra"]
