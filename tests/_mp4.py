"""Reading rendered MP4s back in tests (PyAV)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np


def decode(path: Path | str, video_format: str | None = "rgb24") -> tuple[np.ndarray, np.ndarray]:
    """All frames `[F, H, W, 3]` uint8 (`video_format=None`: the stream's own yuv420p planes packed as
    `[F, H*3//2, W]`) and all audio samples `[2, N]` float32 of an MP4."""
    with av.open(str(path)) as c:
        frames = np.stack([f.to_ndarray(format=video_format) if video_format else f.to_ndarray()
                           for f in c.decode(video=0)])
    with av.open(str(path)) as c:
        samples = np.concatenate([f.to_ndarray() for f in c.decode(audio=0)], axis=1)
    return frames, samples


def frames_of(path: Path | str) -> np.ndarray:
    """All frames `[F, H, W, 3]` uint8 RGB."""
    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
