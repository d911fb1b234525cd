"""The resident engine: load once, keep the weights on the device, render many jobs (`h3render.render`).

The engine owns what outlives a job: the loaded components, the attention backend chosen by measurement, the
parallel plan (`h3render.parallel.plan`: applied once here, handed to every job), the AdaLN tables per schedule,
the audio decode's CUDA graphs per length, the pinned frame buffers, and the warm-up that keeps first-call costs
(Triton compilation, communicator set-up, tokenizer load) out of job timings. A job itself is `render.render_job`;
what is task-specific is in the task's module (`h3render.tasks`), never here.

The DiTs are held by checkpoint partition (`tasks.base.BASE_PARTITION` for t2va and fl2va; ref2va's
"transformer_ref"), each loaded once, on first use, with the parallel plan's forward applied once (`dit_forward`).
On CUDA, when the device cannot hold another DiT beside the active one, the inactive one waits in host memory and
is swapped back when a job needs it (`dit_of`; each swap timed in the warm-up record's `partition_swaps`).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from h3render.dit_swap import exchange, move_dit
from h3render.errors import RenderError
from h3render.graphs import ShapeGraphs
from h3render.models.attention import attention as fast_attention
from h3render.models.attention import select_backend, vsa_qk_int8_pays
from h3render.models.fp8 import fp8_problem, quantize_video_decoder_fp8_
from h3render.parallel.groups import ParallelContext
from h3render.parallel.plan import ParallelPlan
from h3render.render import render_job
from h3render.sampling import Schedule, dit_model_fn
from h3render.staging import PinnedFrameStager
from h3render.tasks import task_of
from h3render.tasks.base import BASE_PARTITION, Prepared
from h3render.text_graph import text_graphs
from h3render.warmup import WarmUp, heads_first

# Device bytes a partition swap leaves free beyond the incoming DiT's parameters: the activations of one forward at
# the released shape (1344 x 768 x 243, ~75k rows) with room to spare; measured by scripts/bench_ref2va.py.
SWAP_HEADROOM = 24 * 2**30


class Engine(WarmUp):
    """Holds the loaded model on this rank's device and what jobs share; `render` runs one job.

    Args:
        components: loaded models + checkpoint info (`h3render.checkpoint.Components`).
        ctx: this rank's place in the render (`h3render.parallel.groups.ParallelContext`).
        settings: the run's `h3render.settings.RunSettings` (crf, x264 preset, VAE batch, attention, compile /
            graph switches, save_latents, progress); its `precision` ("bf16" or "fp8") is `self.precision`, as
            loaded: with a deferred fusion and "fp8" the DiT is still bf16 here and `fuse_student` quantizes it.
        fasth3: the FastH3 few-step `Schedule` when a student runs (adapter fused, or a V2 checkpoint), else None.
        adapter: what the sidecar says about the student (path, sha256, positions, source), or None.
    """

    def __init__(self, components, ctx: ParallelContext, settings,
                 fasth3: Schedule | None = None, load_seconds: float = 0.0, adapter: dict[str, Any] | None = None,
                 deferred_fusion=None):
        self.c = components
        self.precision = settings.precision
        # With FP8 GEMMs on a GPU that runs the TMA fine kernel (sm_90+), the VSA layers' QKᵀ runs on int8 codes too
        # (`kernels.vsa.quant`): 13 % off that kernel at 1344x768x243 for rel. 9.7e-3 against the torch reference on
        # random inputs (2.8e-3 in bf16); the pointer kernel (sm_89, and the CPU's reference) gained nothing from it
        # on an H200, so there it stays bf16 (docs/performance.md §22.1).
        self.vsa_qk_int8 = vsa_qk_int8_pays(self.precision, ctx.device)
        self.ctx = ctx
        self.device = ctx.device
        self.settings = settings
        self.fasth3 = fasth3
        self.adapter = adapter
        # A mixed queue (t2va and fasth3 jobs): the base weights render the t2va jobs first, then the student is
        # fused in place once (`fuse_student`, on the first fasth3 job); None when fused at load or no student.
        self._deferred_fusion = deferred_fusion
        # Why that in-place fusion failed: the DiT may hold some fused parameters then, so no fasth3 job runs on it.
        self._fusion_error: BaseException | None = None
        self.student_attention = None  # `checkpoint.students.StudentAttention` of the student, set by `load`
        self.transformer: dict[str, Any] | None = None  # the --transformer file, when the DiT came from one
        self.load_seconds = load_seconds
        self.warmup: dict[str, Any] = {}
        self.texts = None  # `text_phase.TextStore` of the phased / streamed memory plans (set by `load`)
        self.streamer = None  # `block_stream.LayerStreamer` of the DiT blocks (streamed plan)
        self._tables: dict[tuple[float, ...], Any] = {}
        self.stager = PinnedFrameStager(num_buffers=8)
        self.audio_decode = ShapeGraphs(components.audio_vae.decode, name="audio VAE decode",
                                        enabled=settings.graph_audio)  # eager off CUDA
        self._audio_lengths: set[int] = set()  # audio lengths captured (the same set on every rank)
        # The t2va prompt encode, one graph per padded length (`h3render.text_graph`); None when the text phase
        # encodes (phased / streamed plans: no text encoder here).
        self.text_graphs = (text_graphs(components.text_encoder, enabled=settings.graph_text)
                            if components.text_encoder is not None else None)
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            # Measured choice among FA3 / cuDNN SDPA / SDPA; the probe is warm-up, never part of a job.
            self.warmup["attention_backend"] = select_backend(settings.attention)
            self.c.dit.set_attention(fast_attention, refiner=True)
            self.c.video_vae.set_attention(heads_first(fast_attention))  # until prepare() probes the VAE's shape
        else:
            self.warmup["attention_backend"] = "sdpa (CPU)"
        # One GEMM for the VAE decoder's q/k/v (weights are loaded; the decoder never saves a state dict).
        self.c.video_vae.fuse_qkv_()
        self.c.dit.vsa_qk_int8 = self.vsa_qk_int8
        if self.precision == "fp8":
            # FP8 decoder block GEMMs (`models.fp8.quantize_video_decoder_fp8_`; DESIGN.md: VAE precision), after the
            # fusion so that q/k/v are one FP8 GEMM; the sidecar's precision_components says so.
            quantize_video_decoder_fp8_(self.c.video_vae)
        self.warmup["select_attention_s"] = time.perf_counter() - t0
        # The parallel plan is applied once, here: the DiT forward (per partition), the decode split and the audio
        # hand-over. Which DiT partitions stay resident is a memory decision, logged in the warm-up record.
        self.plan = ParallelPlan(ctx)
        self.dits = {BASE_PARTITION: self.c.dit}
        from h3render.checkpoint.lora_apply import LoraState, resolve_mode  # per-job LoRAs (issue #25)

        self.loras = LoraState(self.c.dit, self.c.dit.cfg, resolve_mode(settings.lora_mode, settings.precision))
        self._lora_files: dict[str, Any] = {}
        self._forwards = {BASE_PARTITION: self.plan.dit_forward(self.c.dit)}
        self.warmup["dit_partitions"] = {BASE_PARTITION: "resident"}
        self._active = BASE_PARTITION

    @classmethod
    def load(cls, run, ctx: ParallelContext, *, base_jobs_first: bool = False, jobs=None) -> "Engine":
        """Load `run.checkpoint` (a path, or "tiny"/"small" for a built-in random model) onto this rank's device,
        in `run.dtype` activations.

        With `run.adapter` (a file, a variant folder, or a LoRA bundle root with `run.adapter_variant` naming the
        variant), the FastH3 student adapter is fused into the DiT weights while they stream to the device (before
        any sharding), and the engine runs the student's fixed few-step schedule (`mode: fasth3` jobs). A full
        FastH3 checkpoint (`fastvideo_inference.json`) is its own student. A VSA student (adapter gates, or a
        contract naming VIDEO_SPARSE_ATTN_H3) gets `DiT.enable_vsa` before its weights stream; its gates must
        reach every block, non-zero (`checkpoint.students`). `run.fasth3_positions` ("release" /
        "fastvideo-example") replaces the student's own positions. With `base_jobs_first` too (a queue holding t2va
        jobs as well), the base weights load unfused (dense), the t2va jobs run first, and the student is fused in
        place once, on the first fasth3 job (`fuse_student`). `run.transformer` is a single-file DiT (ComfyUI
        layout) used in place of the checkpoint's own transformer.

        `run.precision == "fp8"` (issue #18; `checkpoint.load_components`): the DiT block linears run FP8 GEMMs and
        the text encoder holds FP8 weights; `run.dtype` must be "bf16" and a CUDA device of compute capability
        >= 8.9 (`models.fp8.fp8_problem`). With `base_jobs_first` and an adapter the DiT loads in bf16 instead
        (fusion in place needs its bf16 parameters): the base jobs run a bf16 DiT (announced on stderr) and
        `fuse_student` quantizes the DiT right after fusing, so the fasth3 jobs run FP8.

        `run.memory_plan` (`h3render.memplan`, chosen before the load): "phased" and "streamed" first run the
        text phase on `jobs` (`text_phase.run_text_phase`: the text encoder alone, every job's text into host
        memory, the encoder freed), then load the rest without it; "streamed" also keeps the DiT blocks in host
        memory and streams them (`block_stream`) and brings the video VAE onto the device for decodes only
        (`vae_on_device`). With --max-gpu-memory on CUDA the allocator is capped there
        (`torch.cuda.set_per_process_memory_fraction`).

        Raises:
            CheckpointError, AdapterError, ValueError: unreadable or mismatched checkpoint / adapter / contract,
                missing or zero VSA gates, a bundle root without a variant (naming file, field and blocks); a
                precision that cannot run here (`models.fp8.fp8_problem`).
        """
        problem = fp8_problem(run.dtype, [ctx.device]) if run.precision == "fp8" else None
        if problem is not None:
            raise ValueError(problem)
        checkpoint, adapter, transformer_file = run.checkpoint, run.adapter, run.transformer
        precision, dtype = run.precision, run.torch_dtype
        from h3render.checkpoint import students
        from h3render.checkpoint.info import read_checkpoint_info
        from h3render.checkpoint.load import PARTS, load_components

        t0 = time.perf_counter()
        memory = getattr(run, "memory_plan", "auto")
        memory = memory if memory in ("phased", "streamed") else "resident"  # "auto" unresolved: as before #27
        allocator = fit_allocator(ctx.device, memory, capped=bool(getattr(run, "max_gpu_memory", None)))
        if ctx.device.type == "cuda" and getattr(run, "max_gpu_memory", None):
            total = torch.cuda.get_device_properties(ctx.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, run.max_gpu_memory * 1e9 / total), ctx.device)
        texts = text_record = None
        if memory in ("phased", "streamed"):
            from h3render.text_phase import run_text_phase

            texts, text_record = run_text_phase(run, ctx.device, list(jobs or []), streamed=memory == "streamed")
        home = torch.device("cpu") if memory == "streamed" else ctx.device  # streamed: `block_stream.stream_parts`
        info = read_checkpoint_info(checkpoint)
        plan = students.plan_student(checkpoint, info, adapter, variant=run.adapter_variant, sparsity=run.vsa_sparsity,
                                     positions=run.fasth3_positions, device=ctx.device)
        if ctx.is_main:
            for warning in plan.warnings:
                print(f"h3render: warning: {warning}", file=sys.stderr)
        deferred = plan.hook if base_jobs_first and adapter is not None else None
        if deferred is not None and memory == "streamed":
            # `fuse_student` adds the adapter to the blocks' parameters in place; streamed ones are host copies.
            raise ValueError("the streamed memory plan cannot render a mixed queue (t2va jobs beside a FastH3 "
                             "adapter): render the t2va and the fasth3 jobs in two runs")
        from h3render import compile_prefetch

        if compile_prefetch.wanted(ctx.device.type, run.compile_vae, precision):
            compile_prefetch.start(ctx.device)  # beside the weights' load; `Engine.prepare` compiles the VAE blocks
        if precision == "fp8" and deferred is not None:
            # `fuse_student` adds the adapter to nn.Parameters in place, which FP8 buffers are not: the DiT loads in
            # bf16 (the other parts in fp8) and is quantized right after the fusion.
            if ctx.is_main:
                print("h3render: warning: --precision fp8 with a mixed queue: its t2va jobs run the DiT in bf16 "
                      "(the FastH3 student is fused into bf16 weights, then quantized for the fasth3 jobs)",
                      file=sys.stderr)
            dit = load_components(checkpoint, home, dtype, parts=("dit",),
                                       transformer_file=transformer_file).dit
            rest = tuple(p for p in PARTS if p != "dit" and not (texts is not None and p == "text_encoder"))
            components = load_components(checkpoint, home, dtype, parts=rest, precision=precision)
            components.dit = dit
        else:
            parts = tuple(p for p in PARTS if not (texts is not None and p == "text_encoder"))
            components = load_components(checkpoint, home, dtype, transformer_file=transformer_file, parts=parts,
                                              tensor_hook=None if deferred else plan.hook, precision=precision)
        engine = cls(components, ctx, run, fasth3=plan.schedule, adapter=plan.sidecar, deferred_fusion=deferred)
        engine.use_memory_plan(memory, texts, text_record)
        if allocator is not None:
            engine.warmup["allocator"] = allocator
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        engine.load_seconds = time.perf_counter() - t0
        engine.student_attention = plan.attention
        if transformer_file is not None:
            # The DiT came from this file, not from the checkpoint folder: the sidecar says so.
            stat = Path(transformer_file).stat()
            engine.transformer = {"path": str(Path(transformer_file).resolve()), "bytes": stat.st_size,
                                  "mtime": stat.st_mtime}
        return engine

    def use_memory_plan(self, plan: str, texts=None, text_record: dict[str, Any] | None = None) -> None:
        """Run `plan` ("resident", "phased", "streamed"; `h3render.memplan`) from now on: `texts` is the text
        phase's `text_phase.TextStore` (phased, streamed: the text encoder is not loaded), and "streamed" places the
        loaded parts (`block_stream.stream_parts`). Recorded in the warm-up (`memory_plan`, `text_phase`,
        `dit_streaming`)."""
        self.texts = texts
        if plan == "streamed":
            from h3render.block_stream import stream_parts

            self.streamer = stream_parts(self.c, self.device)
        else:
            self.streamer = None
        self.warmup["memory_plan"] = plan
        if text_record is not None:
            self.warmup["text_phase"] = text_record
        if self.streamer is not None:
            self.warmup["dit_streaming"] = self.streamer.record()

    # -- one job ------------------------------------------------------------------------------------------------

    def render_async(self, job, mp4_path: Path | str, sidecar_path: Path | str) -> Future:
        """Render `job`; returns once the last frame is handed to the MP4 writer. The writer's tail (encoder flush,
        trailer, fsync, rename, sidecar) runs on the writer's thread meanwhile, so the next job's prompt encode and
        denoise start on the device at once: the Future resolves to the sidecar dict (rank 0; {} elsewhere) when
        both files are in place, or raises what went wrong (MediaError, OSError).

        Raises:
            RenderError: non-finite latents, frames or audio; a job this checkpoint cannot run.
            MediaError: the MP4 could not be written (before the tail).
        """
        return render_job(self, job, Path(mp4_path), Path(sidecar_path))

    def render(self, job, mp4_path: Path | str, sidecar_path: Path | str) -> dict[str, Any]:
        """`render_async(...)` waited for: the sidecar dict (rank 0) or {} (other ranks), both files written."""
        return self.render_async(job, mp4_path, sidecar_path).result()

    # -- what jobs share -------------------------------------------------------------------------------------------

    def lora_entries(self, job) -> list:
        """The job's LoRAs as (`checkpoint.lora.LoraFile`, strength), read once per file; a turbo preset's alpha
        (`checkpoint.lora_schedule.PRESETS`) or the file's ``h3render_schedule`` alpha sets its scale."""
        from h3render.checkpoint.lora import read_lora, with_alpha
        from h3render.checkpoint.lora_schedule import PRESETS, metadata_schedule

        entries = []
        for ref in job.loras:
            key = f"{ref.path}|{ref.schedule}"
            if key not in self._lora_files:
                lora = read_lora(ref.path)
                stated = metadata_schedule(lora.metadata, str(lora.path))
                alpha = PRESETS[ref.schedule].alpha if ref.schedule else stated[1] if stated else None
                self._lora_files[key] = with_alpha(lora, alpha) if alpha is not None else lora
            entries.append((self._lora_files[key], ref.strength))
        return entries

    def use_loras(self, job) -> None:
        """Hold the job's LoRA set on the DiT (`checkpoint.lora_apply.LoraState.switch`: nothing to do when the
        previous job had the same set); the time of a switch goes to `warmup["lora_switch_s"]` (last switch)."""
        if self.loras.switch(self.lora_entries(job)):
            self.warmup["lora_switch_s"] = self.loras.seconds
            self.warmup["lora_switches"] = self.loras.switches
            # Tables of other AdaLN-changing sets go (≈ 0.5 GB per 49-step schedule at release); the base's stay.
            for key in [k for k in self._tables if k[0] not in ((), self.loras.tables_key)]:
                del self._tables[key]

    def lora_record(self, job) -> list[dict[str, Any]]:
        """The sidecar's `extra.loras` for `job`: per LoRA file, sha256, strength, format, modules touched, mode."""
        return self.loras.record(self.lora_entries(job))

    def lora_schedule(self, job) -> Schedule | None:
        """The turbo schedule the job's LoRAs bring (an entry's named preset, else a file's ``h3render_schedule``
        metadata), or None. Two different ones in one set are an error.

        Raises:
            RenderError: two LoRAs of the job state different schedules.
        """
        from h3render.checkpoint.lora_schedule import PRESETS, metadata_schedule

        found = []
        for ref, (lora, strength) in zip(job.loras, self.lora_entries(job)):
            if strength == 0:
                continue
            if ref.schedule is not None:
                found.append(PRESETS[ref.schedule].schedule(ref.schedule))
            else:
                stated = metadata_schedule(lora.metadata, str(lora.path))
                if stated is not None:
                    found.append(stated[0])
        if len({tuple(s.video.tolist()) + tuple(s.audio.tolist()) for s in found}) > 1:
            raise RenderError(f"job {job.output!r}: its LoRAs bring different turbo schedules "
                              f"({', '.join(s.source for s in found)})")
        return found[0] if found else None

    def schedule(self, job) -> Schedule:
        """Sigma lists for a job: the FastH3 student's fixed few-step schedule, or the base linspace+shift grid.

        A fasth3 job of a mixed queue fuses the student first (once).

        Raises:
            RenderError: a task the FastH3 students cannot render (they are t2va-only) on a student; fasth3 without
                a student.
        """
        info = self.c.info
        task = task_of(job)
        # Until a mixed queue's deferred fusion runs the DiT holds the base weights: fl2va and ref2va jobs (mode t2va)
        # render on them, as t2va jobs do (a trial: such a queue failed whole after loading).
        student_fused = self.fasth3 is not None and self._deferred_fusion is None
        if not task.FEW_STEP and (job.mode == "fasth3" or student_fused):
            raise RenderError(f"job {job.output!r} is {task.NAME}: FastH3 students are t2va-only; render it on the "
                              "base checkpoint without --adapter")
        if job.mode == "fasth3":
            if self.fasth3 is None:
                raise RenderError("mode fasth3 needs a FastH3 adapter (--adapter PATH, or `adapter` in the manifest's "
                                  "defaults)")
            if self._deferred_fusion is not None:
                # The student fuses into the base weights: the job's LoRAs come off first (fused ones would be
                # restored over the student later; side-path hooks sit on linears fp8 replaces), then go back on.
                self.loras.reset_base()  # the base changes under the copies
                self.fuse_student()
                self.use_loras(job)
            if self._fusion_error is not None:
                first = (str(self._fusion_error).strip().splitlines() or [""])[0]
                raise RenderError(f"the FastH3 student could not be fused (an earlier fasth3 job failed on it; the "
                                  f"DiT is partly fused): {type(self._fusion_error).__name__}: {first}")
            return self.fasth3
        turbo = self.lora_schedule(job) if job.loras else None
        if turbo is not None:
            return turbo
        if self.fasth3 is not None and self._deferred_fusion is None:
            raise RenderError("this engine runs a FastH3 student (adapter fused, or a V2 checkpoint); base-model "
                              "(t2va) jobs must run before the student is fused (the batch queue orders them so)")
        return Schedule.base(job.steps or info.release.sigma_points, info.video_shift, info.audio_shift)

    @torch.no_grad()
    def fuse_student(self) -> None:
        """Fuse the deferred FastH3 adapter into the resident DiT weights in place (AdaLN projections held in host
        memory included), once; the cached AdaLN tables are of the base weights and go. A VSA student first gets
        `DiT.enable_vsa` (zero gates on the device, which the adapter's `.set_weight` then fills; the same gate
        checks as at load). An fp8 engine then quantizes the fused block linears (`models.fp8.quantize_dit_fp8_`,
        one at a time), so the fasth3 jobs run FP8 GEMMs.

        Raises:
            AdapterError: a gate missing or zero in some blocks (named)."""
        fusion, self._deferred_fusion = self._deferred_fusion, None
        t0 = time.perf_counter()
        try:
            prepare = getattr(fusion, "prepare", None)
            if prepare is not None:
                prepare(self.c.dit)
            for name, param in self.c.dit.named_parameters():
                fused = fusion(name, param.data)
                if fused is not param.data:
                    param.data.copy_(fused)
            fusion.finish()
        except BaseException as exc:
            # Parameters before the failing one are fused already: later fasth3 jobs must not render this DiT
            # (they did, "succeeded", on a half-fused student).
            self._fusion_error = exc
            raise
        if self.precision == "fp8":
            from h3render.models.fp8 import quantize_dit_fp8_

            quantize_dit_fp8_(self.c.dit)
        self._tables.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the bf16 block weights are freed
        self.warmup["fasth3_fusion_s"] = time.perf_counter() - t0

    def tables(self, schedule: Schedule, timesteps: torch.Tensor | None = None, partition: str = BASE_PARTITION):
        """AdaLN modulation tables for every timestep a job visits, built once on the device (or read back from the
        on-disk cache of an earlier run, `h3render.adaln_cache`) and cached in memory.

        Args:
            schedule: the job's `Schedule`.
            timesteps: `[K]` float32, what the job's task says its forwards see (`task.timesteps(schedule)`: fl2va
                adds its condition rows' timesteps); default the schedule's own (`Schedule.timesteps`).
            partition: whose DiT's AdaLN weights (`dit_of`): the tables are per partition.
        """
        timesteps = schedule.timesteps if timesteps is None else timesteps
        key = (partition, self.loras.tables_key, *timesteps.tolist())  # a LoRA may change the AdaLN projections
        if key not in self._tables:
            from h3render.adaln_cache import cached_tables, checkpoint_identity

            # On disk across runs (`h3render.adaln_cache`): the fused adapter is part of the key once it is fused.
            identity = checkpoint_identity(self.c.info, (self.transformer or {}).get("path"))
            identity["partition"], identity["loras"] = partition, repr(self.loras.tables_key)
            fused = self.adapter is not None and self._deferred_fusion is None
            identity["adapter"] = self.adapter.get("sha256", self.adapter.get("contract")) if fused else None
            self._tables[key], record = cached_tables(self.dit_of(partition), timesteps, self.device, identity)
            self.warmup.setdefault("adaln_cache", []).append(record)
        return self._tables[key]

    def model_fn(self, prepared: Prepared, tables):
        """`sampling.denoise`'s model_fn for one job: the forward of the DiT of `prepared.partition` under the
        parallel plan (the diffusers oracle chain test drives the same `sampling.dit_model_fn`), with the task's
        fixed condition rows `[Nc, 96]` when it has any.

        Raises:
            CheckpointError: the checkpoint has no such partition (`dit_of`).
        """
        dit = self.dit_of(prepared.partition)
        return dit_model_fn(self._forwards[prepared.partition], prepared.text, prepared.layout, tables,
                            dit.rope_tables(prepared.layout.positions), condition_rows=prepared.condition_rows,
                            audio_condition_rows=prepared.audio_condition_rows)

    def dit_of(self, partition: str):
        """The DiT of a checkpoint partition on this engine's device, loaded on first use (once per engine: a mixed
        queue's t2va, fl2va and ref2va jobs share the base DiT and the ref2va jobs share `transformer_ref`).

        On CUDA, a DiT that does not fit beside the active one (free memory below its parameter bytes plus
        `SWAP_HEADROOM` for activations) sends the active one to pinned host memory first, trading places with it
        tensor by tensor when it waits there (`dit_swap.exchange`); the swap's seconds are appended to
        `warmup["partition_swaps"]`. Off CUDA every partition stays resident.

        Raises:
            CheckpointError: the checkpoint has no such partition (`checkpoint.load.load_partition_dit`).
        """
        if partition == self._active and partition in self.dits:
            return self.dits[partition]
        t0 = time.perf_counter()
        loading = partition not in self.dits
        waiting = not loading and self.warmup["dit_partitions"].get(partition) == "host"
        if self.device.type == "cuda":
            need = sum(p.numel() * p.element_size() for p in self.c.dit.parameters()) + SWAP_HEADROOM
            active = self.dits[self._active]
            if torch.cuda.mem_get_info(self.device)[0] < need:
                if waiting:  # the two trade places through the same host buffers (never two DiTs on the host)
                    exchange(active, self.dits[partition])
                    waiting = False
                else:
                    move_dit(active, "cpu", pin=True)  # the inactive partition waits in host memory
                torch.cuda.empty_cache()
                self.warmup["dit_partitions"][self._active] = "host"
        if loading:
            from h3render.checkpoint.load import load_partition_dit

            self.hold_partition(partition, load_partition_dit(self.c.info, partition, self.device,
                                                              self.settings.torch_dtype, precision=self.precision))
            self.warmup[f"{partition}_load_s"] = time.perf_counter() - t0
        elif waiting:
            move_dit(self.dits[partition], self.device)
        self.warmup["dit_partitions"][partition] = "resident"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if not loading:
                self.warmup.setdefault("partition_swaps", []).append(
                    {"to": partition, "seconds": time.perf_counter() - t0})
        self._active = partition
        return self.dits[partition]

    def hold_partition(self, partition: str, dit, resident: bool = True) -> None:
        """Hold `dit` (already on this device) as the DiT of `partition`, with the parallel plan's forward; on CUDA
        its attention is the engine's and its AdaLN projections go to host memory (read only by
        `modulation_tables`, which brings each block's over; a loaded DiT has them there already).
        `resident=False` sends it to host memory at once (`dit_of` brings it back when a job needs it). `dit_of`
        loads through here; scripts/bench_ref2va.py hands it a random released-size DiT."""
        if self.device.type == "cuda":
            dit.set_attention(fast_attention, refiner=True)
            dit.offload_adaln_("cpu")
        dit.vsa_qk_int8 = self.vsa_qk_int8
        self.dits[partition], self._forwards[partition] = dit, self.plan.dit_forward(dit)
        self.warmup["dit_partitions"][partition] = "resident"
        if not resident and partition != self._active:
            move_dit(dit, "cpu", pin=self.device.type == "cuda")
            self.warmup["dit_partitions"][partition] = "host"

    def ensure_vision(self, timer=None) -> None:
        """Load the conditioner's vision tower and keyframe image processor (fl2va) if not yet loaded: in `prepare`
        for a queue with fl2va jobs, else by the first fl2va job (timed as its warm-up `vision_load`).

        Raises:
            CheckpointError: the checkpoint has no vision tower config or no processor config.
        """
        from h3render.text_phase import ensure_vision

        ensure_vision(self, timer)

    def encoded_text(self, job, timer):
        """The job's text conditioning (`tasks.base.Encoded`, states on this device), timed as stage `text_encode`:
        from the text phase's store in the phased / streamed plans, else encoded now by the job's task.

        Raises:
            RenderError: its prompt failed to encode in the text phase (that job fails alone).
            ValueError: the task's own encode errors (an empty prompt).
        """
        task = task_of(job)
        with timer.stage("text_encode"):
            if self.texts is not None:
                return self.texts.get(task.text_key(job), self.device)
            return task.encode_text(self, job)

    @contextmanager
    def vae_on_device(self):
        """The video VAE on the device for the block inside: the streamed plan keeps it in host memory between
        decodes (5.6 GB at release); in the other plans it is always there and this does nothing."""
        vae = self.c.video_vae
        if self.streamer is None or self.device.type != "cuda":
            yield
            return
        vae.to(self.device)
        try:
            yield
        finally:
            vae.to("cpu")
            torch.cuda.empty_cache()

    def decode_audio(self, latent: torch.Tensor, timer) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Audio latent `[2, 32, Ta]` -> (waveform `[2, Ta * 800]` float32 on the rank that decodes audio, else None;
        the warm-up this job paid for).

        A length `prepare` did not see is captured here first (once; later jobs of that length replay it), timed
        apart from `vae_audio` as warm-up and reported in the sidecar's `extra.job_warmup`.
        """
        job_warmup: dict[str, Any] = {}
        length = latent.shape[-1]
        decodes = self.plan.decodes_audio
        if self.audio_decode.graphs_on(self.device) and length not in self._audio_lengths:
            self._audio_lengths.add(length)
            seconds = None
            if decodes:
                with timer.warmup("audio_graph_capture"):
                    seconds = self.audio_decode.capture(latent)
            job_warmup["audio_graph_capture"] = {"latents": length, "rank": self.plan.audio_rank,
                                                 "seconds": seconds, "failure": self.audio_decode.failure}
        waveform = None
        if decodes:
            with timer.stage("vae_audio"):
                waveform = self.audio_decode(latent)
        return waveform, job_warmup


def fit_allocator(device: torch.device, plan: str, capped: bool) -> str | None:
    """Under a memory cap or in the phased / streamed plans on CUDA: the caching allocator grows expandable segments
    instead of fixed ones, unless PYTORCH_CUDA_ALLOC_CONF is set (the user's choice stands). The streamed fp8 render
    of the 10.125 s 1344x768 clip at a 22 GB cap ran out of memory with 20.4 GiB in use but about 10 GB live (the
    rest reserved in segments too cut up for a 1 GB block); with expandable segments it peaked at 15.84 GB
    (docs/performance.md §18.3). The uncapped resident plan is left as measured everywhere else. Returns what was
    set (for the warm-up record), or None."""
    if device.type != "cuda" or not (capped or plan in ("phased", "streamed")):
        return None
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return None
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # a torch without the runtime switch: fixed segments, as before
        return None
    return "expandable_segments"
