"""ref2va reference media: probe a file (type, content hash, measurements), and put an image reference on its own
encode size.

What the released model expects (diffusers 0.42.1 `MiniMaxH3Ref2VASetupStep`, the numerical oracle;
research/conditioning.md §2.2):

* an image reference keeps its own aspect ratio (1:4 ... 4:1) and is resized, LANCZOS, so that its short edge is the
  checkpoint's `reference_short_edge` (released 2048, upscaling included, no area cap), each side rounded to a
  multiple of 32 with Python's round: 640 x 400 -> 3264 x 2048; it never sets the target canvas;
* a video reference is resampled onto 24 fps by frame slots and needs at least 13 frames there (the conditioner
  samples it at 2 fps and needs two samples); its soundtrack and audio clips are resampled to 32 kHz stereo.

Images are decoded as fl2va keyframes are (`keyframes.load_keyframe`: EXIF orientation, 16-bit scaled, alpha
flattened onto white, stills only). Videos and audio are probed with PyAV: the container opens, the stream's first
frame decodes, and its rate, length and size are read.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from h3render.keyframes import Keyframe, load_keyframe
from h3render.spec import CANVAS_MULTIPLE, FPS, canvas_for_aspect

MIN_VIDEO_FRAMES = 13  # at 24 fps: two samples at the conditioner's 2 fps (stride 12) (diffusers
# `_sample_video_condition_frames`); also more than one latent frame of the video VAE


def probe_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    return _sha256(Path(path))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_image(path: Path) -> bool:
    try:
        with Image.open(path) as opened:
            return opened.format is not None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return False


def load_image_reference(path: str | Path) -> Keyframe:
    """Decode and check an image reference (as `keyframes.load_keyframe`, with the reference's wording).

    Raises:
        ValueError: `"<path>: <problem>"`: not a decodable still image, or outside 1:4 ... 4:1.
    """
    try:
        return load_keyframe(path, "first")
    except ValueError as exc:
        raise ValueError(str(exc).replace("keyframe image", "reference image")
                         .replace("keyframe aspect", "reference image aspect")) from None


def reference_image_size(width: int, height: int, short_edge: int) -> tuple[int, int]:
    """(width, height) an image reference is encoded at: scaled so its short edge is `short_edge`, each side
    `max(32, round(side * s / 32) * 32)` (diffusers' rule; 640 x 400 at 2048 -> 3264 x 2048)."""
    scale = short_edge / min(width, height)
    return (max(CANVAS_MULTIPLE, round(width * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE),
            max(CANVAS_MULTIPLE, round(height * scale / CANVAS_MULTIPLE) * CANVAS_MULTIPLE))


def fit_reference_image(image: Image.Image, short_edge: int) -> Image.Image:
    """An RGB image on its encode size (`reference_image_size`), PIL LANCZOS; untouched when already there."""
    size = reference_image_size(*image.size, short_edge)
    return image if image.size == size else image.resize(size, Image.Resampling.LANCZOS)


def _probe_av(path: Path) -> dict[str, Any]:
    """The first video and audio streams of a container, measured; raises ValueError when PyAV cannot open it or
    decode a frame of a stream it reports."""
    import av

    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a decodable image, video or audio file ({type(exc).__name__}: {exc})") from None
    info: dict[str, Any] = {"container": container.format.name}
    with container:
        videos, audios = container.streams.video, container.streams.audio
        if videos:
            stream = videos[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            seconds = (float(stream.duration * stream.time_base) if stream.duration is not None
                       else (container.duration or 0) / 1e6)
            info.update(codec=stream.codec_context.name, width=stream.codec_context.width,
                        height=stream.codec_context.height, fps=fps, duration_s=seconds)
        if audios:
            stream = audios[0]
            seconds = (float(stream.duration * stream.time_base) if stream.duration is not None
                       else (container.duration or 0) / 1e6)
            info.update(audio_codec=stream.codec_context.name, sample_rate=stream.codec_context.sample_rate,
                        channels=stream.codec_context.channels, audio_duration_s=seconds)
        info["has_audio"] = bool(audios)
        for kind, streams in (("video", videos), ("audio", audios)):
            if streams:
                try:
                    next(container.decode(streams[0]))
                except (av.FFmpegError, StopIteration, ValueError) as exc:
                    raise ValueError(f"{path}: its {kind} stream does not decode ({type(exc).__name__}: {exc})") \
                        from None
                container.seek(0)
        if videos:
            frames = videos[0].frames or round(info["duration_s"] * info["fps"])
            info["frames"] = int(frames)
    return info


def probe_reference(path: str | Path, kind: str | None = None) -> tuple[str, str, dict[str, Any]]:
    """Type, sha256 and measurements of one reference file.

    Args:
        path: the file. kind: "image" / "video" / "audio" to override the inference, or None.

    Returns:
        `(kind, sha256 hex, info)`; info as `job_references.ReferenceRef.info`.

    Raises:
        ValueError: `"<path>: <problem>"`: missing, a folder, unreadable, not decodable as that type, an image
            outside 1:4 ... 4:1, a video with no frames or shorter than `MIN_VIDEO_FRAMES` at 24 fps, an audio
            reference without an audio stream.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: reference file not found")
    if not path.is_file():
        raise ValueError(f"{path}: a reference must be a file, not a folder" if path.is_dir()
                         else f"{path}: reference is not a regular file")
    try:
        sha256 = _sha256(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read reference ({exc.strerror or exc})") from None
    still = _is_image(path)
    if kind in ("video", "audio") and still:
        raise ValueError(f"{path}: type {kind}, but the file is a still image")
    if kind in (None, "image") and still:
        keyframe = load_image_reference(path)
        if keyframe.sha256 != sha256:
            raise ValueError(f"{path}: the file changed while it was read")
        return "image", sha256, {"width": keyframe.size[0], "height": keyframe.size[1], "format": keyframe.format,
                                 "mode": keyframe.source_mode}
    if kind == "image":
        raise ValueError(f"{path}: type image, but Pillow decodes no image from it")
    info = _probe_av(path)
    inferred = "video" if "codec" in info else "audio" if info["has_audio"] else None
    kind = kind or inferred
    if inferred is None:
        raise ValueError(f"{path}: no video or audio stream in this {info['container']} file")
    if kind == "video":
        if "codec" not in info:
            raise ValueError(f"{path}: type video, but the file has no video stream")
        if info["fps"] <= 0 or info["frames"] < 1:
            raise ValueError(f"{path}: the video stream reports no frame rate or no frames")
        at_24 = int(info["frames"] * FPS / info["fps"] + 0.5)
        if at_24 < MIN_VIDEO_FRAMES:
            raise ValueError(f"{path}: video is {info['frames']} frames at {info['fps']:g} fps ({at_24} at 24 fps); "
                             f"a video reference needs at least {MIN_VIDEO_FRAMES} frames at 24 fps (0.54 s)")
    elif not info["has_audio"]:
        raise ValueError(f"{path}: type audio, but the file has no audio stream")
    return kind, sha256, info


AUDIO_RATE = 32000  # the audio VAE's sample rate (diffusers `audio_sampling_rate`)


def decode_audio(path: str | Path) -> tuple[torch.Tensor, int]:
    """An audio file's (or a video's soundtrack's) first audio stream as a `[channels, samples]` float32 waveform at
    the rate the container carries it (diffusers `_decode_reference_soundtrack`: planar float conversion only).

    Raises:
        ValueError: `"<path>: ..."`: no audio stream, or it does not decode.
    """
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError(f"{path}: no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.codec_context.sample_rate)
            resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks = []
            for frame in container.decode(stream):
                chunks += [torch.from_numpy(r.to_ndarray()) for r in resampler.resample(frame)]
            chunks += [torch.from_numpy(r.to_ndarray()) for r in resampler.resample(None)]
    except av.FFmpegError as exc:
        raise ValueError(f"{path}: its audio does not decode ({type(exc).__name__}: {exc})") from None
    if not chunks:
        raise ValueError(f"{path}: the audio stream holds no samples")
    return torch.cat(chunks, dim=-1).to(torch.float32), rate


def normalize_audio(waveform: torch.Tensor, rate: int, frames: int) -> torch.Tensor:
    """A reference waveform as the audio VAE takes it (diffusers `_normalize_audio_condition`): float32, cut to the
    target's duration at its own rate (`int(frames / 24 * rate)` samples), mono duplicated to stereo.

    Returns:
        `[2, samples]` float32 at 32 kHz.

    Raises:
        ValueError: not `[1 or 2, samples]`; a rate other than 32 kHz (diffusers resamples it with torchaudio, which
            has no build for this torch: not done here yet).
    """
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2):
        raise ValueError(f"a reference waveform must be [1 or 2, samples], got {tuple(waveform.shape)}")
    if rate != AUDIO_RATE:
        raise ValueError(f"audio at {rate} Hz needs resampling to {AUDIO_RATE} Hz, which h3render does not do yet")
    waveform = waveform.to(torch.float32)[:, : int(frames / FPS * rate)]
    return waveform.expand(2, -1).contiguous() if waveform.shape[0] == 1 else waveform


# ---------------------------------------------------------------------------------------------------------------------
# Video references: decoded and normalized as diffusers 0.42.1 does (`_decode_video_file`,
# `MiniMaxH3Ref2VASetupStep._normalize_video_condition`). The task does not render them yet (their conditioner
# presentation needs transformers' Qwen3-VL video processor, hence torchvision); these are its tested first steps.


def decode_video(path: str | Path) -> tuple[np.ndarray, float]:
    """A video file's frames `[N, H, W, 3]` uint8 RGB (PyAV rgb24; the display matrix's rotation undone, snapped to
    quarter turns; the sample aspect ratio ignored, as diffusers) and the frame rate the stream reports
    (`average_rate`, else `guessed_rate`).

    Raises:
        ValueError: `"<path>: ..."`: no video stream, no frames, or they do not decode.
    """
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"{path}: no video stream")
            stream = container.streams.video[0]
            frames, rotation = [], 0.0
            for frame in container.decode(stream):
                rotation = frame.rotation
                frames.append(frame.to_ndarray(format="rgb24"))
            fps = float(stream.average_rate or stream.guessed_rate)
    except av.FFmpegError as exc:
        raise ValueError(f"{path}: its video does not decode ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise ValueError(f"{path}: no video frames")
    video = np.stack(frames)
    turns = round(rotation / 90.0) % 4
    return (np.ascontiguousarray(np.rot90(video, k=-turns, axes=(1, 2))) if turns else video), fps


def normalize_video(frames: np.ndarray, fps: float, num_frames: int, *, short_edge: int,
                    max_pixels: int) -> np.ndarray:
    """Reference frames onto 24 fps, cut to the target's `num_frames`, on the canvas rule at their own aspect.

    24 fps by slots: frame i lands on slot `floor(i * 24 / fps + 0.5)` and is held until the next one's (the last
    until `floor(N * 24 / fps + 0.5)`), as ffmpeg's fps filter; then PIL LANCZOS per frame onto
    `spec.canvas_for_aspect(w, h)` (upscaling included) unless already that size.

    Returns:
        `[n, H', W', 3]` uint8, n <= num_frames.
    """
    if fps <= 0:
        raise ValueError(f"a reference video needs a positive frame rate, got {fps}")
    if fps != FPS:
        scale = FPS / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        end = math.floor(frames.shape[0] * scale + 0.5)
        frames = np.repeat(frames, np.diff(slots, append=end), axis=0)
    frames = frames[:num_frames]
    width, height = canvas_for_aspect(frames.shape[2], frames.shape[1], short_edge=short_edge, max_pixels=max_pixels)
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS))
                     for f in frames])


def encode_frames(count: int) -> int:
    """Frames of a video reference the VAE encodes: snapped down to 17n + 5 (n >= 1), and a clip shorter than 22 whole
    (diffusers' `MiniMaxH3Ref2VAReferenceEncoderStep` slices `frames[:max(1, (n - 5) // 17) * 17 + 5]`)."""
    return min(count, max(1, (count - 5) // 17) * 17 + 5)
