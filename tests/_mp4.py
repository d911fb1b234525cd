"""Reading rendered MP4s back in tests (PyAV)."""

from __future__ import annotations

from pathlib import Path

from typing import Union

import av
import numpy as np
import torch

from h3render.colour import MediaError, frames_to_uint8, rgb_to_i420
from h3render.media import Mp4Writer
from h3render.soundtrack import prepare_audio
from h3render.spec import audio_samples as audio_samples_for
from h3render.spec import FPS, SAMPLE_RATE


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


def write_mp4(
    path: Union[str, Path],
    frames: Union[np.ndarray, torch.Tensor],
    audio: Union[np.ndarray, torch.Tensor, None],
    *,
    crf: int = 18,
    preset: str = "veryfast",
    sample_rate: int = SAMPLE_RATE,
    fps: int = FPS,
    **writer_options,
) -> Path:
    """Write a whole clip at once through :class:`Mp4Writer` (a test helper; renders stream).

    Args:
        path: final ``.mp4`` path.
        frames: float video ``[3, F, H, W]`` in [0, 1] (any device; quantized with ``frames_to_uint8``), or
            uint8 RGB ``[F, H, W, 3]`` (numpy or torch, any device). Frames on a GPU are converted to I420
            there and copied as 1.5 bytes/pixel (1344x768x243 on an H200: 0.04 s convert + 0.25 s copy, against
            0.49 s to copy RGB); frames on the CPU go as RGB and libswscale converts them on the encoder
            thread (0.09 s for the same clip on 16 cores, 15x faster than the torch conversion on CPU).
        audio: float ``[2, samples]`` stereo at ``sample_rate``, or None for a video-only file.
        crf, preset, sample_rate, fps, writer_options: as for :class:`Mp4Writer`.
    Returns:
        ``Path(path)``.
    Raises:
        MediaError: non-finite frames or audio (checked before any file is created), bad shapes, encoder errors.
    """
    if isinstance(frames, np.ndarray):
        if frames.dtype != np.uint8:
            raise MediaError(
                f"{path}: numpy frames must be uint8 [F, H, W, 3]; pass float video as a torch tensor")
        frames = torch.from_numpy(frames)
    if not isinstance(frames, torch.Tensor):
        raise MediaError(f"{path}: frames must be a torch tensor or numpy array, got {type(frames).__name__}")
    if frames.is_floating_point():
        try:
            frames = frames_to_uint8(frames)  # [F, H, W, 3] on frames' device
        except MediaError as exc:
            raise MediaError(f"{path}: {exc}") from exc
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise MediaError(
            f"{path}: frames must be [3, F, H, W] float or [F, H, W, 3] uint8, "
            f"got {tuple(frames.shape)} {frames.dtype}")
    n, h, w, _ = frames.shape
    if audio is not None:
        audio = prepare_audio(audio, audio_samples_for(n, sample_rate, fps), name=str(path))
    if frames.device.type != "cpu":
        frames = rgb_to_i420(frames)  # [F, H*3//2, W] on the device
    frames = frames.cpu()
    with Mp4Writer(path, w, h, n, crf=crf, preset=preset, sample_rate=sample_rate, fps=fps,
                   audio=audio is not None, **writer_options) as writer:
        writer.write_frames(frames)
        if audio is not None:
            writer.write_audio(audio)
    return Path(path)
