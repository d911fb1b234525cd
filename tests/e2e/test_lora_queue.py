"""Per-job LoRAs on one resident engine (issue #25): a queue alternating two LoRA sets renders each job as a fresh
engine holding only that set would (bit-equal on the CPU), the base comes back bit-for-bit, the side path matches
the fused weights, a turbo preset or a file's header brings its own schedule (t2va and fl2va), a deferred FastH3
student survives LoRAs, and `--lora` / `loras:` problems exit 2 naming file, line and field before anything loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3render.checkpoint.releases import RELEASES
from h3render.engine import Engine
from h3render.job_loras import resolve_loras
from h3render.jobs import Job
from h3render.make_checkpoint.synthetic_lora import write_synthetic_lora
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings

CTX = ParallelContext(0, 1, 0, torch.device("cpu"))
SETTINGS = RunSettings(progress=False, save_latents=True)  # tiny, fp32 on the CPU
JOB = Job(id="a", prompt="Gulls over a harbour", width=128, height=64, frames=22, seed=5, steps=2, mode="t2va",
          output="a")


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    cfg = RELEASES["tiny"].dit
    x = write_synthetic_lora(folder / "x.safetensors", cfg, "ai-toolkit", seed=11, std=0.5)
    y = write_synthetic_lora(folder / "y.safetensors", cfg, "diffusers", seed=12, std=0.5)
    z = write_synthetic_lora(folder / "z.safetensors", cfg, "kohya", seed=13, std=0.5)
    return folder, x, y, z


def refs(*items):
    found, problems = resolve_loras([{"path": str(p), "strength": s} for p, s in items], ".")
    assert not problems, problems
    return found


def render(engine, job, folder):
    folder.mkdir(exist_ok=True)
    data = engine.render(job, folder / f"{job.output}.mp4", folder / f"{job.output}.json")
    return torch.load(folder / f"{job.output}.latents.pt"), data


def test_alternating_sets_equal_single_set_engines_with_one_load(loras, tmp_path):
    _, x, y, z = loras
    set_x, set_y = refs((x, 0.8)), refs((y, 1.0), (z, -0.5))  # a single LoRA, and two stacked
    jobs = [replace(JOB, output="x1", loras=set_x), replace(JOB, output="y1", seed=6, loras=set_y),
            replace(JOB, output="x2", loras=set_x), replace(JOB, output="none", loras=refs((x, 0.0)))]
    engine = Engine.load(SETTINGS, CTX)  # the one load of the queue
    base = {k: v.clone() for k, v in engine.c.dit.state_dict().items()}
    engine.prepare(jobs)
    got = {job.output: render(engine, job, tmp_path / "queue") for job in jobs}
    assert engine.loras.switches == 4  # x, y, x, none: one switch per change of set
    assert all(torch.equal(base[k], v) for k, v in engine.c.dit.state_dict().items())  # strength 0: the base, exact
    sidecar = got["y1"][1]
    assert [e["strength"] for e in sidecar["extra"]["loras"]] == [1.0, -0.5]
    assert sidecar["extra"]["loras"][1]["format"] == "kohya" and sidecar["job_params"]["loras"][0]["strength"] == 1.0
    assert "loras" not in got["none"][1]["job_params"]  # strength 0 resumes as (and renders as) no LoRA

    # y1 ran after x on the queue's engine: a fresh engine holding only y renders it the same, bit for bit. (x1 was
    # the engine's first set, x2 is compared with it below, "none" ran on the base weights checked exactly above.)
    for name, job in (("y1", jobs[1]),):
        fresh = Engine.load(SETTINGS, CTX)
        fresh.prepare([job])
        want, _ = render(fresh, job, tmp_path / f"single-{name}")
        for part in ("video", "audio"):
            assert torch.equal(got[name][0][part], want[part]), (name, part)
    for part in ("video", "audio"):
        assert torch.equal(got["x2"][0][part], got["x1"][0][part])  # x after y: the same weights, bit for bit
        assert not torch.equal(got["x1"][0][part], got["none"][0][part])  # and the LoRA does change the render

    # The side path renders what the fused weights render (fp32 rounding apart), and a turbo preset runs its own
    # schedule: ModelTC/Minimax-H3-Turbo README, NFE 4 at shifts 12 / 3.
    side = Engine.load(replace(SETTINGS, lora_mode="side"), CTX)
    assert side.loras.mode == "side"
    latents, _ = render(side, jobs[0], tmp_path / "side")
    for part in ("video", "audio"):
        err = float((latents[part] - got["x1"][0][part]).norm() / got["x1"][0][part].norm())
        assert err < 1e-4, (part, err)
    found, problems = resolve_loras([{"path": str(x), "schedule": "lightx2v-fl2va-4step-v0.1"}], ".")
    assert not problems and found[0].turbo
    _, data = render(side, replace(JOB, output="turbo", loras=found), tmp_path / "side")
    sigmas = data["sigmas"]
    assert sigmas["forwards"] == 4 and sigmas["source"] == "turbo LoRA lightx2v-fl2va-4step-v0.1"
    assert sigmas["video"] == pytest.approx([1, 0.9730, 0.9231, 0.8, 0], abs=1e-4)
    assert sigmas["audio"] == pytest.approx([1, 0.9, 0.75, 0.5, 0], abs=1e-6)


def test_cli_lora_problems_exit_2_before_load(loras, tmp_path):
    from tests._cli import invoke

    folder, x, _, _ = loras
    bad = folder / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    manifest = tmp_path / "m.jsonl"
    lines = [{"id": "a", "prompt": "p", "loras": [{"path": str(x), "strength": 0.5}]},
             {"id": "b", "prompt": "p", "loras": [{"path": "missing.safetensors"}]},
             {"id": "c", "prompt": "p", "loras": [{"path": str(bad)}]},
             {"id": "d", "prompt": "p", "loras": [{"file": str(x)}]}]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    r = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--dry-run")
    assert r.exit_code == 2, r.stderr
    assert f"{manifest}:2: loras[0].path: {tmp_path}/missing.safetensors: LoRA file not found" in r.stderr
    assert f"{manifest}:3: loras[0].path: {bad}: not a readable safetensors file" in r.stderr
    assert f"{manifest}:4: loras[0].file: unknown field; allowed: path, strength, schedule" in r.stderr
    assert ":1:" not in r.stderr
    manifest.write_text(json.dumps(lines[0]) + "\n")  # the good line alone: the plan names its LoRA
    r = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--dry-run")
    assert r.exit_code == 0 and "LoRAs x.safetensors×0.5" in r.stdout, r.stderr
    r = invoke("prompt", "p", "-o", str(tmp_path / "o.mp4"), "--lora", f"{bad}:0.5")
    assert r.exit_code == 2 and "not a readable safetensors file" in r.stderr and not (tmp_path / "o.mp4").exists()


def test_mixed_queue_student_fused_under_loras_is_kept(loras, tmp_path):
    """t2va with a LoRA, then the FastH3 student fused in place on a fasth3 job with the same LoRA, then a fasth3
    job without: the student stays fused (the LoRA comes off before the fusion and goes back after), so the last
    job equals the same job on an engine that never held a LoRA."""
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    _, x, _, _ = loras
    adapter = str(write_synthetic_adapter(tmp_path / "adapter.safetensors", RELEASES["tiny"].dit, seed=2))
    settings = replace(SETTINGS, adapter=adapter)
    fast = replace(JOB, output="fast", steps=None, mode="fasth3", seed=7)
    jobs = [replace(JOB, output="base-x", loras=refs((x, 1.0))), replace(fast, output="fast-x", loras=refs((x, 1.0))),
            fast]
    engine = Engine.load(settings, CTX, base_jobs_first=True)
    engine.prepare(jobs)
    got = [render(engine, job, tmp_path / "mixed")[0] for job in jobs]
    clean = Engine.load(settings, CTX, base_jobs_first=True)
    clean.prepare([fast])
    want, _ = render(clean, fast, tmp_path / "clean")
    for part in ("video", "audio"):
        assert torch.equal(got[2][part], want[part]), part
        assert not torch.equal(got[1][part], want[part]), part  # the LoRA did apply to the student's job


def test_turbo_lora_fl2va_runs_the_schedule_its_file_states(tmp_path):
    """An fl2va job with a turbo LoRA whose header states its schedule (`h3render_schedule`) renders in that step
    count at those shifts (sidecar sigmas, valid against docs/schema/sidecar.schema.json); --steps beside it is
    refused before load."""
    import numpy as np
    from PIL import Image

    from tests._cli import run_here

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    lora = write_synthetic_lora(tmp_path / "turbo.safetensors", RELEASES["tiny"].dit, "comfy", seed=21, metadata={
        "h3render_schedule": json.dumps({"forwards": 2, "video_shift": 6.0, "audio_shift": 3.0})})
    out = tmp_path / "t.mp4"
    args = ("prompt", "A red fox", "--first-frame", "a.png", "-o", str(out), "--device", "cpu", "--lora",
            f"{lora.name}:0.7", "--vae-batch", "1", "--frames", "22", "--quiet")
    r = run_here(*args, "--steps", "3", cwd=tmp_path)
    assert r.returncode == 2 and "turbo LoRA of this job brings its own schedule; remove steps" in r.stderr
    r = run_here(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sidecar = json.loads(out.with_suffix(".json").read_text())
    sigmas = sidecar["sigmas"]
    assert sidecar["job"]["task"] == "fl2va" and sidecar["job"]["steps"] is None
    assert sigmas["forwards"] == 2 and sigmas["source"].startswith("LoRA metadata")
    assert sigmas["video"] == pytest.approx([1.0, 6 * 0.5 / (1 + 5 * 0.5), 0.0])  # linspace(1, 0, 3), shift 6
    assert sidecar["extra"]["loras"][0]["strength"] == 0.7 and sidecar["extra"]["loras"][0]["format"] == "comfy"
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs/schema/sidecar.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(sidecar)
