"""The renderer's frame hand-over (`render._Sink`): a non-finite decoded chunk fails the job, naming its first frame,
and leaves no file. (Reading each chunk's check back once per window instead of once a chunk was measured and
dropped: the same vae_video time on an H200, docs/performance.md §21.)"""

from __future__ import annotations

import pytest
import torch

from h3render.engine import Engine
from h3render.errors import RenderError
from h3render.jobs import Job
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings

# 22 frames: the tiny VAE's stream yields 2 chunks, frames 0-16 (a window's clip) and 17-21 (the tail).
JOB = Job(id="f", prompt="Rain on a tin roof", width=224, height=128, frames=22, seed=5, steps=2, mode="t2va",
          output="f")


@pytest.fixture(scope="module")
def engine():
    return Engine.load(RunSettings(progress=False), ParallelContext(0, 1, 0, torch.device("cpu")))


def _with_stream(engine, monkeypatch, change):
    """Route the engine's decode stream through `change(first, chunk) -> chunk`; returns the chunks' firsts."""
    decode_stream = engine.plan.decode_stream
    seen: list[int] = []

    def changed(vae, latent, batch_size):
        for first, chunk in decode_stream(vae, latent, batch_size):
            seen.append(first)
            yield first, change(first, chunk)

    monkeypatch.setattr(engine.plan, "decode_stream", changed)
    return seen


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_chunk_fails_the_job_and_leaves_no_file(engine, tmp_path, monkeypatch, value):
    def poison(first, chunk):
        if first == 17:
            chunk[1, 2, 3, 4] = value
        return chunk

    seen = _with_stream(engine, monkeypatch, poison)
    with pytest.raises(RenderError, match="non-finite pixels at frame 17"):
        engine.render(JOB, tmp_path / "f.mp4", tmp_path / "f.json")
    assert seen == [0, 17]
    assert list(tmp_path.iterdir()) == []  # no MP4, no temp file, no sidecar
