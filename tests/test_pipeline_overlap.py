"""`Renderer.begin` / `finish` with the built-in tiny model on CPU, in-process: an overlapped queue renders exactly what
the sequential one does (decoded frames and samples compared exactly), a failing or cancelled finish leaves no file,
and the memory guard makes the queue run a pair one after the other when the device reports too little free memory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from h3render import pipeline
from h3render.batch import run_batch
from h3render.jobs import Job
from h3render.parallel.groups import init_parallel
from h3render.pipeline import EngineSettings, RenderError, Renderer
from tests._mp4 import decode


@pytest.fixture(scope="module")
def renderer():
    torch.set_flush_denormal(True)  # as the CLI does on CPU (random tiny weights make denormals)
    # One intra-op thread: on a 2-core CI machine torch's OpenMP threads and x264's threads otherwise contend and
    # a 0.1 s tiny job takes anything up to seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    r = Renderer.load("tiny", init_parallel("cpu"), torch.float32, EngineSettings(progress=False))
    r.prepare(make_jobs())
    yield r
    torch.set_num_threads(threads)


def make_jobs(n: int = 3) -> list[Job]:
    return [Job(id=f"j{i}", prompt=f"Waves on a pier at night, take {i}", width=128, height=64, frames=22,
                seed=10 + i, steps=3, mode="t2va", output=f"clips/j{i}") for i in range(n)]


def files_under(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def test_overlapped_queue_renders_what_the_sequential_queue_renders(renderer, tmp_path):
    jobs = make_jobs()
    seq = run_batch(jobs, lambda: renderer, tmp_path / "seq", progress=False, overlap=False)
    ovl = run_batch(jobs, lambda: renderer, tmp_path / "ovl", progress=False, overlap=True)
    assert seq.exit_code == ovl.exit_code == 0
    report = json.loads((tmp_path / "ovl" / "batch-report.json").read_text())
    assert report["overlap"]["enabled"] and report["overlap"]["overlapped_finishes"] == 2
    for job in jobs:
        a_frames, a_samples = decode(tmp_path / "seq" / f"{job.output}.mp4")
        b_frames, b_samples = decode(tmp_path / "ovl" / f"{job.output}.mp4")
        assert a_frames.shape == (22, 64, 128, 3) and a_frames.std() > 1  # noise from random weights, not blank
        np.testing.assert_array_equal(a_frames, b_frames)
        np.testing.assert_array_equal(a_samples, b_samples)
        a = json.loads((tmp_path / "seq" / f"{job.output}.json").read_text())
        b = json.loads((tmp_path / "ovl" / f"{job.output}.json").read_text())
        assert a["job"] == b["job"] == json.loads(json.dumps(job.params()))
        assert a["sigmas"] == b["sigmas"]
        assert "overlap" not in a["timings"]
        stages = b["timings"]["stages"]
        # every stage of the job is this job's own, and both phases count in the job's total
        assert {"text_encode", "denoise", "vae_audio", "vae_video", "encode_mux", "total"} <= set(stages)
        assert len(stages["total"]["intervals"]) == 2
    # j1's begin ran beside j0's finish, and j1's finish beside j2's begin (each finish starts on the worker just
    # before the main thread starts the next begin, and outlasts that tiny begin's start)
    with_ = {(w["job"], w["phase"]): w["seconds"] for w in json.loads((tmp_path / "ovl/clips/j1.json").read_text())
             ["timings"]["overlap"]["with"]}
    assert set(with_) == {("j0", "finish"), ("j2", "begin")} and min(with_.values()) > 0


def test_render_is_begin_then_finish(renderer, tmp_path):
    job = make_jobs(1)[0]
    renderer.render(job, tmp_path / "a.mp4", tmp_path / "a.json")
    pending = renderer.begin(job, tmp_path / "b.mp4", tmp_path / "b.json")
    assert pending.video_latent.shape[0] == 24 and pending.audio_latent.shape[:2] == (2, 32)
    assert files_under(tmp_path) == {"a.mp4", "a.json"}  # begin writes nothing
    renderer.finish(pending)
    np.testing.assert_array_equal(decode(tmp_path / "a.mp4")[0], decode(tmp_path / "b.mp4")[0])


def test_cancelled_finish_leaves_no_file(renderer, tmp_path):
    pending = renderer.begin(make_jobs(1)[0], tmp_path / "c.mp4", tmp_path / "c.json")
    calls = []

    def cancel():
        calls.append(1)
        if len(calls) > 1:  # the check before decoding passes; the one at the first decoded chunk stops the job
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        renderer.finish(pending, cancel=cancel)
    assert len(calls) == 2 and files_under(tmp_path) == set()


def test_failing_finish_fails_its_job_only(renderer, tmp_path, monkeypatch):
    """A writer error in j0's finish (which ran beside j1's begin): j0 failed, no file under its name; j1, j2 fine."""
    real = renderer._write_chunk

    def write_chunk(writer, first, frames):
        if writer.path.name == "j0.mp4":
            raise RenderError(f"the video VAE produced non-finite pixels at frame {first}")
        return real(writer, first, frames)

    monkeypatch.setattr(renderer, "_write_chunk", write_chunk)
    report = run_batch(make_jobs(), lambda: renderer, tmp_path, progress=False, overlap=True)
    assert [j.status for j in report.jobs] == ["failed", "succeeded", "succeeded"]
    assert report.jobs[0].error == "RenderError: the video VAE produced non-finite pixels at frame 0"
    assert report.jobs[0].overlap["finish"] == "overlapped"
    assert files_under(tmp_path) == {"batch-report.json", "clips/j1.mp4", "clips/j1.json", "clips/j2.mp4",
                                     "clips/j2.json"}
    assert decode(tmp_path / "clips/j2.mp4")[0].shape[0] == 22


def test_memory_guard_runs_the_pair_one_after_the_other(renderer, tmp_path, monkeypatch):
    """A CUDA device reporting 1 GB free (cudaMemGetInfo faked) with overlap_min_free_gb 8: no finish overlaps."""
    monkeypatch.setattr(pipeline, "device_free_bytes", lambda device: 1_000_000_000)
    monkeypatch.setattr(renderer, "settings", dataclasses.replace(renderer.settings, overlap_min_free_gb=8.0))
    report = run_batch(make_jobs(), lambda: renderer, tmp_path, progress=False, overlap=True)
    assert report.exit_code == 0
    data = json.loads((tmp_path / "batch-report.json").read_text())
    reason = "1.0 GB free < 8.0 GB needed (overlap_min_free_gb)"
    assert data["overlap"]["overlapped_finishes"] == 0 and data["overlap"]["skipped"] == 2
    assert [j["overlap"]["skipped"] for j in data["jobs"]] == [reason, reason, None]
    assert [j["overlap"]["finish"] for j in data["jobs"]] == ["alone"] * 3
    for name in ("j0", "j1"):
        ov = json.loads((tmp_path / f"clips/{name}.json").read_text())["timings"]["overlap"]
        assert ov["finish"] == "alone" and ov["skipped"] == reason and ov["with"] == []
        assert ov["memory"] == {"ok": False, "reason": reason, "free_gb": 1.0, "need_gb": 8.0}
    # sequential for real: each finish ended before the next begin started
    j0 = json.loads((tmp_path / "clips/j0.json").read_text())["timings"]["overlap"]["phases"]
    j1_begin_start = j0["finish"][0][1]  # relative to j0's begin; j1's own phases are relative to j1's begin
    assert j0["finish"][0][0] >= j0["begin"][0][1] and j1_begin_start > 0


def test_memory_estimate_from_measured_peaks(renderer, monkeypatch):
    monkeypatch.setattr(pipeline, "device_free_bytes", lambda device: 50_000_000_000)
    monkeypatch.setattr(renderer, "_peaks", {})
    job = make_jobs(1)[0]
    pending = pipeline.PendingJob(job, Path("x.mp4"), Path("x.json"), None, None, None, None)
    check = renderer.plan_overlap(pending, job)
    assert not check.ok and check.reason == "no measured decode peak for 128x64"
    renderer._peaks[("decode", 128, 64)] = 20_000_000_000  # warm-up estimate
    check = renderer.plan_overlap(pending, job)
    assert not check.ok and check.reason.startswith("no measured denoise peak for 128x64x22 yet")
    renderer._peaks[("begin", 128, 64, 22)] = 10_000_000_000  # a begin that ran alone
    check = renderer.plan_overlap(pending, job)
    assert check.ok and check.need_bytes == 36_000_000_000 and check.free_bytes == 50_000_000_000
    renderer._peaks[("finish", 128, 64)] = 35_000_000_000  # a finish measured alone needed more than estimated
    check = renderer.plan_overlap(pending, job)
    assert not check.ok and check.need_bytes == 54_000_000_000
    assert check.reason == "50.0 GB free < 54.0 GB needed (1.2 x (decode 35.0 GB + denoise 10.0 GB))"
    monkeypatch.setattr(pipeline, "device_free_bytes", lambda device: None)  # CPU: always allowed
    assert renderer.plan_overlap(pending, job).ok
