"""One job, top to bottom: schedule -> encode (text; fl2va: keyframes too) -> layout -> noise -> denoise -> unpack ->
decode audio -> stream video into the writer -> sidecar.

Every rank runs this for the same job in lock-step; what differs between ranks is the engine's parallel plan
(`h3render.parallel.plan.ParallelPlan`): the DiT forward it hands over, which rank decodes the audio, where decoded
frames arrive, and whether this rank writes. Weights stay on the device between jobs; the only per-job host<->device
traffic is the prompt, the noise, and the finished frames and samples.
"""

from __future__ import annotations

from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch

from h3render import sampling
from h3render.colour import frames_to_uint8, rgb_to_i420
from h3render.engine import RenderError
from h3render.media import Mp4Writer
from h3render.models.fp8 import precision_report
from h3render.packing import patchify_video, rows_to_audio, t2va_layout, unpatchify_video
from h3render.progress import Progress, as_progress
from h3render.timing import StageTimer, device_name, utc_now, versions, write_sidecar


@torch.no_grad()
def render_job(engine, job, mp4_path: Path, sidecar_path: Path) -> Future:
    """Render `job` with `engine` (`h3render.engine.Engine`) into `mp4_path` and its JSON sidecar.

    Returns once the last frame is in the writer; the Future resolves to the sidecar dict (rank 0; {} on the other
    ranks) after the writer's tail (flush, trailer, fsync, rename, then the sidecar) finished on its own thread.

    Raises:
        RenderError: non-finite latents, frames or audio; a job this checkpoint cannot run.
        MediaError: the MP4 could not be written.
    """
    c, dev, plan, settings = engine.c, engine.device, engine.plan, engine.settings
    timer = StageTimer(dev)
    t_start = timer.now()
    started_at = utc_now()
    # Stage progress on rank 0 only (the ranks run the same stages in lock-step).
    progress = as_progress(settings.progress, settings.step_bar_position) if plan.writes else Progress("off")
    label = mp4_path.stem

    schedule = engine.schedule(job)  # a mixed queue's first fasth3 job fuses (and, fp8, quantizes) the DiT here
    # What each component computes in, read now: the sidecar is written on the writer's thread, by when the next
    # job may have fused and quantized the DiT.
    precision = precision_report(c)
    # fl2va (keyframes): text with vision blocks, condition rows, a layout with them (h3render.conditioning).
    with progress.stage(label, "text + keyframes encode") if job.task == "fl2va" else nullcontext():
        condition = _condition(engine, job, timer)
    if condition is None:
        with progress.stage(label, "text encode"), timer.stage("text_encode"):
            text = c.text_encoder.encode(job.prompt).to(dev)  # [Nt, text_dim]
        layout = t2va_layout(text.shape[0], job.height, job.width, job.frames).to(dev)
    else:
        text, layout = condition.text, condition.layout
    tables = engine.tables(schedule, keyframes=condition is not None)
    # CPU generator, as released; fl2va continues the generator that drew the keyframe noise
    video_noise, audio_rows = sampling.draw_noise(job.seed if condition is None else condition.generator, layout)
    video_rows = patchify_video(video_noise[0]).to(dev)  # [Nv, 96]
    audio_rows = audio_rows.to(dev)  # [Na, 32]

    with timer.stage("denoise"), progress.stage(label, "denoise", schedule.forwards, "steps") as shown:
        model_fn = _timed_steps(engine.model_fn(text, layout, tables, None if condition is None else condition.rows),
                                timer)
        video_rows, audio_rows = sampling.denoise(model_fn, video_rows, audio_rows, schedule.video, schedule.audio,
                                                  on_step=lambda i, v, a: shown.update(1))
    if not (torch.isfinite(video_rows).all() and torch.isfinite(audio_rows).all()):
        raise RenderError("denoising produced non-finite latents (NaN/Inf); no video written")
    if condition is not None:
        layout = layout.target_layout()  # the generated rows only; the condition rows were never written
    video_latent = unpatchify_video(video_rows, layout)  # [24, T, h, w]
    audio_latent = rows_to_audio(audio_rows, layout).float()  # [2, 32, Ta]
    if settings.save_latents and plan.writes:
        torch.save({"video": video_latent.float().cpu(), "audio": audio_latent.cpu()},
                   mp4_path.with_name(mp4_path.stem + ".latents.pt"))
    del text, video_rows, audio_rows

    waveform, job_warmup = engine.decode_audio(audio_latent, timer)  # [2, samples] fp32 (None: another rank's)
    audio_shape = (audio_latent.shape[0], audio_latent.shape[-1] * c.audio_vae.hop_length)
    frames = plan.decode_stream(c.video_vae, video_latent, settings.vae_batch)
    # Before the video: the writer then spreads the AAC encoding over the decode instead of running it after the
    # last frame (0.23-0.33 s for 10 s of stereo).
    waveform = plan.share_waveform(waveform, audio_shape)
    if not plan.writes:
        with timer.stage("vae_video"):
            for _ in frames:
                pass  # this rank's tiles go to rank 0 inside the stream
        done: Future = Future()
        done.set_result({})
        return done

    writer = Mp4Writer(mp4_path, job.width, job.height, job.frames, crf=settings.crf, preset=settings.x264_preset)
    shown = _Shown(progress.stage(label, "decode", job.frames, "frames"),
                   progress.stage(label, "encode", job.frames, "frames", row=1), writer)
    try:
        written = _stream_video(engine, writer, waveform, frames, timer, shown)
    except BaseException:
        shown.close()
        writer.abort()
        raise
    t_close = timer.now()
    timer.freeze_peak()
    shown.decode.close()

    def tail() -> dict[str, Any]:
        # On the writer's thread, once the MP4 is renamed into place: the sidecar goes last, so a sidecar never
        # describes an MP4 that is not there.
        shown.close()
        timer.add_interval("encode_mux", writer.marks.get("start", t_close), writer.marks.get("end", timer.now()))
        timer.add_interval("mp4_close_after_decode", t_close, timer.now())
        timer.add_interval("total", t_start, timer.now())
        result = {"frames_written": written, "writer": dict(writer.stats)}
        if job_warmup:
            result["job_warmup"] = job_warmup
        if condition is not None:
            result["fl2va"] = condition.record
        run = run_facts(engine, mp4_path, started_at, precision)
        return _write_sidecar(engine, job, schedule, timer, sidecar_path, result, run, mp4_path)

    try:
        future = writer.finish_async(then=tail)
    except BaseException:
        shown.close()
        raise
    future.add_done_callback(lambda _: shown.close())  # an encoder failure in the tail never reaches tail()
    return future


class _Shown:
    """The decode and encode progress of one job: frames decoded, and frames the writer's x264 thread took in."""

    def __init__(self, decode, encode, writer: Mp4Writer):
        self.decode, self.encode, self.writer = decode, encode, writer

    def frames(self, n: int) -> None:
        self.decode.update(n)
        self.encode.update(self.writer.frames_encoded - self.encode.done)

    def close(self) -> None:
        self.decode.close()
        self.encode.update(self.writer.frames_encoded - self.encode.done)
        self.encode.close()


def _stream_video(engine, writer: Mp4Writer, waveform: torch.Tensor | None, frames: Iterator, timer,
                  shown: _Shown) -> int:
    """Soundtrack first, then every decoded chunk into the writer; returns the frames written.

    On several ranks a failure here is raised only after the stream is drained: the other ranks still decode and
    gather this job's windows, and must not be left waiting in a collective.
    """
    error: BaseException | None = None
    written = 0
    try:
        if not torch.isfinite(waveform).all():
            raise RenderError("the audio VAE produced non-finite samples; no video written")
        writer.write_audio(waveform.cpu())
    except Exception as exc:
        if not engine.ctx.distributed:
            raise
        error = exc
    with timer.stage("vae_video"):
        for first, chunk in _timed_decode(frames, timer):  # chunk [3, n, H, W] float in [0, 1]
            if error is not None:
                continue  # drain
            t0 = timer.now()
            try:
                n = _write_chunk(engine, writer, first, chunk)
                written += n
                shown.frames(n)
            except Exception as exc:
                if not engine.ctx.distributed:
                    raise
                error = exc
            timer.add_interval("to_uint8_d2h", t0, timer.now())
    if error is not None:
        raise error
    return written


def _write_chunk(engine, writer: Mp4Writer, first: int, frames: torch.Tensor) -> int:
    """Convert one decoded chunk `[3, n, H, W]` on its device and hand it to the writer; returns n."""
    if not torch.isfinite(frames).all():
        raise RenderError(f"the video VAE produced non-finite pixels at frame {first}")
    if frames.is_cuda:
        # BT.709 yuv420p planes on the GPU: half the bytes of RGB to copy, no swscale pass on the host
        # (libswscale's own conversion within +-1 code value; docs/performance.md).
        chunk = rgb_to_i420(frames)  # [n, H*3/2, W] uint8
    else:
        chunk = frames_to_uint8(frames)  # [n, H, W, 3] uint8; swscale converts on the encoder thread
    writer.write_frames(engine.stager.stage(chunk))
    return chunk.shape[0]


def run_facts(engine, mp4_path: Path, started_at: str, components: dict[str, str]) -> dict[str, Any]:
    """What ran this job, for the sidecar's ``run`` (docs/sidecar.md): the output, the start time, the device, the
    engine's precision setting and `components` (`models.fp8.precision_report` at the job's start), the dtypes the
    components hold, the attention backends actually used (and the one asked for), the x264 settings."""
    dev = engine.device
    requested = engine.settings.attention or "auto"
    dit_attention = str(engine.warmup.get("attention_backend", "sdpa"))
    if dev.type != "cuda":
        dit_attention = vae_attention = "sdpa"  # off CUDA the models keep torch SDPA; --attention is not applied
    else:
        # The VAE decoder runs the process-wide choice until prepare() measures its own shape (auto only).
        vae_attention = str(engine.warmup.get("vae_attention_backend", dit_attention))
    c = engine.c
    dtypes = {"dit": str(c.dit.dtype).removeprefix("torch."), "text_encoder": _main_dtype(c.text_encoder),
              "video_vae": _main_dtype(c.video_vae), "audio_vae": _main_dtype(c.audio_vae),
              "float32_matmul": torch.get_float32_matmul_precision()}
    return {"output": str(Path(mp4_path).resolve()), "started_at": started_at,
            "device": {"type": dev.type, "name": device_name(dev), "ranks": engine.ctx.world_size},
            "dtype": dtypes["dit"], "dtypes": dtypes, "precision": engine.precision,
            "precision_components": dict(components),
            "attention": {"requested": requested, "dit": dit_attention, "vae": vae_attention},
            "encoder": {"crf": engine.settings.crf, "x264_preset": engine.settings.x264_preset}}


def _main_dtype(module: torch.nn.Module) -> str:
    """The dtype that holds most of a module's parameters (fp32 islands aside), e.g. "bfloat16"."""
    count: dict[str, int] = {}
    for p in module.parameters():
        name = str(p.dtype).removeprefix("torch.")
        count[name] = count.get(name, 0) + p.numel()
    return max(count, key=count.get) if count else "none"


def _write_sidecar(engine, job, schedule: sampling.Schedule, timer: StageTimer, path: Path,
                   result: dict[str, Any], run: dict[str, Any], mp4_path: Path) -> dict[str, Any]:
    info = engine.c.info
    extra = {"load_s": engine.load_seconds, "warmup": engine.warmup, "world_size": engine.ctx.world_size,
             "mode": job.mode, **result}
    if engine.adapter is not None and job.mode == "fasth3":
        extra["fasth3"] = engine.adapter
    checkpoint = {"path": info.recorded_path, "layout": info.layout, "release": info.release.name,
                  "config_hash": info.config_hash}
    if engine.transformer is not None:
        checkpoint["transformer"] = engine.transformer
    data = dict(job_params=job.params(), checkpoint=checkpoint, sigmas=schedule.to_dict(), timings=timer.summary(),
                versions=versions(), run=run, extra=extra)
    write_sidecar(path, media=mp4_path, **data)  # size + sha256 of the MP4 now in place: resume checks them
    return data


def _condition(engine, job, timer: StageTimer):
    """fl2va: the job's `h3render.conditioning.Condition`, or None for a t2va job.

    Raises:
        RenderError: a keyframe changed since validation or can no longer be read.
    """
    if getattr(job, "task", "t2va") != "fl2va":
        return None
    from h3render.conditioning import prepare_condition

    try:
        return prepare_condition(engine, job, timer)
    except ValueError as exc:
        raise RenderError(f"job {job.output!r}: {exc}") from None


def _timed_steps(model_fn, timer: StageTimer):
    """`model_fn` with each forward timed (device-synchronized) as a step of stage `denoise`."""

    def timed(*args):
        with timer.step("denoise"):
            return model_fn(*args)

    return timed


def _timed_decode(it: Iterator, timer: StageTimer) -> Iterator:
    """Yield from `it`, recording the time spent inside `it` itself (the VAE decode) as stage `vae_decode`."""
    while True:
        t0 = timer.now()
        try:
            item = next(it)
        except StopIteration:
            return
        timer.add_interval("vae_decode", t0, timer.now())
        yield item

