"""CPU smoke run of scripts/bench.py's `ref2va` stage (scripts/bench_ref2va.py) at the tiny model's shapes, through
the CLI flags the device call uses, so the functions the GPU runs are the ones that ran here: every measurement
row is there and finite, the ref2va layout has the image, video and soundtrack rows, and both DiT partitions served
the complete MP4s of one engine."""

from __future__ import annotations

import math

from tests._bench import run_bench


def test_ref2va_stage_on_cpu(tmp_path):
    argv = ["--stages", "ref2va", "--ref2va-model", "tiny", "--ref2va-device", "cpu", "--ref2va-canvas", "128x64x22",
            "--ref2va-forwards", "1", "--ref2va-video-seconds", "0.6", "--ref2va-reps", "1"]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "ref2va"]
    assert not [r for r in rows if "error" in r], rows
    by = {r["what"]: r for r in rows}
    assert by["image reference: resize + vision tower"]["encoded_size"] == [128, 64]  # 1920x1080 at short edge 64
    encode = by["video VAE encode: image 128x64, video 22 frames 128x64"]
    assert encode["image_latent"] == [24, 1, 4, 8] and encode["video_latent"] == [24, 7, 4, 8]
    sound = next(r for r in rows if r["what"].startswith("audio VAE encode of the soundtrack"))
    assert sound["audio_latents"] == 37 and math.isfinite(sound["ours_s"])  # 22 frames = 0.917 s -> 37 latents
    plain, ref = by["DiT forward, t2va"], by["DiT forward, ref2va"]
    assert ref["condition_rows"] == 2 * 4 + 7 * 2 * 4 and ref["condition_audio_rows"] == 2 * 37
    assert ref["rows"] == ref["text_rows"] + 64 + 74 + (plain["rows"] - plain["text_rows"])
    text = next(r for r in rows if r["what"].startswith("text encoder 256 vs "))
    assert text["video_blocks"] == 1  # 22 frames at 2 fps: 2 samples, one block
    for r in (plain, ref, text):
        assert math.isfinite(r["ours_s"]) and r["ours_s"] > 0
    mp4s = [r for r in rows if r["what"].startswith("complete MP4")]
    assert [r["what"].split(", ")[1] for r in mp4s] == ["t2va", "ref2va", "t2va"]
    assert all(r["wall_s"] > 0 and "denoise" in r["stages"] for r in mp4s) and "vae_encode" in mp4s[1]["stages"]
    warm = by["warm-up (outside job timings)"]["warmup"]
    assert warm["dit_partitions"] == {"transformer": "resident", "transformer_ref": "resident"}
