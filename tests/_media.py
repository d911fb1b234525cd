"""Tiny reference media made in tests (no binary fixtures): PNG stills with Pillow, WAV and MP4 files with PyAV."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image


def png(path: Path, size=(64, 40), seed=0) -> Path:
    """An RGB PNG of random pixels, `size` = (width, height)."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _tone(seconds: float, rate: int, channels: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 440 * t)
    return np.stack([wave * (1 + c) / channels for c in range(channels)]).astype(np.float32)  # [C, S]


def wav(path: Path, seconds=0.5, rate=44100, channels=1) -> Path:
    """A 16-bit PCM WAV of a 440 Hz tone."""
    layout = "mono" if channels == 1 else "stereo"
    samples = (_tone(seconds, rate, channels) * 32767).astype(np.int16)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def mp4(path: Path, frames=24, fps=24, size=(64, 48), sound_rate: int | None = 32000, channels=2) -> Path:
    """An H.264 MP4 of `frames` random frames at `fps` (`size` = (width, height)), with an AAC soundtrack of the
    same duration at `sound_rate` unless it is None."""
    rng = np.random.default_rng(frames + fps)
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = size[0], size[1], "yuv420p"
        audio = None
        if sound_rate:
            layout = "mono" if channels == 1 else "stereo"
            audio = out.add_stream("aac", rate=sound_rate, layout=layout)
        for _ in range(frames):
            image = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        if audio is not None:
            layout = "mono" if channels == 1 else "stereo"
            samples = _tone(frames / fps, sound_rate, channels)
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
            frame.sample_rate = sound_rate
            for packet in audio.encode(frame):
                out.mux(packet)
            for packet in audio.encode(None):
                out.mux(packet)
    return path
