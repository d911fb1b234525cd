"""A mixed queue on one engine: t2va jobs on the base weights, then the FastH3 student fused in place once
(`Engine.fuse_student`), equal to engines that load base-only or fused-at-load."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3render.checkpoint import RELEASES
from h3render.engine import Engine, EngineSettings, RenderError
from h3render.jobs import Job
from h3render.make_checkpoint import write_synthetic_adapter
from h3render.parallel.groups import ParallelContext

CTX = ParallelContext(0, 1, 0, torch.device("cpu"))
SETTINGS = EngineSettings(progress=False, save_latents=True)
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


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_mixed_engine_matches_base_then_fused_engines(adapter, tmp_path):
    (tmp_path / "base").mkdir(), (tmp_path / "fused").mkdir(), (tmp_path / "student-schedule").mkdir()
    mixed = Engine.load("tiny", CTX, torch.float32, SETTINGS, adapter=adapter, base_jobs_first=True)
    mixed.prepare([BASE, FAST])
    got_base = latents(mixed, BASE, tmp_path)
    assert "fasth3_fusion_s" not in mixed.warmup
    got_fast = latents(mixed, FAST, tmp_path)
    assert mixed.warmup["fasth3_fusion_s"] > 0
    with pytest.raises(RenderError, match="must run before the student is fused"):
        mixed.schedule(BASE)

    base = Engine.load("tiny", CTX, torch.float32, SETTINGS)
    want_base = latents(base, BASE, tmp_path / "base")
    for part in ("video", "audio"):
        assert torch.equal(got_base[part], want_base[part]), part  # the t2va job saw the unfused weights

    fused = Engine.load("tiny", CTX, torch.float32, SETTINGS, adapter=adapter)
    want_fast = latents(fused, FAST, tmp_path / "fused")
    # Fusion while streaming rounds each fused weight to its storage dtype (bf16 in the built-in model) before the
    # fp32 cast; fusion in place keeps fp32: equal up to that rounding...
    base.fasth3 = fused.fasth3  # ...and far from the base weights run on the student's own schedule
    unfused = latents(base, FAST, tmp_path / "student-schedule")
    for part in ("video", "audio"):
        err, gap = rel(got_fast[part], want_fast[part]), rel(unfused[part], want_fast[part])
        assert err < 1e-2 and gap > 10 * err, (part, err, gap)
