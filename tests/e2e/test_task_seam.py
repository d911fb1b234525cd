"""The task seam (issue #22): a new task is one module plus its job field, with render.py, engine.py and
sampling.py untouched; and a job rendered in two windows is one MP4 whose sidecar lists both windows."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import h3render
from h3render import tasks
from h3render.engine import Engine
from h3render.jobs import Job
from h3render.parallel.groups import ParallelContext
from h3render.render import render_windows
from h3render.settings import RunSettings
from tests import _toy_task
from tests._mp4 import decode

jsonschema = pytest.importorskip("jsonschema")
REPO = Path(__file__).resolve().parents[2]
JOB = Job(id="a", prompt="Rain on a tin roof", width=128, height=64, frames=22, seed=3, steps=3, mode="t2va",
          output="a")


@pytest.fixture(scope="module")
def engine():
    ctx = ParallelContext(0, 1, 0, torch.device("cpu"))
    return Engine.load(RunSettings(progress=False, save_latents=True), ctx)


def _latents(mp4: Path, index: int = 0) -> dict:
    return torch.load(mp4.with_name(mp4.stem + (".latents.pt" if index == 0 else f".latents.{index}.pt")))


def _code_strings_and_task_compares(path: Path) -> tuple[set[str], int]:
    """The string constants of a module's code (docstrings left out) and how many comparisons read a `.task`."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docstrings}
    compares = sum(1 for n in ast.walk(tree) if isinstance(n, ast.Compare)
                   for side in (n.left, *n.comparators) if isinstance(side, ast.Attribute) and side.attr == "task")
    return strings, compares


def test_the_job_path_names_no_task(tmp_path):
    """render.py, engine.py (with its warm-up, warmup.py) and sampling.py branch on no task: their code holds no task
    name but "t2va" (also the base *mode*'s name, which engine.py compares modes with) and compares no `.task` with
    anything."""
    package = Path(h3render.__file__).parent
    for name in ("render.py", "engine.py", "warmup.py", "sampling.py"):
        strings, compares = _code_strings_and_task_compares(package / name)
        assert compares == 0, name
        assert not strings & (set(tasks.TASKS) - {"t2va"}), name
    # the check itself sees a task branch where there is one
    branch = tmp_path / "branch.py"
    branch.write_text('"""fl2va in a docstring is fine."""\ndef f(job):\n    if job.task == "fl2va":\n        pass\n')
    assert _code_strings_and_task_compares(branch) == ({"fl2va"}, 1)


def test_a_toy_task_renders_through_the_seam(engine, tmp_path, monkeypatch):
    monkeypatch.setitem(tasks.TASKS, _toy_task.NAME, _toy_task)
    monkeypatch.setattr(_toy_task, "calls", [])
    toy = _toy_task.OffsetJob(**{f: getattr(JOB, f) for f in Job.__dataclass_fields__}, seed_offset=4)
    engine.prepare([toy])
    side = engine.render(toy, tmp_path / "toy.mp4", tmp_path / "toy.json")
    engine.render(replace(JOB, seed=7, output="seven"), tmp_path / "seven.mp4", tmp_path / "seven.json")
    engine.render(JOB, tmp_path / "three.mp4", tmp_path / "three.json")
    assert _toy_task.calls == ["prepare 5", "prepare 22"]  # the warm-up on the shortest clip, then the job
    ours, seven, three = (_latents(tmp_path / f"{n}.mp4") for n in ("toy", "seven", "three"))
    # seed 3 + offset 4 draws seed 7's noise: the same latents bit for bit, and not seed 3's
    assert torch.equal(ours["video"], seven["video"]) and torch.equal(ours["audio"], seven["audio"])
    assert not torch.equal(ours["video"], three["video"])
    assert side["job_params"]["seed_offset"] == 4 and side["job_params"]["task"] == _toy_task.NAME
    assert json.loads((tmp_path / "toy.json").read_text())["job"]["seed_offset"] == 4


def test_two_windows_make_one_mp4_whose_sidecar_lists_both(engine, tmp_path):
    windows = [JOB, replace(JOB, seed=4)]
    mp4, sidecar = tmp_path / "two.mp4", tmp_path / "two.json"
    render_windows(engine, JOB, windows, mp4, sidecar).result()
    for job in windows:
        engine.render(job, tmp_path / f"alone{job.seed}.mp4", tmp_path / f"alone{job.seed}.json")
    frames, audio = decode(mp4)
    assert frames.shape[0] == 44  # 22 + 22 frames, one file
    samples = 44 * 32_000 // 24
    assert abs(audio.shape[1] - samples) <= 1024  # within one AAC frame of 44 frames' worth of sound
    doc = json.loads(sidecar.read_text())
    jsonschema.Draft202012Validator(json.loads((REPO / "docs/schema/sidecar.schema.json").read_text())).validate(doc)
    listed = doc["extra"]["windows"]
    assert [(w["index"], w["frames"], w["seed"], w["task"]) for w in listed] == [(0, 22, 3, "t2va"), (1, 22, 4, "t2va")]
    assert listed[0]["delivered_s"] <= listed[1]["started_s"] < listed[1]["generated_s"] <= listed[1]["delivered_s"]
    assert doc["extra"]["frames_written"] == 44
    # each window is exactly what rendering it alone gives, and the two differ
    for index, job in enumerate(windows):
        alone = _latents(tmp_path / f"alone{job.seed}.mp4")
        assert torch.equal(_latents(mp4, index)["video"], alone["video"])
        assert torch.equal(_latents(mp4, index)["audio"], alone["audio"])
    assert not torch.equal(_latents(mp4, 0)["video"], _latents(mp4, 1)["video"])
    # the MP4's second half is window 1's own frames (x264 at CRF 18: within a few code values of its own MP4)
    alone_frames, _ = decode(tmp_path / "alone4.mp4")
    assert abs(frames[22:].astype(int) - alone_frames.astype(int)).mean() < abs(
        frames[:22].astype(int) - alone_frames.astype(int)).mean()


def test_a_task_warm_up_failure_fails_its_job_alone(engine, tmp_path):
    """The warm-up runs each task's own `prepare` (fl2va: on the job's keyframes); a keyframe edited after
    validation must not fail the load (and with it every job of the queue): the warm-up records it, the engine is
    usable, and the fl2va job itself fails with the reason."""
    import numpy as np
    from PIL import Image

    from h3render.checkpoint.info import read_checkpoint_info
    from h3render.errors import RenderError
    from h3render.manifest import job_from_fields

    key = tmp_path / "key.png"
    Image.fromarray(np.full((64, 128, 3), 200, dtype=np.uint8)).save(key)
    fl2va = job_from_fields({"prompt": "A kite", "first_frame": str(key), "frames": 22, "steps": 3, "output": "k"},
                            read_checkpoint_info("tiny").limits())
    Image.fromarray(np.full((64, 128, 3), 10, dtype=np.uint8)).save(key)  # edited after validation
    engine.prepare([JOB, fl2va])
    assert "changed since the job was validated" in engine.warmup["fl2va_warmup_failed"]
    with pytest.raises(RenderError, match="changed since the job was validated"):
        engine.render(fl2va, tmp_path / "k.mp4", tmp_path / "k.json")
    assert not (tmp_path / "k.mp4").exists()
    engine.render(JOB, tmp_path / "a.mp4", tmp_path / "a.json")  # the queue goes on
    assert (tmp_path / "a.mp4").is_file()


def test_the_sidecar_keeps_the_warm_up_record_as_the_job_left_it(engine, tmp_path, monkeypatch):
    """The sidecar is written on the writer's thread, after `render_async` has returned and the next job may have
    started: it showed that job's warm-up keys (the live `engine.warmup` was serialized there)."""
    import threading

    from h3render import render

    release = threading.Event()
    write = render._write_sidecar

    def held(*args, **kwargs):  # the writer reaches the sidecar only once the "next job" has run
        release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(render, "_write_sidecar", held)
    mp4 = tmp_path / "a.mp4"
    future = engine.render_async(JOB, mp4, mp4.with_suffix(".json"))
    engine.warmup["next_job_probe"] = 1.0  # what a later job's warm-up adds while this job's MP4 is written
    try:
        release.set()
        future.result(timeout=60)
    finally:
        engine.warmup.pop("next_job_probe", None)
    warmup = json.loads(mp4.with_suffix(".json").read_text())["extra"]["warmup"]
    assert "next_job_probe" not in warmup and warmup["memory_plan"] == "resident"  # the load's record, order-free
