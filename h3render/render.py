"""One job, top to bottom: for each window, schedule -> prepare (the task's: text, layout, noise, condition rows) ->
generate (denoise, unpatchify) -> deliver (decode audio, stream the video into the writer); then the MP4's tail and
the sidecar.

A job is one window unless its task splits it (`tasks.windows_of`: a clip longer than one pass, `h3render.windows`)
or the caller does (`render_windows`): the windows' frames and soundtracks go through one writer into one MP4, the
frames they share cross-faded (`h3render.seams`), and the sidecar lists every window. What differs between tasks is in the task's module
(`h3render.tasks`); this file has no task branch.

Every rank runs this for the same job in lock-step; what differs between ranks is the engine's parallel plan
(`h3render.parallel.plan.ParallelPlan`): the DiT forward it hands over, which rank decodes the audio, where decoded
frames arrive, and whether this rank writes. Weights stay on the device between jobs; the only per-job host<->device
traffic is the prompt, the noise, and the finished frames and samples.
"""

from __future__ import annotations

import copy
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from h3render import sampling
from h3render.colour import frames_to_uint8, rgb_to_i420
from h3render.errors import RenderError
from h3render.media import Mp4Writer
from h3render.models.fp8 import precision_report
from h3render.packing import rows_to_audio, unpatchify_video
from h3render.progress import Progress, as_progress
from h3render.sidecar import write_sidecar
from h3render.seams import Splicer, back_to_back
from h3render.tasks import task_of, windows_of
from h3render.tasks.base import Prepared
from h3render.timing import StageTimer, device_name, utc_now, versions
from h3render.windows import Window


@dataclass(eq=False)
class Latents:
    """What `generate` hands `deliver`: one window's final latents and how they were made.

    Attributes:
        video: `[24, T, h, w]` float32 video latent of the generated frames (condition rows dropped).
        audio: `[2, 32, Ta]` float32 audio latent (stereo as a batch of 2).
        schedule: the `sampling.Schedule` that made them.
        record: what the task adds to the sidecar's `extra` (fl2va: the keyframes and presentation).
    """

    video: torch.Tensor
    audio: torch.Tensor
    schedule: sampling.Schedule
    record: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def render_job(engine, job, mp4_path: Path, sidecar_path: Path) -> Future:
    """Render `job` with `engine` (`h3render.engine.Engine`) into `mp4_path` and its JSON sidecar: one window.

    Returns once the last frame is in the writer; the Future resolves to the sidecar dict (rank 0; {} on the other
    ranks) after the writer's tail (flush, trailer, fsync, rename, then the sidecar) finished on its own thread.

    Raises:
        RenderError: non-finite latents, frames or audio; a job this checkpoint cannot run.
        MediaError: the MP4 could not be written.
    """
    windows, plan = windows_of(job)  # one window, unless the job's task splits it (a clip longer than one pass)
    return render_windows(engine, job, windows, mp4_path, sidecar_path, plan)


@torch.no_grad()
def render_windows(engine, job, windows: Sequence, mp4_path: Path, sidecar_path: Path,
                   plan: Sequence[Window] | None = None) -> Future:
    """Render `windows` (jobs of the same canvas, each 17n + 5 frames, in order) into one MP4 of all their frames
    and soundtracks, described by `job` (its `params()` are the sidecar's `job`, and the resume key).

    `plan` (`h3render.windows.Window` per window) says where each window sits in the MP4: the frames it shares
    with the one before are cross-faded and its frames past `keep` go to the next window's blend or are dropped
    (`seams.Splicer`); default: the windows back to back, whole. A window's task may condition it on the window
    before: its `follow(window, previous Latents)` gives the window to prepare.

    The sidecar's `extra.windows` lists every window (frames, seed, task, sigmas, when it ran, where it sits, what
    the task recorded) when there is more than one. Returns and raises as `render_job`.
    """
    plan = tuple(plan) if plan is not None else back_to_back([w.frames for w in windows])
    dev, settings = engine.device, engine.settings
    timer = StageTimer(dev)
    t_start = timer.now()
    started_at = utc_now()
    # Stage progress on rank 0 only (the ranks run the same stages in lock-step).
    progress = as_progress(settings.progress, settings.step_bar_position) if engine.plan.writes else Progress("off")
    sink = _Sink(engine, mp4_path, job, plan, progress) if engine.plan.writes else None
    records: list[dict[str, Any]] = []
    first: Latents | None = None
    previous: Latents | None = None
    precision: dict[str, str] = {}
    try:
        for i, window in enumerate(windows):
            follow = getattr(task_of(window), "follow", None)
            if follow is not None and previous is not None:
                window = follow(window, previous)
            label = mp4_path.stem if len(windows) == 1 else f"{mp4_path.stem} [window {i + 1}/{len(windows)}]"
            t0 = timer.now() - t_start
            engine.use_loras(window)  # the job's LoRA set (issue #25): fused or side path, no reload
            schedule = engine.schedule(window)  # a mixed queue's first fasth3 job fuses (and, fp8, quantizes) the DiT
            # What each component computes in, read now: the sidecar is written on the writer's thread, by when the
            # next job may have fused and quantized the DiT.
            precision = precision or _precision_report(engine)
            # One prompt (with its keyframes or references) a window: a total, so the bar reads 1/1, not a bare count
            with progress.stage(label, task_of(window).ENCODE_STAGE, 1, "prompt") as shown:
                prepared = task_of(window).prepare(engine, window, timer)
                shown.update()
            latents = generate(engine, window, prepared, schedule, timer, progress, label)
            del prepared
            if settings.save_latents and engine.plan.writes:
                _save_latents(mp4_path, i, latents)
            first = first or latents
            t1 = timer.now() - t_start
            with engine.vae_on_device():  # the streamed memory plan keeps the video VAE off the device till now
                deliver(engine, window, latents, sink, timer)
            previous = latents if i + 1 < len(windows) else None
            records.append({"index": i, "frames": window.frames, "seed": window.seed, "task": window.task,
                            **plan[i].to_dict(), "sigmas": latents.schedule.to_dict(), "started_s": t0,
                            "generated_s": t1, "delivered_s": timer.now() - t_start,
                            "peak_memory_bytes": timer.take_peak(), **latents.record})
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    if sink is None:
        done: Future = Future()
        done.set_result({})
        return done
    # The engine's warm-up record as this job leaves it, copied here: the sidecar is written on the writer's thread,
    # by when the next job may have added its own warm-up (a LoRA switch, a new canvas's tables).
    warmup = copy.deepcopy(engine.warmup)

    def facts() -> dict[str, Any]:
        # Read on the writer's thread once the MP4 is in place (the sidecar goes last, so a sidecar never describes
        # an MP4 that is not there).
        levels = sink.writer.audio_levels  # the soundtrack's peak, measured before it was clipped to full scale
        result = {"frames_written": sink.written, "writer": dict(sink.writer.stats), "audio": levels.to_dict(),
                  **first.record}
        if levels.warning(mp4_path.name) and engine.c.info.random_model is None:  # random weights: always saturated
            sink.progress.write(levels.warning(mp4_path.name))
        if sink.job_warmup:
            result["job_warmup"] = sink.job_warmup
        if len(windows) > 1:
            result["windows"] = records
        run = run_facts(engine, mp4_path, started_at, precision)
        return _write_sidecar(engine, job, first.schedule, timer, sidecar_path, result, run, mp4_path, warmup)

    return sink.finish(timer, t_start, facts)


@torch.no_grad()
def generate(engine, job, prepared: Prepared, schedule: sampling.Schedule, timer: StageTimer,
             progress: Progress | None = None, label: str = "") -> Latents:
    """Denoise `prepared` (the task's rows) over `schedule` and unpack the final rows into latents.

    Raises:
        RenderError: non-finite latents (NaN/Inf): no video is written.
    """
    progress = progress or Progress("off")
    tables = engine.tables(schedule, task_of(job).timesteps(schedule), prepared.partition)
    with timer.stage("denoise"), progress.stage(label, "denoise", schedule.forwards, "forwards") as shown:
        model_fn = _timed_steps(engine.model_fn(prepared, tables), timer)
        video_rows, audio_rows = sampling.denoise(model_fn, prepared.video_rows, prepared.audio_rows, schedule.video,
                                                  schedule.audio, on_step=lambda i, v, a: shown.update(1))
    if not (torch.isfinite(video_rows).all() and torch.isfinite(audio_rows).all()):
        raise RenderError("denoising produced non-finite latents (NaN/Inf); no video written")
    video = unpatchify_video(video_rows, prepared.output_layout)  # [24, T, h, w]; condition rows never written
    audio = rows_to_audio(audio_rows, prepared.output_layout).float()  # [2, 32, Ta]
    return Latents(video=video, audio=audio, schedule=schedule, record=prepared.record)


@torch.no_grad()
def deliver(engine, job, latents: Latents, sink: "_Sink | None", timer: StageTimer) -> None:
    """Decode one window's audio and video into `sink` (rank 0's writer; None on the other ranks, whose tiles go to
    rank 0 inside the decode stream). The soundtrack goes first: the writer then spreads the AAC encoding over the
    decode instead of running it after the last frame (0.23-0.33 s for 10 s of stereo).

    Raises:
        RenderError: non-finite audio or frames (on several ranks only after the stream is drained).
        MediaError: the writer refused a chunk.
    """
    c, plan = engine.c, engine.plan
    before = timer.total("vae_audio")
    waveform, job_warmup = engine.decode_audio(latents.audio, timer)  # [2, samples] fp32 (None: another rank's)
    audio_s = timer.total("vae_audio") - before  # 0 where another rank decodes the audio
    audio_shape = (latents.audio.shape[0], latents.audio.shape[-1] * c.audio_vae.hop_length)
    frames = plan.decode_stream(c.video_vae, latents.video, engine.settings.vae_batch)
    waveform, audio_s = plan.share_waveform(waveform, audio_shape, audio_s)
    if sink is not None and not plan.decodes_audio:
        # The audio rank's decode, as ending when its waveform arrived here: this rank waits for the soundtrack
        # before its own video decode, so on several ranks the stage runs just before vae_video, not beside it.
        t_received = timer.now()
        timer.add_interval("vae_audio", t_received - audio_s, t_received)
    if sink is None:
        with timer.stage("vae_video"):
            for _ in frames:
                pass  # this rank's tiles go to rank 0 inside the stream
        return
    sink.job_warmup.update(job_warmup)
    sink.write(waveform, frames, timer)


class _Sink:
    """Rank 0's side of a job's MP4: the writer (opened at the first window's decode, for all windows' frames), the
    windows' seams (`seams.Splicer`), the decode progress of the window being written, the encode progress of the
    whole MP4, and the frames written."""

    def __init__(self, engine, mp4_path: Path, job, plan: Sequence[Window], progress: Progress):
        self.engine, self.mp4_path, self.job, self.progress = engine, mp4_path, job, progress
        self.windows = [w.frames for w in plan]
        self.splicer = Splicer(plan)
        self.writer: Mp4Writer | None = None
        self.written = 0
        self.job_warmup: dict[str, Any] = {}
        self._done: list[int] = []  # first MP4 frame of each window written so far
        self.decode = self.encode = None

    def _open(self) -> None:
        settings, keeps = self.engine.settings, self.splicer.keeps
        self.writer = Mp4Writer(self.mp4_path, self.job.width, self.job.height, sum(keeps), crf=settings.crf,
                                preset=settings.x264_preset, windows=keeps)
        total = sum(keeps)
        self.encode = self.progress.stage(self.mp4_path.stem, "encode", total, "frames", row=1)

    def write(self, waveform: torch.Tensor | None, frames: Iterator, timer: StageTimer) -> None:
        """Soundtrack first, then every decoded chunk into the writer.

        On several ranks a failure here is raised only after the stream is drained: the other ranks still decode and
        gather this window's tiles, and must not be left waiting in a collective.
        """
        if self.writer is None:
            self._open()
        index = len(self._done)
        self.decode = self.progress.stage(self.mp4_path.stem, "decode", self.windows[index], "frames")
        self._done.append(self.written)
        distributed = self.engine.ctx.distributed
        error: BaseException | None = None
        try:
            if not torch.isfinite(waveform).all():
                raise RenderError("the audio VAE produced non-finite samples; no video written")
            self.writer.write_audio(self.splicer.audio(index, waveform.cpu()))
        except Exception as exc:
            if not distributed:
                raise
            error = exc
        with timer.stage("vae_video"):
            for first, chunk in _timed_decode(frames, timer):  # chunk [3, n, H, W] float in [0, 1]
                if error is not None:
                    continue  # drain
                t0 = timer.now()
                try:
                    self.decode.update(chunk.shape[1])
                    chunk = self.splicer.frames(index, first, chunk)  # the seam blended; held or dropped frames out
                    n = 0 if chunk is None else self._write_chunk(self.written, chunk)
                    self.written += n
                    self.encode.update(self.writer.frames_encoded - self.encode.done)
                except Exception as exc:
                    if not distributed:
                        raise
                    error = exc
                timer.add_interval("to_uint8_d2h", t0, timer.now())
        if error is not None:
            raise error
        self.decode.close()

    def _write_chunk(self, first: int, frames: torch.Tensor) -> int:
        """Convert one decoded chunk `[3, n, H, W]` on its device and hand it to the writer; returns n."""
        if not torch.isfinite(frames).all():
            raise RenderError(f"the video VAE produced non-finite pixels at frame {first}")
        if frames.is_cuda:
            # BT.709 yuv420p planes on the GPU: half the bytes of RGB to copy, no swscale pass on the host
            # (libswscale's own conversion within +-1 code value; docs/performance.md).
            chunk = rgb_to_i420(frames)  # [n, H*3/2, W] uint8
        else:
            chunk = frames_to_uint8(frames)  # [n, H, W, 3] uint8; swscale converts on the encoder thread
        self.writer.write_frames(self.engine.stager.stage(chunk))
        return chunk.shape[0]

    def close_progress(self) -> None:
        for stage in (self.decode, self.encode):
            if stage is not None:
                if stage is self.encode and self.writer is not None:
                    stage.update(self.writer.frames_encoded - stage.done)
                stage.close()

    def abort(self) -> None:
        self.close_progress()
        if self.writer is not None:
            self.writer.abort()

    def finish(self, timer: StageTimer, t_start: float, facts) -> Future:
        """Hand the MP4's tail to the writer's thread; `facts()` writes the sidecar there once the MP4 is in place."""
        t_close = timer.now()
        timer.freeze_peak()
        writer = self.writer

        def done(error: BaseException | None):
            self.close_progress()
            if error is not None:
                return None  # the writer's Future raises it
            timer.add_interval("encode_mux", writer.marks.get("start", t_close), writer.marks.get("end", timer.now()))
            timer.add_interval("mp4_close_after_decode", t_close, timer.now())
            timer.add_interval("total", t_start, timer.now())
            return facts()

        try:
            return writer.finish_async(then=done)
        except BaseException:
            self.close_progress()
            raise


def run_facts(engine, mp4_path: Path, started_at: str, components: dict[str, str]) -> dict[str, Any]:
    """What ran this job, for the sidecar's ``run`` (docs/sidecar.md): the output, the start time, the device, the
    precision the engine ran (`spec.ran_precision`: fp8, bf16 or fp32) and `components`
    (`models.fp8.precision_report` at the job's start), the dtypes the components hold, the attention backends
    actually used (and the one asked for), the x264 settings, and the process's command line (`sys.argv`: under
    torchrun every rank has it, a spawned rank inherits it)."""
    dev = engine.device
    requested = engine.settings.attention or "auto"
    dit_attention = str(engine.warmup.get("attention_backend", "sdpa"))
    if dev.type != "cuda":
        dit_attention = vae_attention = "sdpa"  # off CUDA the models keep torch SDPA; --attention is not applied
    else:
        # The VAE decoder runs the process-wide choice until prepare() measures its own shape (auto only).
        vae_attention = str(engine.warmup.get("vae_attention_backend", dit_attention))
    c = engine.c
    text_phase = engine.warmup.get("text_phase", {})  # phased / streamed plans: the encoder is freed by now
    te_dtype = _main_dtype(c.text_encoder) if c.text_encoder is not None else text_phase.get("dtype", "none")
    dtypes = {"dit": str(c.dit.dtype).removeprefix("torch."), "text_encoder": te_dtype,
              "video_vae": _main_dtype(c.video_vae), "audio_vae": _main_dtype(c.audio_vae),
              "float32_matmul": torch.get_float32_matmul_precision()}
    return {"output": str(Path(mp4_path).resolve()), "started_at": started_at, "argv": list(sys.argv),
            "device": {"type": dev.type, "name": device_name(dev), "ranks": engine.ctx.world_size},
            "dtype": dtypes["dit"], "dtypes": dtypes, "precision": engine.settings.ran_precision,
            "precision_components": dict(components),
            "attention": {"requested": requested, "dit": dit_attention, "vae": vae_attention},
            "encoder": {"crf": engine.settings.crf, "x264_preset": engine.settings.x264_preset},
            "memory": _memory_facts(engine)}


def _precision_report(engine) -> dict[str, str]:
    """`models.fp8.precision_report` of the engine's parts; the text encoder's from the text phase when freed."""
    report = precision_report(engine.c)
    text_phase = engine.warmup.get("text_phase")
    if "text_encoder" not in report and text_phase is not None:
        report["text_encoder"] = text_phase["precision"]
    return {k: report[k] for k in ("dit_blocks", "dit_other", "text_encoder", "video_vae", "audio_vae") if k in report}


def _memory_facts(engine) -> dict[str, Any]:
    """The sidecar's `run.memory` (docs/sidecar.md): the plan that ran, why, and its expected peaks
    (`memplan.MemoryPlan.record`, chosen before the load); just the plan for an engine built without the chooser."""
    chosen = getattr(engine.settings, "memory", None)
    facts = dict(chosen) if chosen else {"plan": engine.warmup.get("memory_plan", "resident"),
                                         "precision": engine.settings.ran_precision}
    facts["plan"] = engine.warmup.get("memory_plan", facts["plan"])
    return facts


def _main_dtype(module: torch.nn.Module) -> str:
    """The dtype that holds most of a module's parameters (fp32 islands aside), e.g. "bfloat16"."""
    count: dict[str, int] = {}
    for p in module.parameters():
        name = str(p.dtype).removeprefix("torch.")
        count[name] = count.get(name, 0) + p.numel()
    return max(count, key=count.get) if count else "none"


def _write_sidecar(engine, job, schedule: sampling.Schedule, timer: StageTimer, path: Path,
                   result: dict[str, Any], run: dict[str, Any], mp4_path: Path,
                   warmup: dict[str, Any]) -> dict[str, Any]:
    info = engine.c.info
    extra = {"load_s": engine.load_seconds, "warmup": warmup, "world_size": engine.ctx.world_size,
             "mode": job.mode, **result}
    if engine.adapter is not None and job.mode == "fasth3":
        extra["fasth3"] = engine.adapter
    if job.loras:
        extra["loras"] = engine.lora_record(job)
    checkpoint = {"path": info.recorded_path, "layout": info.layout, "release": info.release.name,
                  "config_hash": info.config_hash}
    if engine.transformer is not None:
        checkpoint["transformer"] = engine.transformer
    data = dict(job_params=job.params(), checkpoint=checkpoint, sigmas=schedule.to_dict(), timings=timer.summary(),
                versions=versions(), run=run, extra=extra)
    write_sidecar(path, media=mp4_path, **data)  # size + sha256 of the MP4 now in place: resume checks them
    return data


def _save_latents(mp4_path: Path, index: int, latents: Latents) -> None:
    """`<name>.latents.pt` (window 0) or `<name>.latents.<i>.pt`: video `[24, T, h, w]`, audio `[2, 32, Ta]`."""
    name = mp4_path.stem + (".latents.pt" if index == 0 else f".latents.{index}.pt")
    torch.save({"video": latents.video.float().cpu(), "audio": latents.audio.cpu()}, mp4_path.with_name(name))


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
