"""The media stage of scripts/bench.py: the MP4 writer against a simulated decode, no model (synthetic video and
audio, streamed and probed at 1344x768x243)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from bench_common import rec
from bench_content import synthetic_video


def synthetic_audio(frames: int, device) -> torch.Tensor:
    """[2, samples] float32 in [-1, 1] for `frames` video frames at 32 kHz: a few tones and a little noise."""
    from h3render.spec import SAMPLE_RATE
    from h3render.spec import audio_samples as audio_samples_for

    n = audio_samples_for(frames)
    t = torch.arange(n, device=device, dtype=torch.float32) / SAMPLE_RATE
    g = torch.Generator(device=device).manual_seed(7)
    tones = [0.2 * torch.sin(2 * torch.pi * f * t) for f in (220.0, 331.0, 440.0, 1210.0)]
    left, right = tones[0] + tones[2], tones[1] + tones[3]
    return torch.stack([left, right]) + 0.02 * torch.randn(2, n, device=device, generator=g)


def vae_chunk_sizes(frames: int, height: int, width: int) -> list[int]:
    """Frames per chunk as the released video VAE's stream emits them (one temporal window's clip each, the last
    window's tail after it: 14 x 17 + 5 for 243 frames)."""
    from h3render.models.vae_tiling import RELEASED_TILING, plan_decode
    from h3render.models.video_vae_config import VideoVAEConfig
    from h3render.spec import latent_frames

    cfg = VideoVAEConfig()
    r = cfg.spatial_ratio
    plan = plan_decode(latent_frames(frames), height // r, width // r, geometry=cfg.geometry, spatial_ratio=r,
                       tiling=RELEASED_TILING)
    clip = cfg.geometry.clip_length  # as `assemble_frames` yields them
    bounds = [(w * clip, (w + 1) * clip) for w in range(plan.num_windows)]
    bounds.append((plan.num_windows * clip, plan.num_windows * clip + cfg.geometry.tail_frames))
    return [min(stop, plan.num_frames) - first for first, stop in bounds if min(stop, plan.num_frames) > first]


def stream_mp4(path: Path, kind: str, frames: int, width: int, height: int, decode_s: float, device,
               audio_first: bool, grain: float = 0.01, **writer_options) -> dict:
    """One clip through the renderer's media path, paced like a decode that takes `decode_s` for all frames.

    Chunks are generated before the clock starts (on `device`); chunk i is handed over once its share of
    `decode_s` has passed, the way `render._write_chunk` does it: `rgb_to_i420` on the device, a
    `PinnedFrameStager` copy to the host, `Mp4Writer.write_frames`. On a CPU device the chunks are converted to
    I420 before the clock starts (the GPU does that in 0.04 s per clip; a CPU would steal the encoder's cores).
    The soundtrack goes in before the first chunk (`audio_first`) or after the last, then `close()`.
    """
    from h3render.colour import rgb_to_i420
    from h3render.media import Mp4Writer
    from h3render.staging import PinnedFrameStager
    from h3render.settings import RunSettings

    settings = RunSettings()
    on_gpu = torch.device(device).type == "cuda"
    sizes = vae_chunk_sizes(frames, height, width)
    chunks, first = [], 0
    for n in sizes:
        video = synthetic_video(first, n, height, width, kind, device, grain=grain)
        chunks.append(video if on_gpu else rgb_to_i420(video))
        first += n
    wave = synthetic_audio(frames, device)
    if on_gpu:
        torch.cuda.synchronize()
    stager = PinnedFrameStager(num_buffers=8)  # as the Engine's
    options = {"crf": settings.crf, "preset": settings.x264_preset, **writer_options}
    writer = Mp4Writer(path, width, height, frames, **options)
    try:
        if audio_first:
            writer.write_audio(wave.cpu())
        t_start = time.perf_counter()
        done, convert_s = 0, 0.0
        for n, chunk in zip(sizes, chunks):
            done += n
            time.sleep(max(0.0, t_start + decode_s * done / frames - time.perf_counter()))
            t0 = time.perf_counter()
            i420 = rgb_to_i420(chunk) if on_gpu else chunk  # [n, H*3/2, W] uint8
            writer.write_frames(stager.stage(i420))
            convert_s += time.perf_counter() - t0
        t_last = time.perf_counter()
        if not audio_first:
            writer.write_audio(wave.cpu())
        t_close = time.perf_counter()
        writer.close()
        t_end = time.perf_counter()
    except BaseException:
        writer.abort()
        raise
    st = writer.stats
    size = path.stat().st_size
    return {
        "kind": kind, "decode_s": decode_s, "decode_span_s": round(t_last - t_start, 3),
        "audio": "first" if audio_first else "last", "x264_params": writer_options.get("x264_params"),
        "close_latency_s": round(t_end - t_last, 3), "mp4_close_after_decode_s": round(t_end - t_close, 3),
        "backlog_at_last_frame_s": round(max(0.0, writer.marks.get("frames_done", t_last) - t_last), 3),
        "flush_s": round(st["flush_s"], 3), "trailer_s": round(st["trailer_s"], 3), "sync_s": round(st["sync_s"], 3),
        "encode_s": round(st["encode_s"], 3), "audio_s": round(st["audio_s"], 3),
        "blocked_s": round(st["blocked_s"], 3), "to_i420_stage_write_s": round(convert_s, 3),
        "bytes": size, "mbit_s": round(8 * size / (frames / 24) / 1e6, 1), "chunks": len(sizes),
    }


def probe_mp4(path: Path) -> dict:
    import av

    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        return {"probe_video": f"{v.codec_context.name} {v.codec_context.profile} {v.format.name} "
                               f"primaries={v.codec_context.color_primaries} range={v.codec_context.color_range}",
                "probe_audio": f"{a.codec_context.name} {a.rate} Hz {a.channels} ch"}


def stage_media(args) -> None:
    """Close latency of the MP4 writer on synthetic moving content and on noise at 1344x768x243, paced to the
    measured decode rates (split decode on 2 GPUs 4.08 s, 1 GPU compiled 7.07 s); no model needed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(args.media_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec(stage="media", what="media setup", device=device, cpus=os.cpu_count(),
        chunks=vae_chunk_sizes(args.media_frames, 768, 1344), audio=args.media_audio)
    variants = [None if v in ("", "default") else v for v in args.media_x264_params.split(";")]
    for kind in args.media_kinds.split(","):
        for decode_s in args.media_decode_s:
            for params in variants:
                path = out_dir / f"media-{kind}-{decode_s:g}s.mp4"
                row = stream_mp4(path, kind, args.media_frames, 1344, 768, decode_s, device,
                                 audio_first=args.media_audio == "first", grain=args.media_grain,
                                 **({"x264_params": params} if params else {}))
                row.update(probe_mp4(path))
                rec(stage="media", what=f"MP4 {kind} 1344x768x{args.media_frames}, decode {decode_s:g} s",
                    ours_s=row["close_latency_s"], ok=row["close_latency_s"] <= 0.3, **row)
                path.unlink()
