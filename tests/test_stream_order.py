"""Order of work inside one render (tiny model, CPU): what reaches the MP4 writer when."""

from __future__ import annotations

import torch

from h3render import pipeline
from h3render.jobs import Job
from h3render.parallel.groups import ParallelContext
from h3render.pipeline import EngineSettings, Renderer


def test_soundtrack_reaches_the_writer_before_the_first_frame(tmp_path, monkeypatch):
    """AAC interleaves with the video only if the writer has the soundtrack before the frames arrive; handed over
    after the last frame, its whole encode (0.23-0.33 s for 10 s) lands after the decode, on the close latency."""
    calls: list[str] = []

    class RecordingWriter(pipeline.Mp4Writer):
        def write_audio(self, waveform):
            calls.append("audio")
            super().write_audio(waveform)

        def write_frames(self, chunk):
            calls.append("frames")
            super().write_frames(chunk)

    monkeypatch.setattr(pipeline, "Mp4Writer", RecordingWriter)
    ctx = ParallelContext(0, 1, 0, torch.device("cpu"), None)
    renderer = Renderer.load("tiny", ctx, torch.float32, EngineSettings(progress=False, vae_batch=1))
    job = Job(id="a", prompt="rain on a tin roof", width=224, height=128, frames=39, seed=1, steps=2,
              mode="t2va", output="a")
    renderer.prepare([job])
    sidecar = renderer.render(job, tmp_path / "a.mp4", tmp_path / "a.json")
    assert calls[0] == "audio" and calls.count("audio") == 1
    assert calls.count("frames") >= 2  # several streamed chunks, all after the soundtrack
    assert sidecar["extra"]["frames_written"] == 39
    assert (tmp_path / "a.mp4").stat().st_size > 0
