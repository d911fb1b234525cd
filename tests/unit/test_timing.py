"""Stage timer (totals, steps, overlap accounting, warm-up apart), versions, sidecar JSON round trip."""

from __future__ import annotations

import json

import av
import pytest
import torch

import h3render
from h3render.sidecar import write_sidecar
from h3render.timing import StageTimer, merge_intervals, versions


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def timer_and_clock():
    timer = StageTimer("cpu")
    clock = FakeClock()
    timer.now = clock
    return timer, clock


def test_merge_intervals():
    assert merge_intervals([(5, 6), (1, 3), (0, 2), (3, 4)]) == [(0, 4), (5, 6)]
    assert merge_intervals([]) == []


def test_stage_totals_and_steps(timer_and_clock):
    timer, clock = timer_and_clock
    with timer.stage("load"):
        clock.advance(2.0)
    with timer.stage("denoise"):
        for dt in (1.0, 2.0, 3.0):
            with timer.step("denoise"):
                clock.advance(dt)
        clock.advance(0.5)  # work between steps still belongs to the stage
    with timer.stage("vae_audio"):  # entered twice: totals add
        clock.advance(0.25)
    with timer.stage("vae_audio"):
        clock.advance(0.25)
    assert timer.total("load") == 2.0
    assert timer.total("denoise") == 6.5
    assert timer.steps["denoise"] == [1.0, 2.0, 3.0]
    assert timer.total("vae_audio") == 0.5
    assert timer.total("never") == 0.0

    s = timer.summary()
    assert s["stages"]["denoise"]["steps"] == [1.0, 2.0, 3.0]
    assert s["stages"]["load"]["intervals"] == [[0.0, 2.0]]
    assert s["stages"]["denoise"]["intervals"] == [[2.0, 8.5]]
    assert s["wall_s"] == 9.0 and s["concurrent_s"] == 0.0
    assert s["peak_memory_bytes"] is None  # CPU


def test_stage_records_even_when_the_body_raises(timer_and_clock):
    timer, clock = timer_and_clock
    with pytest.raises(RuntimeError):
        with timer.stage("vae_video"):
            clock.advance(1.5)
            raise RuntimeError("oom")
    assert timer.total("vae_video") == 1.5


def test_overlapped_stages_are_not_double_counted(timer_and_clock):
    timer, clock = timer_and_clock
    # Streaming: the encoder thread muxes while the GPU decodes the next windows.
    timer.add_interval("vae_video", 10.0, 20.0)
    timer.add_interval("to_uint8_d2h", 11.0, 12.0)
    timer.add_interval("to_uint8_d2h", 15.0, 16.0)
    timer.add_interval("encode_mux", 12.0, 23.0)
    assert timer.total("vae_video") == 10.0 and timer.total("encode_mux") == 11.0
    assert timer.overlap("vae_video", "encode_mux") == 8.0
    assert timer.overlap("vae_video", "to_uint8_d2h", "encode_mux") == 1.0  # only [15, 16]
    s = timer.summary()
    assert s["wall_s"] == 13.0  # union [10, 23], not 10 + 2 + 11
    assert s["concurrent_s"] == pytest.approx(8.0)  # vae_video with encode_mux; to_uint8_d2h is part of vae_video
    # An explicit 'total' stage is the wall time and stays out of the overlap sum.
    timer.add_interval("total", 9.0, 24.0)
    s = timer.summary()
    assert s["wall_s"] == 15.0 and s["concurrent_s"] == pytest.approx(8.0)
    assert s["stages"]["total"]["intervals"] == [[0.0, 15.0]]
    with pytest.raises(ValueError, match="ends before it starts"):
        timer.add_interval("encode_mux", 5.0, 4.0)


def test_warmup_is_kept_apart(timer_and_clock):
    timer, clock = timer_and_clock
    with timer.warmup("compile"):
        clock.advance(30.0)
    with timer.stage("denoise"):
        clock.advance(4.0)
    s = timer.summary()
    assert s["warmup_s"] == {"compile": 30.0}
    assert s["wall_s"] == 4.0 and "compile" not in s["stages"]


def test_real_clock_and_writer_interval(tmp_path):
    # The writer's marks are on the timer's clock, so its interval can be recorded from another thread.
    from h3render.media import Mp4Writer

    timer = StageTimer(torch.device("cpu"))
    frames = torch.zeros(3, 4, 32, 32, dtype=torch.uint8).permute(1, 2, 3, 0).contiguous()
    with timer.stage("encode_total"):
        with Mp4Writer(tmp_path / "a.mp4", 32, 32, 4, audio=False) as w:
            w.write_frames(frames)
    timer.add_interval("encode_mux", w.marks["start"], w.marks["end"])
    outer = timer.intervals["encode_total"][0]
    inner = timer.intervals["encode_mux"][0]
    assert outer[0] <= inner[0] < inner[1] <= outer[1]
    assert timer.overlap("encode_total", "encode_mux") == pytest.approx(inner[1] - inner[0])


def test_versions_on_cpu():
    v = versions()
    assert v["h3render"] == h3render.__version__
    assert v["torch"] == torch.__version__
    assert v["pyav"] == av.__version__ and v["ffmpeg"] == av.ffmpeg_version_info
    if not torch.cuda.is_available():
        assert v["driver"] is None and v["gpus"] == [] and v["cudnn"] is None
    json.dumps(v)


def test_versions_name_transformers_x264_and_the_checkout_commit():
    """Issue #29: the sidecar lacked the transformers and x264 versions and h3render's commit."""
    import importlib.metadata
    import subprocess
    from pathlib import Path

    v = versions()
    assert v["transformers"] == importlib.metadata.version("transformers")
    assert v["x264"] is not None and v["x264"].startswith("core ") and v["x264"][5:8].isdigit(), v["x264"]
    package = Path(h3render.__file__).resolve().parent
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=package, capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() / "h3render" == package:  # a checkout (CI, here)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True).stdout
        assert v["h3render_commit"].removesuffix("+dirty") == head.strip()
    else:  # an installed wheel
        assert v["h3render_commit"] is None


def test_the_checkout_commit_is_none_without_git_or_outside_a_checkout(monkeypatch, tmp_path):
    import subprocess

    from h3render import timing

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    timing.checkout_commit.cache_clear()
    monkeypatch.setattr(subprocess, "run", no_git)
    assert timing.checkout_commit() is None  # never fails when git is absent
    timing.checkout_commit.cache_clear()
    monkeypatch.undo()
    # a package folder inside some other repository (a venv in a project's work tree) is not a checkout of h3render
    fake = tmp_path / "project" / ".venv" / "site" / "h3render"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    monkeypatch.setattr(h3render, "__file__", str(fake / "__init__.py"))
    assert timing.checkout_commit() is None
    timing.checkout_commit.cache_clear()


def test_sidecar_round_trip(tmp_path, timer_and_clock):
    timer, clock = timer_and_clock
    with timer.stage("denoise"):
        with timer.step("denoise"):
            clock.advance(1.25)
    sigmas = {"video": torch.tensor([1.0, 0.5, 0.0]), "audio": [1.0, 0.25, 0.0]}
    path = write_sidecar(
        tmp_path / "clip.json",
        job_params={"prompt": "a cat", "seed": 7, "frames": 107, "canvas": (1344, 768)},
        checkpoint={"layout": "official", "path": tmp_path / "ckpt"},
        sigmas=sigmas,
        timings=timer,
        versions={"torch": torch.__version__},
        extra={"note": "test"},
    )
    doc = json.loads(path.read_text())
    assert doc["schema"] == 5
    assert doc["job"] == {"prompt": "a cat", "seed": 7, "frames": 107, "canvas": [1344, 768]}
    assert doc["checkpoint"]["path"] == str(tmp_path / "ckpt")
    assert doc["sigmas"] == {"video": [1.0, 0.5, 0.0], "audio": [1.0, 0.25, 0.0]}
    assert doc["timings"]["stages"]["denoise"]["steps"] == [1.25]
    assert doc["timings"]["wall_s"] == 1.25
    assert doc["extra"] == {"note": "test"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.json"]  # no temp left behind


def test_sidecar_refuses_nan_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="clip.json"):
        write_sidecar(tmp_path / "clip.json", job_params={}, checkpoint={},
                      sigmas={"video": [float("nan")]}, timings={}, versions={})
    with pytest.raises(ValueError, match="not JSON-serializable"):
        write_sidecar(tmp_path / "clip.json", job_params={"x": object()}, checkpoint={},
                      sigmas={}, timings={}, versions={})
    assert list(tmp_path.iterdir()) == []


def test_rendered_with_names_what_changed_since_a_skipped_render():
    from h3render.sidecar import rendered_with

    side = {"checkpoint": {"path": "/m/a", "config_hash": "h1"},
            "run": {"encoder": {"crf": 18, "x264_preset": "veryfast"}}}
    same = rendered_with(side, {"path": "/m/a", "config_hash": "h1"}, {"crf": 18, "x264_preset": "veryfast"})
    assert same is None
    note = rendered_with(side, {"path": "/m/b", "config_hash": "h2"}, {"crf": 23, "x264_preset": "veryfast"})
    assert note == "rendered earlier with checkpoint /m/a (now /m/b), crf 18 (now 23)"
    # same folder, new weights: the config hash says so; a schema-1 sidecar (no run.encoder) compares the checkpoint
    note = rendered_with({"checkpoint": {"path": "/m/a", "config_hash": "h1"}}, {"path": "/m/a", "config_hash": "h3"},
                         {"crf": 30, "x264_preset": "slow"})
    assert note == "rendered earlier with checkpoint config h1 (now h3)"
    note = rendered_with(side, {"path": "/m/a", "config_hash": "h1", "transformer": "/t.st"},
                         {"crf": 18, "x264_preset": "veryfast"})
    assert note == "rendered earlier with --transformer none (now /t.st)"
