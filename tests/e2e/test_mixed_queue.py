"""A mixed queue on one engine: t2va jobs on the base weights, then the FastH3 student fused in place once
(`Engine.fuse_student`), equal to engines that load base-only or fused-at-load."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3render.checkpoint.releases import RELEASES
from h3render.engine import Engine
from h3render.errors import RenderError
from h3render.jobs import Job
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings
from tests._numerics import rel_err

CTX = ParallelContext(0, 1, 0, torch.device("cpu"))
SETTINGS = RunSettings(progress=False, save_latents=True)  # tiny, fp32 on the CPU
BASE = Job(id="a", prompt="Gulls over a harbour", width=128, height=64, frames=22, seed=5, steps=3, mode="t2va",
           output="a")
FAST = replace(BASE, id="b", prompt="A kettle whistles", seed=6, steps=None, mode="fasth3", output="b")


def latents(engine, job, folder):
    engine.render(job, folder / f"{job.output}.mp4", folder / f"{job.output}.json")
    return torch.load(folder / f"{job.output}.latents.pt")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return str(write_synthetic_adapter(tmp_path_factory.mktemp("ad") / "adapter.safetensors",
                                       RELEASES["tiny"].dit, seed=2))


def test_mixed_engine_matches_base_then_fused_engines(adapter, tmp_path):
    (tmp_path / "base").mkdir(), (tmp_path / "fused").mkdir(), (tmp_path / "student-schedule").mkdir()
    mixed = Engine.load(replace(SETTINGS, adapter=adapter), CTX, base_jobs_first=True)
    mixed.prepare([BASE, FAST])
    got_base = latents(mixed, BASE, tmp_path)
    assert "fasth3_fusion_s" not in mixed.warmup
    got_fast = latents(mixed, FAST, tmp_path)
    assert mixed.warmup["fasth3_fusion_s"] > 0
    with pytest.raises(RenderError, match="must run before the student is fused"):
        mixed.schedule(BASE)

    base = Engine.load(SETTINGS, CTX)
    want_base = latents(base, BASE, tmp_path / "base")
    for part in ("video", "audio"):
        assert torch.equal(got_base[part], want_base[part]), part  # the t2va job saw the unfused weights

    fused = Engine.load(replace(SETTINGS, adapter=adapter), CTX)
    want_fast = latents(fused, FAST, tmp_path / "fused")
    # Fusion while streaming rounds each fused weight to its storage dtype (bf16 in the built-in model) before the
    # fp32 cast; fusion in place keeps fp32: equal up to that rounding...
    base.fasth3 = fused.fasth3  # ...and far from the base weights run on the student's own schedule
    unfused = latents(base, FAST, tmp_path / "student-schedule")
    for part in ("video", "audio"):
        err, gap = rel_err(got_fast[part], want_fast[part]), rel_err(unfused[part], want_fast[part])
        assert err < 1e-2 and gap > 10 * err, (part, err, gap)


def test_cli_mixed_queue_renders_base_jobs_then_the_student(adapter, tmp_path):
    import json

    from tests._cli import invoke, run_forked

    manifest = tmp_path / "m.jsonl"
    lines = [{"id": "a", "prompt": "base", "frames": 22, "steps": 2, "width": 128, "height": 64},
             {"id": "b", "prompt": "fast", "mode": "fasth3", "frames": 22, "width": 128, "height": 64},
             {"id": "c", "prompt": "base two", "frames": 22, "steps": 2, "width": 128, "height": 64}]
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    # no student anywhere: refused before loading, naming the fasth3 job's line, for --dry-run too
    for extra in ((), ("--dry-run",)):
        r = invoke("batch", str(manifest), "--out-dir", str(out), *extra)
        assert r.exit_code == 2 and f"{manifest}:2: mode: fasth3 needs a FastH3 adapter" in r.stderr, r.stderr
    assert not out.exists()
    # the adapter named in the manifest's defaults: t2va jobs on the base weights, then the fused student
    manifest.write_text(json.dumps({"defaults": {"adapter": adapter}}) + "\n" + manifest.read_text())
    r = run_forked("batch", str(manifest), "--out-dir", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    done = [line.split()[4] for line in r.stderr.splitlines() if " succeeded in " in line]
    assert done == ["a", "c", "b"]  # render order: t2va first
    report = json.loads((out / "batch-report.json").read_text())
    assert [j["id"] for j in report["jobs"]] == ["a", "b", "c"]  # the report keeps manifest order
    sides = {n: json.loads((out / f"{n}.json").read_text()) for n in "abc"}
    assert [sides[n]["sigmas"]["forwards"] for n in "abc"] == [1, 4, 1]
    assert ["fasth3" in sides[n]["extra"] for n in "abc"] == [False, True, False]
    # resume with another CRF: skipped, and the log says what differs
    r = invoke("batch", str(manifest), "--out-dir", str(out), "--quiet", "--crf", "23")  # in-process
    assert r.exit_code == 0 and "job 1/3 a (a.mp4) skipped: rendered earlier with crf 18 (now 23)" in r.stderr, r.stderr


def test_keyframe_and_reference_jobs_render_on_the_base_weights_before_the_student(adapter, tmp_path):
    """A trial: with an adapter, a queue holding an fl2va or ref2va job (mode t2va) passed every check, then failed
    whole after loading ("FastH3 students are t2va-only"). They run before the student is fused, as t2va jobs do."""
    import json

    from tests._cli import run_forked
    from tests._media import png

    png(tmp_path / "fox.png", (64, 40), seed=0)
    png(tmp_path / "first.png", (128, 64), seed=1)
    common = {"frames": 22, "width": 128, "height": 64}
    lines = [{"defaults": {"adapter": adapter}},
             {"id": "f", "prompt": "fast", "mode": "fasth3", **common},
             {"id": "r", "prompt": "A red fox", "references": ["fox.png"], "steps": 2, **common},
             {"id": "k", "prompt": "A red fox", "first_frame": "first.png", "steps": 2, **common}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = run_forked("batch", str(tmp_path / "m.jsonl"), "--out-dir", str(tmp_path / "out"), "--quiet")
    assert r.returncode == 0, r.stderr
    done = [line.split()[4] for line in r.stderr.splitlines() if " succeeded in " in line]
    assert done == ["k", "r", "f"]  # fl2va, then ref2va (its own partition), then the fused student
    sides = {n: json.loads((tmp_path / "out" / f"{n}.json").read_text()) for n in "frk"}
    assert sides["r"]["job"]["task"] == "ref2va" and sides["k"]["job"]["task"] == "fl2va"
    assert ["fasth3" in sides[n]["extra"] for n in "frk"] == [True, False, False]
