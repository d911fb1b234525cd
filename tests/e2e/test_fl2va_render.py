"""fl2va through the CLI with the tiny model: `prompt --first-frame`, a manifest through `batch` (resume by content
hash), the vision tower loaded from make-checkpoint's official and diffusers layouts, and 2 gloo ranks vs 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_vision
from h3render.make_checkpoint.writer import make_checkpoint
from tests._mp4 import frames_of
from tests._cli import run_forked, run_here
from tests._numerics import rel_err

REPO = Path(__file__).resolve().parents[2]
ARGS = ("--steps", "3", "--seed", "5", "--device", "cpu", "--save-latents", "--vae-batch", "1")


def cli(*args: str, cwd: Path = REPO, forked: bool = False):
    """`h3render ARGS` in this process (`tests._cli.run_here`), or in a process of its own (`run_forked`)."""
    if forked:
        return run_forked(*args, env={"OMP_NUM_THREADS": "1"}, cwd=cwd)
    return run_here(*args, cwd=cwd)


def _png(path: Path, size=(128, 96), seed=0, mode="RGB") -> Path:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8), mode).save(path)
    return path


def _latents(mp4: Path) -> dict:
    return torch.load(mp4.with_name(mp4.stem + ".latents.pt"))


def test_prompt_first_frame_renders_mp4_and_sidecar(tmp_path):
    _png(tmp_path / "a.png", (128, 96), seed=0)
    _png(tmp_path / "b.png", (128, 96), seed=1)
    out = tmp_path / "fox.mp4"
    r = cli("prompt", "A red fox in the snow", "--first-frame", "a.png", "-o", str(out), *ARGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "first frame's aspect (128x96) → 160x128" in r.stderr
    assert "fox: text + keyframes encode done in" in r.stderr  # the stage line a t2va job's text encode has
    frames = frames_of(out)
    assert frames.shape[1:3] == (128, 160)  # the canvas from the 4:3 keyframe by the tiny rule
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["job"]["task"] == "fl2va" and side["job"]["first_frame_sha256"] == side["extra"]["fl2va"][
        "keyframes"][0]["sha256"]
    record = side["extra"]["fl2va"]
    assert record["keyframes"][0]["resize"] == "stretch" and record["keyframes"][0]["given"] == "a.png"
    assert record["presentation"].startswith("<Picture 1>: <|vision_start|><|image_pad|>x")
    assert record["condition_rows"] == (128 // 32) * (160 // 32)
    # the keyframe conditions the video: another picture, same seed, other latents; no keyframe at all, others too
    other = tmp_path / "other.mp4"
    r = cli("prompt", "A red fox in the snow", "--first-frame", "b.png", "-o", str(other), *ARGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert rel_err(_latents(other)["video"], _latents(out)["video"]) > 1e-3
    plain = tmp_path / "plain.mp4"
    r = cli("prompt", "A red fox in the snow", "--width", "160", "--height", "128", "-o", str(plain), *ARGS)
    assert r.returncode == 0, r.stderr
    assert rel_err(_latents(plain)["video"], _latents(out)["video"]) > 1e-3


def test_batch_renders_fl2va_jobs_and_resumes_by_content(tmp_path):
    shots = tmp_path / "shots"
    shots.mkdir()
    _png(shots / "a.png", seed=0)
    _png(shots / "b.png", (96, 96), seed=1, mode="RGBA")
    manifest = shots / "shots.yaml"
    manifest.write_text(
        "defaults: {steps: 3}\n"
        "jobs:\n"
        "  - {id: open, prompt: A door opens, first_frame: a.png}\n"
        "  - {id: close, prompt: A door closes, first_frame: a.png, last_frame: b.png, width: 224, height: 128}\n"
        "  - {id: text, prompt: Rain on a window, width: 224, height: 128}\n")
    out = tmp_path / "renders"
    r = cli("batch", str(manifest), "--out-dir", str(out), "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    for name in ("open", "close", "text"):
        assert (out / f"{name}.mp4").is_file() and (out / f"{name}.json").is_file()
    close = json.loads((out / "close.json").read_text())["extra"]["fl2va"]["keyframes"]
    assert [k["resize"] for k in close] == ["stretch", "cover-crop"] and close[1]["alpha"] == "flattened onto white"
    mtimes = {n: (out / f"{n}.mp4").stat().st_mtime_ns for n in ("open", "close", "text")}
    # same name, new picture: only the jobs using it render again
    _png(shots / "b.png", (96, 96), seed=2, mode="RGBA")
    r = cli("batch", str(manifest), "--out-dir", str(out), "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (out / "open.mp4").stat().st_mtime_ns == mtimes["open"]
    assert (out / "text.mp4").stat().st_mtime_ns == mtimes["text"]
    assert (out / "close.mp4").stat().st_mtime_ns != mtimes["close"]


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_vision_tower_and_processor_load_from_each_layout(layout, tmp_path):
    """make-checkpoint writes the tiny tower (text_encoder's model.visual.*) and processor config in the layout's
    own place; the loaded tower equals the built-in one bit for bit and an fl2va render runs from the folder."""
    ckpt = make_checkpoint(tmp_path / layout, "tiny", layout)
    info = read_checkpoint_info(ckpt)
    assert info.processor.endswith({"official": "FL2VA/processor/preprocessor_config.json",
                                    "diffusers": "processor/processor_config.json"}[layout])
    tower, processor = load_vision(info)
    builtin, _ = load_vision(read_checkpoint_info("tiny"))
    ours, ref = tower.state_dict(), builtin.state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert (processor.patch_size, processor.merge_size) == (8, 2) and processor.size["shortest_edge"] == 65536
    _png(tmp_path / "a.png", (96, 128))
    out = tmp_path / "portrait.mp4"
    r = cli("prompt", "A lighthouse", "--checkpoint", str(ckpt), "--last-frame", str(tmp_path / "a.png"),
            "-o", str(out), *ARGS)
    assert r.returncode == 0, r.stderr
    assert frames_of(out).shape[1:3] == (160, 128)  # 3:4 by the tiny rule


def test_checkpoint_without_processor_refuses_fl2va(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ck", "tiny", "official")
    for f in (ckpt / "FL2VA" / "processor").iterdir():
        f.unlink()
    with pytest.raises(CheckpointError, match="fl2va needs the keyframe image processor"):
        load_vision(read_checkpoint_info(ckpt))


def test_two_gloo_ranks_match_one_for_fl2va(tmp_path):
    """Condition rows are more rows of the layout: Ulysses over 2 ranks and the split VAE decode give the 1-rank
    latents (<= 1e-5) and the same frames."""
    _png(tmp_path / "a.png", (128, 96), seed=3)
    _png(tmp_path / "b.png", (96, 128), seed=4)
    keyframes = ("--first-frame", str(tmp_path / "a.png"), "--last-frame", str(tmp_path / "b.png"))
    one, two = tmp_path / "one.mp4", tmp_path / "two.mp4"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (OMP_NUM_THREADS=1): the thread count moves float rounding
    try:
        r1 = cli("prompt", "Waves on black rocks", *keyframes, "-o", str(one), *ARGS)
    finally:
        torch.set_num_threads(threads)
    assert r1.returncode == 0, r1.stderr
    # Two CPU ranks forked by the command itself (`--gpus 2`; torchrun's launch is tests/cluster/test_parallel.py's)
    r2 = cli("prompt", "Waves on black rocks", *keyframes, "-o", str(two), *ARGS, "--gpus", "2", forked=True)
    assert r2.returncode == 0, r2.stderr
    a, b = _latents(one), _latents(two)
    for key in ("video", "audio"):
        assert rel_err(b[key], a[key]) <= 1e-5, key
    np.testing.assert_array_equal(frames_of(one), frames_of(two))
    assert json.loads(two.with_suffix(".json").read_text())["extra"]["world_size"] == 2
