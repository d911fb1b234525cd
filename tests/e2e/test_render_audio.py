"""The engine's soundtrack hand-over: the waveform reaches the MP4 writer before the first video frame (so AAC is
encoded while the video decodes, not inside the close), and a non-finite waveform fails the job without a file."""

from __future__ import annotations


import pytest
import torch

import h3render.render as render
from h3render.engine import Engine
from h3render.errors import RenderError
from h3render.jobs import Job
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings


@pytest.fixture(scope="module")
def renderer():
    ctx = ParallelContext(0, 1, 0, torch.device("cpu"))
    return Engine.load(RunSettings(progress=False), ctx)


JOB = Job(id="a", prompt="Waves on a pebble beach", width=224, height=128, frames=22, seed=3, steps=2, mode="t2va",
          output="a")


def test_audio_reaches_the_writer_before_the_frames(renderer, tmp_path, monkeypatch):
    calls = []

    class Recording(render.Mp4Writer):
        def write_audio(self, waveform):
            calls.append("audio")
            super().write_audio(waveform)

        def write_frames(self, chunk):
            calls.append("frames")
            super().write_frames(chunk)

        def finish_async(self, then=None):
            calls.append("close")
            return super().finish_async(then)

    monkeypatch.setattr(render, "Mp4Writer", Recording)
    data = renderer.render(JOB, tmp_path / "a.mp4", tmp_path / "a.json")
    assert calls[0] == "audio" and calls[-1] == "close" and calls.count("frames") >= 1
    assert data["extra"]["frames_written"] == 22 and (tmp_path / "a.mp4").is_file()


def test_non_finite_audio_fails_without_a_file(renderer, tmp_path, monkeypatch):
    decode = renderer.audio_decode.fn
    monkeypatch.setattr(renderer.audio_decode, "fn", lambda latent: decode(latent) * float("nan"))
    with pytest.raises(RenderError, match="non-finite samples"):
        renderer.render(JOB, tmp_path / "b.mp4", tmp_path / "b.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kernel", ["working", "wrong", "raising"])
def test_audio_activation_check_keeps_only_a_working_kernel(renderer, monkeypatch, kernel):
    """`prepare` on CUDA keeps the Triton activations only if they run and agree with the torch ones; here on CPU
    with the fused path forced on, as `fused=None` does on a GPU, and stand-in kernels."""
    import h3render.kernels.alias_free as alias_free

    vae = renderer.c.audio_vae
    original = vae.set_fused_activations
    monkeypatch.setattr(vae, "set_fused_activations", lambda fused: original(True if fused is None else fused))
    real = alias_free.alias_free_activation
    # The "kernels" are the torch path (working) and the torch path scaled (wrong: off by O(1)). Interpreting the real
    # Triton kernel here costs ~12 s of CPU per case for nothing this check looks at; a whole decode through the
    # interpreted kernel against the torch path and diffusers is tests/unit/test_alias_free.py's.
    if kernel == "working":
        monkeypatch.setattr(alias_free, "alias_free_activation",
                            lambda x, *a, **k: real(x, *a, **{**k, "use_triton": False}))
    elif kernel == "wrong":
        monkeypatch.setattr(alias_free, "alias_free_activation",
                            lambda x, *a, **k: 1.5 * real(x, *a, **{**k, "use_triton": False}))
    elif kernel == "raising":
        def raising(*args, **kwargs):
            raise RuntimeError("PTX compile failed")
        monkeypatch.setattr(alias_free, "alias_free_activation", raising)
    try:
        renderer._choose_audio_activations(probe_latents=6)
        chosen = renderer.warmup.pop("audio_activations")
        fused = {m.fused for m in vae.decoder.modules() if hasattr(m, "fused")}
    finally:
        original(None)
    if kernel == "working":
        assert chosen.startswith("triton (rel. err") and fused == {True}
    else:
        assert chosen.startswith("torch (") and fused == {False}
        assert ("PTX compile failed" in chosen) == (kernel == "raising")
