"""docs/schema/*.schema.json against real sidecars and a real batch report from tiny renders (in-process CLI runs), and
the sidecar's `run` facts: what device, dtypes and attention actually ran, where the MP4 went, when the job started."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests._cli import run_here

jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parents[2]
SMALL = ("--width", "128", "--height", "64", "--frames", "22")


def schema(name: str) -> dict:
    doc = json.loads((REPO / "docs" / "schema" / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(doc)
    return doc


def validate(doc: dict, name: str) -> None:
    jsonschema.Draft202012Validator(schema(name)).validate(doc)


@pytest.fixture(scope="module")
def t2va(tmp_path_factory):
    """One base-model render on CPU asking for fa3 (which CPU cannot run): (sidecar, stderr, before, after)."""
    out = tmp_path_factory.mktemp("t2va") / "clip.mp4"
    before = datetime.now(timezone.utc)
    r = run_here("prompt", "Gulls over a harbour", "-o", str(out), *SMALL, "--steps", "3", "--device", "cpu",
                 "--attention", "fa3")
    after = datetime.now(timezone.utc)
    assert r.returncode == 0, r.stderr
    return json.loads(out.with_suffix(".json").read_text()), r.stderr, before, after, out


def test_t2va_sidecar_matches_the_schema_and_says_what_ran(t2va):
    side, stderr, before, after, out = t2va
    validate(side, "sidecar")
    # `-o x.MP4` is accepted (the suffix is checked without case), and its sidecar failed the schema (a trial)
    validate({**side, "run": {**side["run"], "output": "/renders/x.MP4"}}, "sidecar")
    # The tiny model's notice comes once the run is checked (after the --attention warning), then the plan line.
    lines = stderr.splitlines()
    notice = next(i for i, line in enumerate(lines) if "no checkpoint given" in line)
    assert "--attention fa3 applies on CUDA only" in "".join(lines[:notice]), stderr
    assert " frames = " in lines[notice + 1] and lines[-1].startswith("h3render: wrote "), stderr
    run = side["run"]
    assert run["output"] == str(out.resolve())
    assert before - timedelta(seconds=1) <= datetime.fromisoformat(run["started_at"]) <= after
    assert run["device"]["type"] == "cpu" and run["device"]["ranks"] == 1
    assert run["dtype"] == "float32" and run["dtypes"]["audio_vae"] == "float32"  # CPU default fp32
    # what ran: --precision bf16 (the default) means no FP8, and a CPU run computes in fp32 (it said "bf16": a trial)
    assert run["precision"] == "fp32" and run["precision_components"]["dit_blocks"] == "fp32"
    assert run["memory"]["precision"] == "fp32"
    # fa3 was asked for; CPU ran torch SDPA, and both the warning and the sidecar say so
    assert run["attention"] == {"requested": "fa3", "dit": "sdpa", "vae": "sdpa"}
    warning = [line for line in stderr.splitlines() if "warning" in line and "--attention fa3" in line]
    assert len(warning) == 1 and "sdpa" in warning[0]


def test_sidecar_records_the_command_line_and_the_software(t2va):
    """Issue #29: the sidecar lacked the command line, h3render's commit and the transformers and x264 versions."""
    import sys

    side = t2va[0]
    assert side["run"]["argv"] == sys.argv  # run_here runs in this process: its command line is pytest's
    versions = side["versions"]
    assert versions["x264"].startswith("core ") and versions["transformers"]
    assert "h3render_commit" in versions
    for field in ("x264", "transformers", "h3render_commit"):
        missing = copy.deepcopy(side)
        del missing["versions"][field]
        with pytest.raises(jsonschema.ValidationError):
            validate(missing, "sidecar")


def test_the_sidecar_reports_the_soundtrack_level_and_a_real_model_warns_of_clipping(t2va, tmp_path):
    """Issue #29: decoded audio beyond full scale was clipped silently. The tiny random model's noise is saturated:
    the sidecar says so, and the command stays quiet about it (its notice already says it renders noise); a
    checkpoint that is not a random model's gets one warning line."""
    side, stderr = t2va[0], t2va[1]
    audio = side["extra"]["audio"]
    assert audio["clipped_samples"] > 0 and audio["peak_dbfs"] == 0.0 and 0 < audio["clipped_fraction"] < 1
    from h3render.spec import audio_samples

    assert audio["samples"] == 2 * audio_samples(side["extra"]["frames_written"])  # both channels, the MP4's length
    assert "were clipped" not in stderr
    from h3render.make_checkpoint.writer import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", config="tiny", layout="official")
    index = ckpt / "FL2VA" / "model_index.json"
    meta = json.loads(index.read_text())
    del meta["_minimax_h3"]["h3render_random"]  # now it reads as a real checkpoint of this architecture
    index.write_text(json.dumps(meta))
    out = tmp_path / "real.mp4"
    # --max-gpu-memory: the memory plan's line prints on the CPU too (it printed through --quiet on a GPU)
    r = run_here("prompt", "Gulls over a harbour", "-o", str(out), *SMALL, "--steps", "2", "--checkpoint", str(ckpt),
                 "--quiet", "--max-gpu-memory", "1000")
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "were clipped" in line]
    clipped = json.loads(out.with_suffix(".json").read_text())["extra"]["audio"]["clipped_samples"]
    assert clipped > 0 and len(warned) == 1 and warned[0].startswith(
        f"h3render: warning: real.mp4: {clipped} of "), r.stderr
    # --quiet: the warning alone (no plan line, no "wrote" line: they printed before, issue #29 round 2)
    assert r.stderr.splitlines() == warned and r.stdout == "", r.stderr


def test_writer_stats_are_durations_on_the_jobs_scale(t2va):
    side = t2va[0]
    writer, stages = side["extra"]["writer"], side["timings"]["stages"]
    # open -> rename is the encode_mux interval itself; raw perf_counter values would be far larger than the job
    assert writer["open_s"] == pytest.approx(stages["encode_mux"]["seconds"], abs=1e-6)
    assert 0 < writer["last_frame_in_s"] <= writer["frames_done_s"] <= writer["open_s"] <= stages["total"]["seconds"]
    assert writer["flush_s"] + writer["trailer_s"] + writer["sync_s"] == pytest.approx(writer["finalize_s"])
    assert "overlapped_s" not in side["timings"] and "overlap" not in side["timings"]
    # concurrent_s: encode_mux beside vae_video, never more than the shorter of the two
    timings = side["timings"]
    assert 0 <= timings["concurrent_s"] <= min(stages["encode_mux"]["seconds"], stages["vae_video"]["seconds"]) + 1e-9


def test_non_tty_prompt_prints_a_line_per_stage(t2va):
    """Denoise counts DiT forwards: a job of `steps` sigma points runs steps - 1 of them (a trial read "7/7 steps"
    beside the sidecar's `job.steps` 8)."""
    stderr = t2va[1]
    for stage, count in (("text encode", "(1/1 prompt)"), ("denoise", "(2/2 forwards)"), ("decode", "(22/22 frames)"),
                         ("encode", "(22/22 frames)")):
        lines = [line for line in stderr.splitlines() if line.startswith(f"h3render: clip: {stage} done in ")]
        assert len(lines) == 1 and lines[0].endswith(count), (stage, stderr)


def test_schema_rejects_the_old_field_names(t2va):
    side = t2va[0]
    old = copy.deepcopy(side)
    old["timings"]["overlapped_s"] = old["timings"].pop("concurrent_s")
    with pytest.raises(jsonschema.ValidationError):
        validate(old, "sidecar")
    raw = copy.deepcopy(side)
    raw["extra"]["writer"]["start"] = 1234567.8  # a perf_counter instant
    with pytest.raises(jsonschema.ValidationError):
        validate(raw, "sidecar")
    no_run = copy.deepcopy(side)
    del no_run["run"]["device"]
    with pytest.raises(jsonschema.ValidationError):
        validate(no_run, "sidecar")


def test_fasth3_sidecar_with_adapter_implied_mode(tmp_path):
    from h3render.checkpoint.releases import RELEASES
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    adapter = tmp_path / "adapter.safetensors"
    write_synthetic_adapter(adapter, RELEASES["tiny"].dit, 0)
    out = tmp_path / "fast.mp4"
    r = run_here("prompt", "A drum solo", "-o", str(out), *SMALL, "--adapter", str(adapter))  # no --mode
    assert r.returncode == 0, r.stderr
    assert "--mode fasth3" in r.stderr
    side = json.loads(out.with_suffix(".json").read_text())
    validate(side, "sidecar")
    assert side["job"]["mode"] == "fasth3" and side["job"]["steps"] is None
    assert side["extra"]["fasth3"]["path"] == str(adapter)


def test_batch_report_and_its_sidecars_match_the_schemas(tmp_path):
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps({"id": name, "prompt": f"Rain, take {name}", "frames": 22, "steps": 2,
                                            "width": 128, "height": 64}) + "\n" for name in "ab"))
    out = tmp_path / "out"
    r = run_here("batch", str(manifest), "--out-dir", str(out), "--seed", "11")
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "batch-report.json").read_text())
    validate(report, "batch-report")
    assert report["state"] == "finished" and report["counts"]["succeeded"] == 2
    for name in "ab":
        side = json.loads((out / f"{name}.json").read_text())
        validate(side, "sidecar")
        assert side["job"]["seed"] == 11  # --seed: a batch-wide default (the jobs name none)
    # in a log, batch prints no stage lines for stages shorter than 10 s (one line per job instead)
    assert " done in " not in r.stderr and "job 2/2" in r.stderr
    r = run_here("batch", str(manifest), "--out-dir", str(out), "--seed", "11")  # resume: both skipped
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "batch-report.json").read_text())
    validate(report, "batch-report")
    assert [j["status"] for j in report["jobs"]] == ["skipped", "skipped"] and report["load_seconds"] is None


def test_fl2va_sidecar_matches_the_schema(tmp_path):
    # fl2va sidecars carried job.task, the keyframe hashes, the vae_encode stage and extra.fl2va, none of which the
    # schema allowed (a fresh user's jsonschema check failed on them). An RGBA first frame (alpha flattened) and a
    # portrait last frame (cover-crop) exercise the optional keyframe fields.
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (96, 128, 4), dtype=np.uint8), "RGBA").save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (128, 96, 3), dtype=np.uint8)).save(tmp_path / "b.png")
    out = tmp_path / "door.mp4"
    r = run_here("prompt", "A door opens", "--first-frame", "a.png", "--last-frame", "b.png", "-o", str(out),
                 "--steps", "2", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    side = json.loads(out.with_suffix(".json").read_text())
    validate(side, "sidecar")
    first, last = side["extra"]["fl2va"]["keyframes"]
    assert first["alpha"] == "flattened onto white" and last["resize"] == "cover-crop"
    assert side["job"]["first_frame_sha256"] == first["sha256"] and "vae_encode" in side["timings"]["stages"]
    # and the schema still holds its line: a t2va job may not claim a keyframe hash, an fl2va one must have one
    t2va = copy.deepcopy(side)
    del t2va["job"]["task"]
    with pytest.raises(jsonschema.ValidationError):
        validate(t2va, "sidecar")
    bare = copy.deepcopy(side)
    del bare["job"]["first_frame_sha256"], bare["job"]["last_frame_sha256"]
    with pytest.raises(jsonschema.ValidationError):
        validate(bare, "sidecar")
