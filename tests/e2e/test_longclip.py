"""Clips longer than one pass (issue #24): a 30 s clip of the tiny model at the smallest canvas, rendered through the
batch queue as windowed continuation, killed in window 2 and resumed; then its frame count, audio length, windows,
first window and seams. One render for all of it (module fixture): CI is at its time limit."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pytest
import torch

from h3render.batch import run_batch
from h3render.checkpoint.info import read_checkpoint_info
from h3render.engine import Engine
from h3render.manifest import job_from_fields
from h3render.parallel.groups import ParallelContext
from h3render.render import generate
from h3render.settings import RunSettings
from h3render.signals import Interrupted
from h3render.spec import audio_samples
from h3render.tasks import continuation, t2va, windows_of
from h3render.timing import StageTimer
from tests._cli import invoke, one_error_line
from tests._mp4 import decode

jsonschema = pytest.importorskip("jsonschema")
LIMITS = read_checkpoint_info("tiny").limits()
FIELDS = {"prompt": "Waves rolling onto a pebble beach", "duration": 30, "width": 32, "height": 32, "steps": 2,
          "seed": 5, "id": "long"}


@pytest.fixture(scope="module")
def engine():
    return Engine.load(RunSettings(progress=False, save_latents=True), ParallelContext(0, 1, 0, torch.device("cpu")))


@pytest.fixture(scope="module")
def clip(engine, tmp_path_factory):
    """The 30 s job rendered by the batch queue: first interrupted (as by SIGTERM) while window 2 prepares, then
    resumed. Returns (job, out dir, what the first run left, the two reports)."""
    out = tmp_path_factory.mktemp("long")
    job = job_from_fields({**FIELDS, "output": "long"}, LIMITS)
    engine.prepare([job])
    real = continuation.prepare

    def dies_in_window_2(engine_, window, timer):
        if getattr(window, "window_index", 0) == 1:
            raise Interrupted("killed in window 2", signum=15)
        return real(engine_, window, timer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(continuation, "prepare", dies_in_window_2)
        killed = run_batch([job], lambda: engine, out, quiet=True)
    left = sorted(p.name for p in out.iterdir())
    resumed = run_batch([job], lambda: engine, out, quiet=True)
    return job, out, left, killed, resumed


def test_a_kill_in_window_2_leaves_nothing_under_the_final_name_and_resume_completes_it(clip):
    job, out, left, killed, resumed = clip
    assert killed.exit_code == 130 and killed.jobs[0].status == "interrupted"
    assert "long.mp4" not in left and "long.json" not in left and not any(".tmp." in n for n in left), left
    assert resumed.exit_code == 0 and resumed.jobs[0].status == "succeeded"
    assert (out / "long.mp4").is_file() and (out / "long.json").is_file()


def test_a_30_s_clip_has_exact_frames_and_audio_and_lists_its_windows(clip):
    job, out, *_ = clip
    assert job.task == "continuation" and job.frames == 720 and job.window == 345 and job.overlap == 22
    frames, audio = decode(out / "long.mp4")
    assert frames.shape[:3] == (720, 32, 32)
    samples = audio_samples(720)  # 960,000: exactly 30 s at 32 kHz went into the encoder
    assert samples == 960_000 and abs(audio.shape[1] - samples) <= 1024  # AAC: within one frame of it
    doc = json.loads((out / "long.json").read_text())
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs/schema/sidecar.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert doc["job"]["task"] == "continuation" and doc["job"]["frames"] == 720 and doc["extra"]["frames_written"] == 720
    windows = doc["extra"]["windows"]
    assert [(w["index"], w["frames"], w["seed"], w["task"], w["start"], w["overlap"], w["keep"]) for w in windows] == [
        (0, 260, 5, "t2va", 0, 0, 238), (1, 260, 6, "continuation", 238, 22, 238),
        (2, 260, 7, "continuation", 476, 22, 244)]
    assert windows[1]["continuation"]["conditioned_on"] == "the last 7 latent frames of window 0"
    assert windows[2]["continuation"]["anchor_frames"] == [0, 1, 5, 9, 13, 17, 18]
    assert all(w["sigmas"]["forwards"] == 1 and "peak_memory_bytes" in w for w in windows)
    assert windows[0]["delivered_s"] <= windows[1]["started_s"] <= windows[2]["started_s"]


def test_the_first_window_is_a_plain_render_and_the_next_continue_it(engine, clip):
    job, out, *_ = clip
    plain = replace(job, frames=260, window=None, overlap=0)
    assert plain.task == "t2va" and windows_of(job)[0][0] == plain
    timer = StageTimer("cpu")
    alone = generate(engine, plain, t2va.prepare(engine, plain, timer), engine.schedule(plain), timer)
    saved = [torch.load(out / name) for name in ("long.latents.pt", "long.latents.1.pt")]
    assert torch.equal(saved[0]["video"], alone.video) and torch.equal(saved[0]["audio"], alone.audio)
    # window 2 is not what its seed draws alone: the previous window's tail conditions it
    second = replace(plain, seed=6)
    unconditioned = generate(engine, second, t2va.prepare(engine, second, timer), engine.schedule(second), timer)
    assert not torch.equal(saved[1]["video"], unconditioned.video)


def test_the_seams_change_no_more_than_frames_inside_a_window(clip):
    job, out, *_ = clip
    frames, _ = decode(out / "long.mp4")
    change = np.abs(np.diff(frames.astype(np.float32), axis=0)).mean(axis=(1, 2, 3))  # frame k -> k + 1
    inside = np.median(change[:237])  # window 0's own frames
    for w in job.windows[1:]:
        seam = change[w.start - 1: w.start + w.overlap]  # into the fade, through it, out of it
        assert seam.max() <= inside, (w, seam, inside)
        # the fade blends: two windows' frames averaged change less than one window's (a hard cut would not)
        assert seam.mean() < 0.9 * inside, (seam.mean(), inside)


def test_the_plan_line_counts_windows_and_past_120_s_is_refused(tmp_path):
    manifest = tmp_path / "m.yaml"
    manifest.write_text("jobs:\n  - {id: a, prompt: surf, duration: 30, width: 32, height: 32}\n"
                        "  - {id: b, prompt: surf, duration: 90, mode: t2va}\n")
    result = invoke("batch", str(manifest), "--dry-run", "--out-dir", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output
    assert "30 s → 720 frames = 30 s in 3 windows of 260 frames, 22-frame overlaps cross-faded" in result.output
    assert "90 s → 2160 frames = 90 s in 7 windows of 328 frames" in result.output
    line = one_error_line(invoke("prompt", "surf", "-o", str(tmp_path / "x.mp4"), "--duration", "121"))
    assert "duration: 121 s is 2904 frames (121 s), longer than the 120 s" in line, line
    line = one_error_line(invoke("prompt", "surf", "-o", str(tmp_path / "x.mp4"), "--frames", "2881"))
    assert "frames: 2881 is 2881 frames (120.042 s), longer than the 120 s (2880 frames)" in line, line


def test_fasth3_clips_render_plain_t2va_windows():
    fields = {k: v for k, v in FIELDS.items() if k != "steps"}
    job = job_from_fields({**fields, "mode": "fasth3", "output": "f"}, LIMITS, adapter_available=True)
    windows, plan = windows_of(job)
    assert [(w.task, w.mode, w.seed, w.frames) for w in windows] == [("t2va", "fasth3", 5 + i, 260) for i in range(3)]
    assert plan == job.windows and "not conditioned on each other (FastH3 students are t2va-only)" in job.time_note()


def test_keyframes_of_a_long_clip_go_to_the_windows_they_fall_in(engine, tmp_path):
    from PIL import Image

    for name, value in (("a.png", 30), ("b.png", 220)):
        Image.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(tmp_path / name)
    job = job_from_fields({**FIELDS, "output": "k", "first_frame": "a.png", "keyframes": ["250:b.png"]}, LIMITS,
                          source=str(tmp_path / "m.yaml"))
    windows, plan = windows_of(job)
    # frame 250 lies in window 0 (frames 0-259) at 250 and in window 1 (238-497) at 12; the first frame in window 0
    assert [[k.anchor for k in w.keyframes] for w in windows] == [[0, 250], [12], []]
    assert windows[0].task == "fl2va" and windows[1].task == windows[2].task == "continuation"
    # window 1's rows: the previous tail's 7 latent frames, then its keyframe at frame 12 with the vision prompt
    tail = torch.zeros(24, 7, 2, 2)
    prepared = continuation.prepare(engine, continuation.follow(windows[1], SimpleNamespace(video=tail)),
                                    StageTimer("cpu"))
    layout = prepared.layout
    assert layout.keyframe_anchors == (0, 1, 5, 9, 13, 17, 18, 12)
    assert prepared.condition_rows.shape[0] == 8 * layout.rows_per_frame
    assert bool((layout.token_tags[: layout.text_len] == 0).any())  # the picture's vision block in the prompt rows
    record = prepared.record["continuation"]
    assert record["keyframes"][0]["anchor"] == 12 and "<Picture 1>" in record["presentation"]
    json.dumps(record)  # all of it goes into the sidecar


def test_a_long_clip_through_the_cli_plans_memory_by_its_longest_window(tmp_path):
    """`h3render prompt --duration 16` (384 frames, not 17n + 5) raised "frames must be 17n + 5" from the memory
    plan, which sized the clip's whole frame count as one pass: a traceback for the README's own long-clip command."""
    from tests._cli import run_here

    out = tmp_path / "long.mp4"
    r = run_here("prompt", "A slow dolly along a night market", "--duration", "16", "--width", "32", "--height", "32",
                 "--steps", "2", "-o", str(out), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert decode(out)[0].shape[0] == 384
