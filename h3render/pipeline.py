"""The resident renderer: load once, render many jobs.

A job reads top to bottom: encode prompt -> pack -> draw noise -> denoise -> decode audio and video -> write MP4
and sidecar. Weights stay on the device between jobs; the only per-job host<->device traffic is the prompt, the
noise, and the finished frames and samples.

A job runs in two phases, `begin` (prompt to latents) and `finish` (latents to MP4 and sidecar); `render` is the
two in a row. The batch queue (`h3render.batch`) on one rank runs job N's `finish` on a worker thread and its own
CUDA stream while the main thread runs job N+1's `begin`; the renderer itself starts no threads.

On several ranks (torchrun, srun, or `h3render` spawning one process per GPU) every rank runs `render` for the same
job in lock-step: the DiT is Ulysses-parallel over the packed rows, the video VAE decode splits its
(window x tile) work items over the ranks, and rank 0 alone writes the MP4 and sidecar.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from h3render import sampling
from h3render.sampling import Schedule
from h3render.colour import frames_to_uint8, rgb_to_i420
from h3render.graphs import ShapeGraphs
from h3render.media import Mp4Writer, PinnedFrameStager
from h3render.models.attention import attention as fast_attention
from h3render.models.attention import fastest_for, select_backend
from h3render.models.attention import runner as attention_runner
from h3render.packing import (AUDIO_CHANNELS, PackedLayout, audio_latents_for, patchify_video, rows_to_audio,
                              t2va_layout, unpatchify_video)
from h3render.parallel.groups import ParallelContext
from h3render.parallel.vae import audio_rank
from h3render.timing import StageTimer, versions, write_sidecar


class RenderError(RuntimeError):
    """A job could not produce a valid MP4 (non-finite latents, frames or audio; bad job for this checkpoint)."""


@dataclass(frozen=True)
class EngineSettings:
    """Engine-level knobs, fixed for the life of a Renderer.

    Attributes:
        crf, x264_preset: H.264 quality (x264 CRF 0..51) and speed preset; defaults CRF 18, "veryfast".
        vae_batch: video VAE decode work items per decoder forward.
        attention: attention backend name ("fa3", "cudnn", "sdpa") or None to choose by measurement.
        progress: show the per-step tqdm bar (at `step_bar_position`; the batch queue bar is at 0).
        compile_vae: on CUDA, `torch.compile` the video VAE decoder blocks (1x H200: 11.0 s -> 7.2 s for 72 latent
            frames at 1344x768; compiled in `prepare`, outside job timings).
        graph_audio: on CUDA, replay the audio VAE decode from a CUDA graph captured per audio length (in `prepare`
            for the jobs' lengths; a new length is captured by the first job that has it, which records it in
            the sidecar's `extra.job_warmup`). Same output bit for bit as the eager decode (h3render/graphs.py).
        save_latents: also write the final latents (`<name>.latents.pt`: video `[24, T, h, w]`, audio
            `[2, 32, Ta]`, float32) beside the MP4, for comparing runs (e.g. 1 vs N GPUs).
        overlap_min_free_gb: batch overlap on CUDA: overlap one job's finish with the next job's begin only when at
            least this much device memory is free (GB, 1e9 bytes); None: estimate it from measured peaks
            (`Renderer.plan_overlap`).
    """

    crf: int = 18
    x264_preset: str = "veryfast"
    vae_batch: int = 8
    attention: str | None = None
    progress: bool = True
    save_latents: bool = False
    step_bar_position: int = 1
    compile_vae: bool = True
    overlap_min_free_gb: float | None = None
    graph_audio: bool = True


@dataclass
class PendingJob:
    """A job between `Renderer.begin` and `Renderer.finish`: its denoised latents, waiting to be decoded and written.

    Attributes:
        video_latent: `[24, T, h, w]` on the device; audio_latent: `[2, 32, Ta]`.
        timer: the job's `StageTimer` (begin's stages recorded; finish adds its own).
        ready: CUDA event recorded on the stream that produced the latents (None off CUDA).
    """

    job: Any
    mp4_path: Path
    sidecar_path: Path
    schedule: Schedule
    timer: StageTimer
    video_latent: torch.Tensor
    audio_latent: torch.Tensor
    ready: Any = None


# Headroom over the measured peaks when deciding whether two jobs' phases fit on the device together
# (fragmentation: two streams' memory pools cannot lend each other cached blocks).
OVERLAP_MEMORY_MARGIN = 1.2


@dataclass(frozen=True)
class OverlapCheck:
    """`Renderer.plan_overlap`'s answer: whether the phases may overlap, why not, and the memory figures (bytes)."""

    ok: bool
    reason: str | None = None
    free_bytes: int | None = None
    need_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        gb = (lambda b: None if b is None else round(b / 1e9, 2))
        return {"ok": self.ok, "reason": self.reason, "free_gb": gb(self.free_bytes), "need_gb": gb(self.need_bytes)}


class Renderer:
    """Holds the loaded model and renders jobs.

    Args:
        components: loaded models + checkpoint info (`h3render.checkpoint.Components`).
        ctx: this rank's place in the render (`h3render.parallel.groups.ParallelContext`).
        settings: `EngineSettings`.
        fasth3: the FastH3 few-step schedule when a student adapter was fused, else None.
    """

    def __init__(self, components, ctx: ParallelContext, settings: EngineSettings = EngineSettings(),
                 fasth3=None, load_seconds: float = 0.0, adapter: dict[str, Any] | None = None):
        self.c = components
        self.adapter = adapter
        self.transformer: dict[str, Any] | None = None  # the --transformer file, when the DiT came from one
        self.ctx = ctx
        self.settings = settings
        self.fasth3 = fasth3
        self.device = ctx.device
        self.load_seconds = load_seconds
        self.warmup: dict[str, float] = {}
        self._tables: dict[tuple[float, ...], Any] = {}
        self._stager = PinnedFrameStager(num_buffers=8)
        # On several ranks only the last one decodes the audio (it writes no MP4) and sends it to rank 0.
        self._decodes_audio = not ctx.distributed or ctx.rank == audio_rank(ctx)
        self.audio_decode = ShapeGraphs(components.audio_vae.decode, name="audio VAE decode",
                                        enabled=settings.graph_audio)  # eager off CUDA
        self._audio_lengths: set[int] = set()  # audio lengths seen by prepare/finish (the same set on every rank)
        self._finish_stream = None  # CUDA stream of finishes on the batch queue's worker thread (made on first use)
        # Measured device memory (bytes above what was allocated before): ("decode", w, h) from the warm-up,
        # ("finish", w, h) and ("begin", w, h, frames) from phases that ran alone. Read by plan_overlap.
        self._peaks: dict[tuple, int] = {}
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            # Measured choice among FA3 / cuDNN SDPA / SDPA; the probe is warm-up, never part of a job.
            backend = select_backend(settings.attention)
            self.c.dit.set_attention(fast_attention, refiner=True)
            self.c.video_vae.set_attention(_heads_first(fast_attention))  # until prepare() probes the VAE's shape
            self.warmup["attention_backend"] = backend
        # One GEMM for the VAE decoder's q/k/v (weights are loaded; the decoder never saves a state dict).
        self.c.video_vae.fuse_qkv_()
        self.warmup["select_attention_s"] = time.perf_counter() - t0

    @classmethod
    def load(cls, checkpoint: str, ctx: ParallelContext, dtype: torch.dtype, settings: EngineSettings = EngineSettings(),
             adapter: str | None = None, transformer_file: str | None = None) -> "Renderer":
        """Load a checkpoint (a path, or "tiny"/"small" for a built-in random model) onto this rank's device.

        With `adapter`, the FastH3 student adapter is fused into the DiT weights while they stream to the device
        (before any sharding), and the renderer runs the student's fixed few-step schedule. `transformer_file` is a
        single-file DiT (ComfyUI layout) used in place of the checkpoint's own transformer.

        Raises:
            CheckpointError, AdapterError: unreadable or mismatched checkpoint / adapter, naming file and tensor.
        """
        from h3render import checkpoint as ckpt
        from h3render.checkpoint import adapter as fasth3

        t0 = time.perf_counter()
        info = ckpt.read_checkpoint_info(checkpoint)
        hook = schedule = adapter_info = None
        if adapter is not None:
            random_model = info.layout == "builtin" or getattr(info, "random_model", None) is not None
            base = fasth3.TINY_BASE_MODEL if random_model else fasth3.RELEASED_BASE_MODEL
            ad = fasth3.read_adapter(adapter, base_model=base)
            if ad.requires_vsa:
                raise fasth3.AdapterError(f"{adapter}: a sparse-attention (VSA) student; h3render runs dense "
                                          "attention only")
            hook = fasth3.AdapterFusion(ad, info.release.dit, ctx.device)
            schedule = fasth3.fasth3_schedule(ad, info.video_shift, info.audio_shift)
            adapter_info = {"path": str(adapter), "sha256": ad.sha256, "base_model": ad.base_model,
                            "rank": ad.rank, "positions": list(schedule.positions), "source": schedule.source}
        elif info.layout != "builtin" and (contract := fasth3.read_v2_contract(checkpoint)) is not None:
            # FastH3 V2: a full distilled checkpoint carrying its own few-step contract (8 forwards, video shift 10)
            schedule = fasth3.fasth3_schedule(contract)
            adapter_info = {"v2_contract": str(Path(checkpoint) / fasth3.V2_CONTRACT_FILE),
                            "positions": list(schedule.positions), "source": schedule.source,
                            "attention": "dense (V2 was trained with sparse attention)"}
        components = ckpt.load_components(checkpoint, ctx.device, dtype, tensor_hook=hook,
                                          transformer_file=transformer_file)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        renderer = cls(components, ctx, settings, fasth3=schedule, load_seconds=time.perf_counter() - t0,
                       adapter=adapter_info)
        if transformer_file is not None:
            # The DiT came from this file, not from the checkpoint folder: the sidecar says so.
            stat = Path(transformer_file).stat()
            renderer.transformer = {"path": str(Path(transformer_file).resolve()), "bytes": stat.st_size,
                                    "mtime": stat.st_mtime}
        return renderer

    # -- schedules and AdaLN tables ---------------------------------------------------------------------------

    def schedule(self, job) -> Schedule:
        """Sigma lists for a job: the FastH3 student's fixed few-step schedule, or the base linspace+shift grid."""
        info = self.c.info
        if job.mode == "fasth3":
            if self.fasth3 is None:
                raise RenderError("mode fasth3 needs a FastH3 adapter (--adapter PATH) fused at load time")
            return self.fasth3
        if self.fasth3 is not None:
            raise RenderError("this renderer runs a FastH3 student (adapter fused, or a V2 checkpoint); base-model "
                              "(t2va) jobs need the base checkpoint without --adapter")
        points = job.steps or info.release.sigma_points
        return Schedule.base(points, info.video_shift, info.audio_shift)

    def tables(self, schedule: Schedule):
        """AdaLN modulation tables for every timestep of a schedule, built once and cached."""
        timesteps = sampling.schedule_timesteps(schedule.video, schedule.audio)
        key = tuple(timesteps.tolist())
        if key not in self._tables:
            self._tables[key] = build_tables(self.c.dit, timesteps, self.device)
        return self._tables[key]

    def prepare(self, jobs: list) -> None:
        """Warm-up outside job timings: build the AdaLN tables of the jobs' schedules and, on CUDA, move the AdaLN
        projections (≈13 B parameters at release) off the GPU (later schedules rebuild tables block by block);
        compile the VAE decoder for the jobs' tile shapes (with `compile_vae`) and measure one decoder batch's
        memory per canvas (the decode estimate of `plan_overlap`); capture the audio decode's CUDA graph for the
        jobs' audio lengths (`graph_audio`)."""
        t0 = time.perf_counter()
        for job in jobs:
            self.tables(self.schedule(job))
        if self.device.type == "cuda":
            offload_adaln_(self.c.dit)
            torch.cuda.empty_cache()
        self.warmup["adaln_tables_s"] = time.perf_counter() - t0
        if jobs:
            t0 = time.perf_counter()
            with torch.no_grad():
                # First-call costs of the text encoder (tokenizer load, kernel selection) stay out of the first job:
                # measured 0.94 s for the first job's 91-token prompt on 2xH200 against 0.04 s warm.
                self.c.text_encoder.encode(jobs[0].prompt)
            self._warm_dit(jobs[0])
            self.warmup["dit_te_warmup_s"] = time.perf_counter() - t0
        if self.device.type == "cuda" and jobs and self.settings.attention in (None, "auto"):
            # The decoder's attention (short sequences, head dim 64) gets its own measured backend.
            vae = self.c.video_vae
            job = jobs[0]
            plan = vae.plan_decode(vae.config.geometry.window_latents, job.height // 16, job.width // 16)
            name, probe = fastest_for(vae.attention_shape(plan, self.settings.vae_batch))
            vae.set_attention(_heads_first(attention_runner(name)))
            self.warmup["vae_attention_backend"] = name
            self.warmup["vae_attention_probe_s"] = probe
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            vae = self.c.video_vae
            if self.settings.compile_vae and not getattr(vae, "pad_batches", False):
                vae.compile_blocks_(dynamic=False)
            with torch.no_grad():
                for width, height in sorted({(j.width, j.height) for j in jobs}):
                    # one window of the canvas: every item of a plan shares one tile shape
                    plan = vae.plan_decode(vae.config.geometry.window_latents, height // 16, width // 16)
                    z = torch.zeros(vae.config.latent_channels, plan.latent_frames, plan.latent_height,
                                    plan.latent_width, device=self.device)
                    torch.cuda.synchronize(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
                    allocated = torch.cuda.memory_allocated(self.device)
                    vae.decode_items(z, plan.items[: self.settings.vae_batch], self.settings.vae_batch)
                    torch.cuda.synchronize(self.device)
                    # Decode estimate for plan_overlap: one decoder batch, plus the float32 frames of the windows
                    # a streaming decode holds at once (raw tiles, stitched window, RGB, yuv420p): four windows.
                    window = 4 * 3 * plan.num_frames * plan.height * plan.width * 4
                    batch = torch.cuda.max_memory_allocated(self.device) - allocated
                    self._learn_peak(("decode", width, height), batch + window)
                    del z
            torch.cuda.synchronize(self.device)
            self.warmup["vae_compile_s" if self.settings.compile_vae else "vae_warmup_s"] = time.perf_counter() - t0
            self.warmup["decode_estimate_gb"] = {f"{k[1]}x{k[2]}": round(v / 1e9, 2)
                                                 for k, v in self._peaks.items() if k[0] == "decode"}
        if self.device.type == "cuda" and self._decodes_audio and "audio_activations" not in self.warmup:
            self._choose_audio_activations()
        lengths = sorted({audio_latents_for(j.frames) for j in jobs} - self._audio_lengths)
        if self.audio_decode.graphs_on(self.device) and lengths:
            t0 = time.perf_counter()
            for length in lengths:
                self._audio_lengths.add(length)
                if self._decodes_audio:
                    self.audio_decode.capture(self._audio_probe(length))
            self.warmup["audio_graph_capture_s"] = self.warmup.get("audio_graph_capture_s", 0.0) + (
                time.perf_counter() - t0)
            self.warmup["audio_graph_latents"] = sorted(self._audio_lengths)
            if self.audio_decode.failure is not None:
                self.warmup["audio_graph_failure"] = self.audio_decode.failure  # decoding eagerly instead

    @torch.no_grad()
    def _choose_audio_activations(self) -> None:
        """Keep the audio decoder's Triton activations (`kernels.alias_free`, the default on CUDA) only if they run
        and agree with the torch ones on a 1 s probe: relative error <= 1e-3 (float rounding gives ~1e-6 before cuDNN's
        TF32 convolutions amplify it; a wrong kernel is off by O(1)). Otherwise the decoder uses the torch path."""
        vae = self.c.audio_vae
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(AUDIO_CHANNELS, vae.config.latent_channels, 40, generator=g).to(self.device)
        try:
            fused = vae.set_fused_activations(None).decode(probe).double()
            reference = vae.set_fused_activations(False).decode(probe).double()
            err = float((fused - reference).norm() / reference.norm().clamp_min(1e-30))
            ok, why = err <= 1e-3, f"rel. err {err:.1e} vs torch on a 1 s probe"  # NaN fails the test too
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"[:300]
        vae.set_fused_activations(None if ok else False)
        self.warmup["audio_activations"] = ("triton" if ok else "torch") + f" ({why})"

    def _audio_probe(self, length: int) -> torch.Tensor:
        """A zero audio latent `[2, 32, length]` (float32, this device): the decode's input shape."""
        return torch.zeros(AUDIO_CHANNELS, self.c.audio_vae.config.latent_channels, length, device=self.device)

    @torch.no_grad()
    def _warm_dit(self, job) -> None:
        """Two short DiT forwards on the job's code path (sharded on several ranks), so the first denoising step of
        the first job pays no Triton compilation, attention set-up or communicator creation (measured on 2xH200:
        the first step took 0.8 s longer than the next ones without this).

        Triton specializes integer arguments on divisibility by 16; one forward with a rank's row count divisible
        by 16 and one with it not divisible compile both variants whatever the job's length.
        """
        dit, dev = self.c.dit, self.device
        tables = self.tables(self.schedule(job))
        frames = 5  # the shortest clip (17n + 5 frames): one forward is milliseconds at any canvas
        base = t2va_layout(1, job.height, job.width, frames).seq_len - 1  # rows besides the text
        world = self.ctx.world_size
        for remainder in (0, 7):
            text_len = next(n for n in range(1, 16 * world + 2) if -(-(base + n) // world) % 16 == remainder)
            layout = t2va_layout(text_len, job.height, job.width, frames).to(dev)
            text = torch.zeros(text_len, dit.cfg.text_dim, dtype=dit.dtype, device=dev)
            video = torch.zeros(layout.video_index.numel(), dit.cfg.video_patch_dim, device=dev)
            audio = torch.zeros(layout.audio_index.numel(), dit.cfg.audio_in_channels, device=dev)
            model_fn = self._model_fn(text, layout, tables, StageTimer(dev))
            model_fn(video, audio, tables.timesteps[0], tables.timesteps[0])
        if self.ctx.distributed:
            from h3render.parallel.vae import share_waveform

            # the audio hand-over is point-to-point: its communicator is created on first use
            tiny = torch.zeros(2, 8, device=dev) if self.ctx.rank == audio_rank(self.ctx) else None
            share_waveform(tiny, (2, 8), self.ctx)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # -- one job ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def render(self, job, mp4_path: Path | str, sidecar_path: Path | str) -> dict[str, Any]:
        """Render `job` to `mp4_path` (+ JSON sidecar); returns the sidecar dict (rank 0) or {} (other ranks).

        The same as `finish(begin(job, mp4_path, sidecar_path))`.

        Raises:
            RenderError: non-finite latents, frames or audio; a job this checkpoint cannot run.
            MediaError: the MP4 could not be written.
        """
        return self.finish(self.begin(job, mp4_path, sidecar_path))

    @torch.no_grad()
    def begin(self, job, mp4_path: Path | str, sidecar_path: Path | str, *, shared: bool = False) -> PendingJob:
        """First phase of a job: encode the prompt, pack, draw the noise, denoise; returns the final latents.

        Runs on the calling thread's current stream. Writes nothing but `<name>.latents.pt` (with `save_latents`).

        Args:
            shared: another job's `finish` runs on this device meanwhile (the batch queue's overlap): stage edges
                synchronize this thread's stream only, and peak memory is not reset or learned (it is shared).

        Raises:
            RenderError: non-finite latents; a job this checkpoint cannot run.
        """
        mp4_path, sidecar_path = Path(mp4_path), Path(sidecar_path)
        c, dev = self.c, self.device
        timer = StageTimer(dev, stream_sync=shared, reset_peaks=not shared)
        t_start = timer.now()
        allocated = torch.cuda.memory_allocated(dev) if timer.cuda else 0

        with timer.stage("text_encode"):
            text = c.text_encoder.encode(job.prompt).to(dev)  # [Nt, text_dim]
        layout = t2va_layout(text.shape[0], job.height, job.width, job.frames).to(dev)
        schedule = self.schedule(job)
        tables = self.tables(schedule)

        video_noise, audio_rows = sampling.draw_noise(job.seed, layout)  # CPU generator, as released
        video_rows = patchify_video(video_noise[0]).to(dev)  # [Nv, 96]
        audio_rows = audio_rows.to(dev)  # [Na, 32]

        with timer.stage("denoise"):
            model_fn = self._model_fn(text, layout, tables, timer)
            bar = _step_bar(schedule.forwards, self.settings.progress and self.ctx.is_main,
                            self.settings.step_bar_position)
            video_rows, audio_rows = sampling.denoise(model_fn, video_rows, audio_rows, schedule.video,
                                                      schedule.audio, on_step=lambda i, v, a: bar.update(1))
            bar.close()
        if not (torch.isfinite(video_rows).all() and torch.isfinite(audio_rows).all()):
            raise RenderError("denoising produced non-finite latents (NaN/Inf); no video written")

        video_latent = unpatchify_video(video_rows, layout)  # [24, T, h, w]
        audio_latent = rows_to_audio(audio_rows, layout)  # [2, 32, Ta]
        if self.settings.save_latents and self.ctx.is_main:
            torch.save({"video": video_latent.float().cpu(), "audio": audio_latent.float().cpu()},
                       mp4_path.with_name(mp4_path.stem + ".latents.pt"))
        del text, video_rows, audio_rows
        ready = None
        if timer.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))  # a finish on another stream waits for this
            if not shared:
                peak = max(timer.stage_peak_bytes.get(s, 0) for s in ("text_encode", "denoise"))
                self._learn_peak(("begin", job.width, job.height, job.frames), peak - allocated)
        timer.add_interval("total", t_start, timer.now())
        return PendingJob(job, mp4_path, sidecar_path, schedule, timer, video_latent, audio_latent, ready)

    @torch.no_grad()
    def finish(self, pending: PendingJob, *, shared: bool = False, side_stream: bool = False,
               cancel: Callable[[], None] | None = None,
               overlap: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Second phase of a job: decode the audio, decode the video window by window into the MP4 writer, write the
        sidecar. Returns the sidecar dict (rank 0) or {} (other ranks).

        Args:
            pending: what `begin` returned.
            shared: another job's `begin` runs on this device meanwhile (see `begin`).
            side_stream: on CUDA, run on this renderer's own stream (made once, so its cached memory is reused
                from job to job) after the stream that produced the latents; for a finish on a worker thread
                while the main thread's stream denoises the next job. No effect on CPU.
            cancel: called between decoded chunks; it raises to abandon the job (the writer then removes its
                temp file). The batch queue's interrupt uses it.
            overlap: called when the sidecar is written; its dict is stored as `timings.overlap`.

        Raises:
            RenderError: non-finite frames or audio.
            MediaError: the MP4 could not be written.
        """
        if side_stream and self.device.type == "cuda":
            if self._finish_stream is None:
                self._finish_stream = torch.cuda.Stream(device=self.device)
            stream = self._finish_stream
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if pending.ready is not None:
                    stream.wait_event(pending.ready)
                else:
                    stream.wait_stream(torch.cuda.default_stream(self.device))
                # The latents came from another stream's memory pool: without this, the caching allocator could
                # hand their blocks to that stream's next job while this stream's kernels still read them.
                pending.video_latent.record_stream(stream)
                pending.audio_latent.record_stream(stream)
                return self._finish(pending, shared, cancel, overlap)
        return self._finish(pending, shared, cancel, overlap)

    def _finish(self, pending: PendingJob, shared: bool, cancel, overlap) -> dict[str, Any]:
        c, dev, job, timer = self.c, self.device, pending.job, pending.timer
        timer.stream_sync, timer.reset_peaks = shared, not shared
        if cancel is not None:
            cancel()
        t_start = timer.now()
        allocated = torch.cuda.memory_allocated(dev) if timer.cuda else 0
        audio_latent = pending.audio_latent
        waveform, job_warmup = self._decode_audio(audio_latent.float(), timer)  # [2, samples] fp32 (None: other rank)
        audio_shape = (audio_latent.shape[0], audio_latent.shape[-1] * c.audio_vae.hop_length)

        result = self._decode_and_write(job, pending.video_latent, waveform, audio_shape, pending.mp4_path, timer,
                                        cancel)
        if job_warmup:
            result["job_warmup"] = job_warmup
        if timer.cuda and not shared:
            peak = max(timer.stage_peak_bytes.get(s, 0) for s in ("vae_audio", "vae_video"))
            self._learn_peak(("finish", job.width, job.height), peak - allocated)
        timer.add_interval("total", t_start, timer.now())
        if not self.ctx.is_main:
            return {}
        return self._sidecar(job, pending.schedule, timer, pending.sidecar_path, result, overlap)

    def _decode_audio(self, latent: torch.Tensor, timer: StageTimer) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Audio latent `[2, 32, Ta]` -> (waveform `[2, Ta * 800]` float32 on the audio rank, else None; warm-up
        this job paid for).

        A length `prepare` did not see is captured here first (once; later jobs of that length replay it): timed
        apart from `vae_audio` as warm-up (`timings.warmup_s`) and reported in the sidecar's `extra.job_warmup`.
        Such a capture synchronizes the whole device when it starts (`torch.cuda.graph`), so a begin overlapping
        this finish stalls meanwhile; the CLI's `prepare` sees every length of the queue.
        """
        job_warmup: dict[str, Any] = {}
        length = latent.shape[-1]
        if self.audio_decode.graphs_on(self.device) and length not in self._audio_lengths:
            self._audio_lengths.add(length)
            seconds = None
            if self._decodes_audio:
                with timer.warmup("audio_graph_capture"):
                    seconds = self.audio_decode.capture(latent)
            job_warmup["audio_graph_capture"] = {"latents": length, "rank": audio_rank(self.ctx),
                                                 "seconds": seconds, "failure": self.audio_decode.failure}
        waveform = None
        if self._decodes_audio:
            with timer.stage("vae_audio"):
                waveform = self.audio_decode(latent)
        return waveform, job_warmup

    # -- overlap of one job's finish with the next job's begin (the batch queue) --------------------------------

    def plan_overlap(self, pending: PendingJob, next_job) -> OverlapCheck:
        """May `pending`'s finish run beside `next_job`'s begin on this device? Called while the device is idle.

        CPU: always (torch's CPU kernels release the GIL). CUDA: when the free device memory (`cudaMemGetInfo`,
        read after the queue returned the cached blocks) covers the estimate of what both phases add on top of
        what is resident: `overlap_min_free_gb` when set, else 1.2 x (decode estimate for `pending`'s canvas +
        denoise estimate for `next_job`'s canvas and length). Decode estimate: the larger of the warm-up's one
        decoder batch (`prepare`) plus four float32 windows of frames, and the largest peak measured in a finish
        that ran alone at that canvas. Denoise estimate: the largest peak measured in a begin that ran alone at
        that canvas and length; until one has run, the answer is no (that begin then runs alone and is measured).
        Also resets the device's peak-memory counter, so the two phases' peak is measured together.
        """
        free = device_free_bytes(self.device)
        if free is None:
            return OverlapCheck(True)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        need, why = self._overlap_need(pending.job, next_job)
        if need is None:
            return OverlapCheck(False, why, free)
        if free < need:
            return OverlapCheck(False, f"{free / 1e9:.1f} GB free < {need / 1e9:.1f} GB needed ({why})", free, need)
        return OverlapCheck(True, None, free, need)

    def _overlap_need(self, finishing, upcoming) -> tuple[int | None, str]:
        if self.settings.overlap_min_free_gb is not None:
            return int(self.settings.overlap_min_free_gb * 1e9), "overlap_min_free_gb"
        decode = max(self._peaks.get(("decode", finishing.width, finishing.height), 0),
                     self._peaks.get(("finish", finishing.width, finishing.height), 0))
        if not decode:
            return None, f"no measured decode peak for {finishing.width}x{finishing.height}"
        denoise = self._peaks.get(("begin", upcoming.width, upcoming.height, upcoming.frames))
        if denoise is None:
            return None, (f"no measured denoise peak for {upcoming.width}x{upcoming.height}x{upcoming.frames} yet "
                          "(that job's begin runs alone once)")
        need = int(OVERLAP_MEMORY_MARGIN * (decode + denoise))
        return need, f"{OVERLAP_MEMORY_MARGIN} x (decode {decode / 1e9:.1f} GB + denoise {denoise / 1e9:.1f} GB)"

    def _learn_peak(self, key: tuple, extra_bytes: int) -> None:
        self._peaks[key] = max(self._peaks.get(key, 0), int(extra_bytes))

    def _model_fn(self, text: torch.Tensor, layout: PackedLayout, tables, timer: StageTimer):
        """`denoise`'s model_fn with per-step timing (device-synchronized) on this rank's rows."""
        dit = self.c.dit
        rope = dit.rope_tables(layout.positions)

        def model_fn(video_rows, audio_rows, video_t, audio_t):
            with timer.step("denoise"):
                index = layout.row_timestep_index(tables.index_of(video_t), tables.index_of(audio_t))
                if self.ctx.distributed:
                    from h3render.parallel.dit import sharded_forward

                    return sharded_forward(dit, self.ctx, video_rows, audio_rows, text, layout, tables, index, rope)
                return dit(video_rows, audio_rows, text, layout, tables, index, rope)

        return model_fn

    def _decode_and_write(self, job, latent: torch.Tensor, waveform: torch.Tensor | None,
                          audio_shape: tuple[int, int], mp4_path: Path, timer: StageTimer,
                          cancel: Callable[[], None] | None = None) -> dict[str, Any]:
        """Decode the video window by window and stream it into the H.264 encoder (rank 0).

        On several ranks rank 0 keeps taking part in every window's gather and in the audio hand-over even after its
        writer failed, so the other ranks finish the job instead of waiting in a collective; then it raises.
        """
        vae = self.c.video_vae
        if self.ctx.distributed:
            from h3render.parallel.vae import decode_stream_split, share_waveform

            frames_iter = decode_stream_split(vae, latent, self.ctx, self.settings.vae_batch)
        else:
            frames_iter = vae.decode_stream(latent, batch_size=self.settings.vae_batch)
        if self.ctx.distributed:
            # Before the video: the audio rank decoded it ahead of its tiles, and the writer then spreads the AAC
            # encoding over the decode instead of running it after the last frame (0.23-0.33 s for 10 s).
            waveform = share_waveform(waveform, audio_shape, self.ctx)
        if not self.ctx.is_main:
            with timer.stage("vae_video"):
                for _ in frames_iter:
                    pass
            return {}

        writer = Mp4Writer(mp4_path, job.width, job.height, job.frames, crf=self.settings.crf,
                           preset=self.settings.x264_preset)
        error: Exception | None = None
        written = 0
        try:
            try:
                if not torch.isfinite(waveform).all():
                    raise RenderError("the audio VAE produced non-finite samples; no video written")
                writer.write_audio(waveform.cpu())
            except Exception as exc:
                if not self.ctx.distributed:
                    raise
                error = exc  # raised after the drain below
            with timer.stage("vae_video"):
                for first, frames in _timed(frames_iter, timer):  # frames [3, n, H, W] float in [0, 1]
                    if error is not None:
                        continue  # drain: the other ranks still decode and gather this job's windows
                    if cancel is not None:
                        cancel()
                    t0 = timer.now()
                    try:
                        written += self._write_chunk(writer, first, frames)
                    except Exception as exc:
                        error = exc
                    timer.add_interval("to_uint8_d2h", t0, timer.now())
            if error is not None:
                raise error
            t_close = timer.now()
            writer.close()
            timer.add_interval("encode_mux", writer.stats.get("start", t_close), writer.stats.get("end", timer.now()))
            timer.add_interval("mp4_close_after_decode", t_close, timer.now())
        except BaseException:
            writer.abort()
            raise
        return {"frames_written": written, "writer": dict(writer.stats)}

    def _write_chunk(self, writer: Mp4Writer, first: int, frames: torch.Tensor) -> int:
        """Convert one decoded chunk `[3, n, H, W]` on its device and hand it to the writer; returns n."""
        if not torch.isfinite(frames).all():
            raise RenderError(f"the video VAE produced non-finite pixels at frame {first}")
        if frames.is_cuda:
            # BT.709 yuv420p planes on the GPU: half the bytes of RGB to copy, no swscale pass on the host
            # (libswscale's own conversion within +-1 code value; docs/performance.md).
            chunk = rgb_to_i420(frames)  # [n, H*3/2, W] uint8
        else:
            chunk = frames_to_uint8(frames)  # [n, H, W, 3] uint8; swscale converts on the encoder thread
        writer.write_frames(self._stager.stage(chunk))
        return chunk.shape[0]

    def _sidecar(self, job, schedule: Schedule, timer: StageTimer, sidecar_path: Path,
                 result: dict[str, Any], overlap: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        info = self.c.info
        sigmas = schedule.to_dict()
        extra = {"load_s": self.load_seconds, "warmup": self.warmup, "world_size": self.ctx.world_size,
                 "mode": job.mode, **result}
        if self.adapter is not None:
            extra["fasth3"] = self.adapter
        checkpoint = {"path": info.path, "layout": info.layout, "release": info.release.name,
                      "config_hash": info.config_hash}
        if self.transformer is not None:
            checkpoint["transformer"] = self.transformer
        timings = timer.summary()
        if overlap is not None:
            timings["overlap"] = overlap()
        data = dict(job_params=job.params(), checkpoint=checkpoint, sigmas=sigmas, timings=timings,
                    versions=versions(), extra=extra)
        write_sidecar(sidecar_path, **data)
        return data


# ---------------------------------------------------------------------------------------------------------------------
# AdaLN tables with the projections off the GPU


def offload_adaln_(dit) -> None:
    """Move every AdaLN projection (blocks + final layer) to host memory; the forward reads tables only."""
    for block in dit.blocks:
        if block.adaln_proj is not None:
            block.adaln_proj.to("cpu")
    if dit.final_layer.adaln_proj is not None:
        dit.final_layer.adaln_proj.to("cpu")


def build_tables(dit, timesteps: torch.Tensor, device: torch.device):
    """`dit.modulation_tables(timesteps)` with each AdaLN projection brought to `device` only for its own block.

    With the projections on the GPU this is just `modulation_tables`; offloaded (see `offload_adaln_`), each block's
    projection visits the GPU once (≈0.5 GB at release) and leaves again, so peak memory stays one block's worth.
    """
    projections = [b.adaln_proj for b in dit.blocks] + [dit.final_layer.adaln_proj]
    on_device = all(p is not None and p.linear.weight.device == device for p in projections)
    if on_device or device.type != "cuda":
        return dit.modulation_tables(timesteps)
    from h3render.models.dit import NUM_MODALITIES, ModulationTables, timestep_sinusoid

    cfg = dit.cfg
    te = dit.time_embedder.proj_in.weight
    ts = torch.as_tensor(timesteps, dtype=torch.float32).reshape(-1).to(device)
    temb = dit.time_embedder(timestep_sinusoid(ts, cfg.freq_dim).to(te.dtype))
    k, h = ts.numel(), cfg.hidden_size

    def run(proj, rows: int) -> torch.Tensor:
        proj.to(device)
        try:
            return proj(temb).view(rows, -1, h)
        finally:
            proj.to("cpu")

    blocks = tuple(run(b.adaln_proj, k * NUM_MODALITIES) for b in dit.blocks)
    final = run(dit.final_layer.adaln_proj, k)
    return ModulationTables(ts, blocks, final)


# ---------------------------------------------------------------------------------------------------------------------
# small helpers


def _heads_first(fn):
    """Adapt a `[B, S, H, D]` attention to the VAE decoder's `[B, H, S, D]` convention."""

    def attention(q, k, v):
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return attention


def _timed(it: Iterator, timer: StageTimer) -> Iterator:
    """Yield from `it`, recording the time spent inside `it` itself (the VAE decode) as stage `vae_decode`."""
    while True:
        t0 = timer.now()
        try:
            item = next(it)
        except StopIteration:
            return
        timer.add_interval("vae_decode", t0, timer.now())
        yield item


def _step_bar(total: int, enabled: bool, position: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="denoise", unit="step", position=position, leave=False, disable=not enabled)


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory the driver reports on a CUDA device (`cudaMemGetInfo`; PyTorch's cached blocks count as used);
    None on other devices."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def release_memory() -> None:
    """Free what a failed job left on the device before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
