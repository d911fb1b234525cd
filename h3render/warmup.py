"""The engine's warm-up (`Engine.prepare`, a mixin of `h3render.engine.Engine`): before the queue, outside job
timings, the AdaLN tables of the jobs' schedules, short DiT forwards on each task's own path, and on CUDA the VAE
decoder's attention backend and its first batch (bf16 blocks compiled), the audio decoder's activation check and
its CUDA graphs, so no first-call cost (Triton compilation, communicator set-up, tokenizer load, kernel selection)
lands in a job.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Any

import torch

from h3render import spec
from h3render.models.attention import preferred_for
from h3render.models.attention import runner as attention_runner
from h3render.packing import t2va_layout
from h3render.tasks import task_of, windows_of
from h3render.tasks.base import Prepared
from h3render.timing import StageTimer


class WarmUp:
    """`Engine`'s warm-up methods; they read the engine's state (`c`, `device`, `plan`, `settings`, `warmup`, the
    student and LoRA state) and call its `schedule`, `tables`, `model_fn` and `vae_on_device`."""

    def prepare(self, jobs: list) -> None:
        """Warm-up outside job timings, for the jobs about to run: the AdaLN tables of their schedules (on CUDA built
        block by block from the AdaLN projections in host memory, ≈13 B parameters at release, or read from the
        table cache, `h3render.adaln_cache`); one text encode and two short DiT forwards; on CUDA the VAE decoder's
        attention backend measured at its own shape, one decoder batch per canvas, its blocks compiled (where it
        pays: bf16 blocks, `VideoVAE.compile_pays`) for the jobs' tile shapes and batch sizes (`compile_vae`,
        `_vae_batches`), the audio decoder's activations checked, the audio decode's CUDA graph captured for the
        jobs' audio lengths (`graph_audio`) and the prompt encode's for their padded prompt lengths
        (`graph_text`)."""
        t0 = time.perf_counter()
        if self.adapter is not None and self.student_attention is not None:
            from h3render.checkpoint.students import budgets  # VSA's top-k at each job shape, for the sidecar

            fast = [(j.width, j.height, w.frames) for j in jobs if j.mode == "fasth3" for w in windows_of(j)[0]]
            if self.student_attention.vsa and fast:
                self.adapter["attention"].setdefault("k", {}).update(budgets(self.student_attention, fast))
        for job in jobs:
            if job.mode == "fasth3" and self._deferred_fusion is not None:
                continue  # built once the student is fused, on its first job
            if job.lora_set:
                continue  # built on the job, with its LoRAs applied (they may change the AdaLN projections)
            # every window's task (a windowed clip's first window is a plain one): no table is built mid-job
            for window in {task_of(w).NAME: w for w in windows_of(job)[0]}.values():
                schedule = self.schedule(window)
                self.tables(schedule, task_of(window).timesteps(schedule), task_of(window).PARTITION)
        if self.device.type == "cuda":
            # The loader put the projections in host memory already (`checkpoint.load._adaln_home`): a no-op then.
            # A DiT handed to the Engine on the device (scripts/bench_engine.py's) pays the copy here, once.
            self.c.dit.offload_adaln_("cpu")
            torch.cuda.empty_cache()
        self.warmup["adaln_tables_s"] = time.perf_counter() - t0
        if jobs and self.text_graphs is not None and self.text_graphs.graphs_on(self.device):
            self._capture_text_graphs(jobs)
        if jobs:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._warm_dit(jobs[0])
                self.plan.warm_up()
            self.warmup["dit_te_warmup_s"] = time.perf_counter() - t0
            firsts: dict[str, Any] = {}
            for job in jobs:
                firsts.setdefault(job.task, job)
            # Each task's own path, once, on its first job's canvas: its `prepare` encodes that job's prompt, which
            # keeps the text encoder's first-call costs (tokenizer load, kernel selection: 0.94 s against 0.04 s warm
            # for a 91-token prompt on 2xH200) out of the first job; a failure there fails that job alone.
            for job in firsts.values():
                self._warm_task(job)
        if self.device.type == "cuda" and jobs:
            with self.vae_on_device():
                self._warm_vae(jobs)
            if self.plan.decodes_audio and "audio_activations" not in self.warmup:
                self._choose_audio_activations()
        lengths = sorted({spec.audio_latents(w.frames) for j in jobs for w in windows_of(j)[0]} - self._audio_lengths)
        if self.audio_decode.graphs_on(self.device) and lengths:
            t0 = time.perf_counter()
            for length in lengths:
                self._audio_lengths.add(length)
                if self.plan.decodes_audio:
                    self.audio_decode.capture(self._audio_probe(length))
            self.warmup["audio_graph_capture_s"] = self.warmup.get("audio_graph_capture_s", 0.0) + (
                time.perf_counter() - t0)
            self.warmup["audio_graph_latents"] = sorted(self._audio_lengths)
            if self.audio_decode.failure is not None:
                self.warmup["audio_graph_failure"] = self.audio_decode.failure  # decoding eagerly instead

    def _capture_text_graphs(self, jobs: list) -> None:
        """The t2va prompt encode's CUDA graphs for the padded lengths of the jobs that encode a prompt alone (t2va
        and keyframe-less windows; `h3render.text_graph`), recorded as `text_graph_tokens` (every length captured so
        far) and `text_graph_capture_s`."""
        from h3render.text_graph import capture_prompts

        t0 = time.perf_counter()
        prompts = [j.prompt for j in jobs if not j.keyframes and not j.references]
        capture_prompts(self.text_graphs, self.c.text_encoder, prompts)
        self.warmup["text_graph_capture_s"] = self.warmup.get("text_graph_capture_s", 0.0) + (
            time.perf_counter() - t0)
        self.warmup["text_graph_tokens"] = sorted(c["shape"][-1] for c in self.text_graphs.captures)
        if self.text_graphs.failure is not None:
            self.warmup["text_graph_failure"] = self.text_graphs.failure  # encoding eagerly instead

    @torch.no_grad()
    def _warm_vae(self, jobs: list) -> None:
        vae = self.c.video_vae
        if self.settings.attention in (None, "auto"):
            # The decoder's attention (short sequences, head dim 64) gets its own check of the preferred backend.
            job = jobs[0]
            plan = vae.plan_decode(vae.config.geometry.window_latents, job.height // vae.config.spatial_ratio,
                                   job.width // vae.config.spatial_ratio)
            name, probe = preferred_for(vae.attention_shape(plan, self.settings.vae_batch))
            vae.set_attention(heads_first(attention_runner(name)))
            self.warmup["vae_attention_backend"] = name
            self.warmup["vae_attention_probe_rel_err"] = probe
        t0 = time.perf_counter()
        compiled = self.settings.compile_vae and vae.compile_pays  # FP8 blocks: eager is faster (`compile_pays`)
        if compiled and not getattr(vae, "pad_batches", False):
            from h3render import compile_prefetch

            t_wait = time.perf_counter()
            problem = compile_prefetch.wait()  # the compile stack's import, begun beside the load
            self.warmup["compile_import_wait_s"] = time.perf_counter() - t_wait
            if problem is not None:
                self.warmup["compile_import_problem"] = problem
                if self.ctx.is_main:
                    print(f"h3render: warning: {problem}; compiling the VAE imports it again", file=sys.stderr)
            vae.compile_blocks_(dynamic=False)
        for width, height, batch in sorted(self._vae_batches(jobs)):
            # one decoder batch of one window of the canvas: every item of a plan shares one tile shape
            ratio = vae.config.spatial_ratio  # pixels per latent (16 at release)
            plan = vae.plan_decode(vae.config.geometry.window_latents, height // ratio, width // ratio)
            z = torch.zeros(vae.config.latent_channels, plan.latent_frames, plan.latent_height, plan.latent_width,
                            device=self.device)
            vae.decode_items(z, plan.items[:batch], batch)
        torch.cuda.synchronize(self.device)
        self.warmup["vae_compile_s" if compiled else "vae_warmup_s"] = time.perf_counter() - t0

    def _vae_batches(self, jobs: list) -> set[tuple[int, int, int]]:
        """(width, height, items per decoder forward) of every window the jobs decode: a compiled decoder
        specializes on the batch size and `VideoVAE.batch_for` picks it from this rank's item count."""
        from h3render.parallel.vae import items_on_rank

        vae, ratio, out = self.c.video_vae, self.c.video_vae.config.spatial_ratio, set()
        for job in jobs:
            for window in windows_of(job)[0]:
                plan = vae.plan_decode(spec.latent_frames(window.frames), job.height // ratio, job.width // ratio)
                mine = items_on_rank(plan, self.ctx.rank, self.ctx.world_size)
                if mine:  # (a rank with no tile of this canvas decodes nothing)
                    out.add((job.width, job.height, vae.batch_for(mine, self.settings.vae_batch)))
        return out

    @torch.no_grad()
    def _choose_audio_activations(self, probe_latents: int = spec.AUDIO_LATENTS_PER_SECOND) -> None:
        """Keep the audio decoder's Triton activations (`kernels.alias_free`, the default on CUDA) only if they run
        and agree with the torch ones on a 1 s probe: relative error <= 1e-3 (float rounding gives ~1e-6 before cuDNN's
        TF32 convolutions amplify it; a wrong kernel is off by O(1)). Otherwise the decoder uses the torch path."""
        vae = self.c.audio_vae
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(spec.AUDIO_CHANNELS, vae.config.latent_channels, probe_latents, generator=g).to(self.device)
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
        return torch.zeros(spec.AUDIO_CHANNELS, self.c.audio_vae.config.latent_channels, length, device=self.device)

    @torch.no_grad()
    def _warm_task(self, job) -> None:
        """The task's own `prepare` on its `warm_job(job)` (the job's canvas, the shortest clip) and one DiT forward
        with what it prepared: the task's first-call costs (fl2va: the vision tower's load and its kernels, the
        keyframe encode) stay out of its first job. A failure here is recorded, never raised: the job it comes from
        then fails alone, in the queue, with its own message."""
        task = task_of(job)
        t0 = time.perf_counter()
        warm = task.warm_job(job)
        if warm.mode == "fasth3" and self._deferred_fusion is not None:
            warm = replace(warm, mode="t2va", steps=2)  # the student is not fused yet: a base schedule
        try:
            prepared = task.prepare(self, warm, StageTimer(self.device))
            schedule = self.schedule(warm)
            tables = self.tables(schedule, task.timesteps(schedule), prepared.partition)
            t = tables.timesteps[0]
            self.model_fn(prepared, tables)(prepared.video_rows, prepared.audio_rows, t, t)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            self.warmup[f"{task.NAME}_warmup_failed"] = f"{type(exc).__name__}: {exc}"[:300]
        self.warmup[f"{task.NAME}_warmup_s"] = time.perf_counter() - t0

    def _warm_dit(self, job) -> None:
        """Two short DiT forwards on the job's code path (sharded on several ranks), so the first denoising step of
        the first job pays no Triton compilation, attention set-up or communicator creation (measured on 2xH200:
        the first step took 0.8 s longer than the next ones without this).

        Triton specializes integer arguments on divisibility by 16; one forward with a rank's row count divisible
        by 16 and one with it not divisible compile both variants whatever the job's length.
        """
        dit, dev = self.c.dit, self.device
        if job.mode == "fasth3" and self._deferred_fusion is not None:
            job = replace(job, mode="t2va", steps=2)  # the student is not fused yet: warm up on a base schedule
        tables = self.tables(self.schedule(job))
        frames = spec.FRAMES_REMAINDER  # the shortest clip (17n + 5 frames): one forward is milliseconds at any canvas
        base = t2va_layout(1, job.height, job.width, frames).seq_len - 1  # rows besides the text
        world = self.ctx.world_size
        for remainder in (0, 7):
            text_len = next(n for n in range(1, 16 * world + 2) if -(-(base + n) // world) % 16 == remainder)
            layout = t2va_layout(text_len, job.height, job.width, frames).to(dev)
            text = torch.zeros(text_len, dit.cfg.text_dim, dtype=dit.dtype, device=dev)
            video = torch.zeros(layout.video_index.numel(), dit.cfg.video_patch_dim, device=dev)
            audio = torch.zeros(layout.audio_index.numel(), dit.cfg.audio_in_channels, device=dev)
            prepared = Prepared(text=text, layout=layout, output_layout=layout, video_rows=video, audio_rows=audio)
            self.model_fn(prepared, tables)(video, audio, tables.timesteps[0], tables.timesteps[0])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def heads_first(fn):
    """Adapt a `[B, S, H, D]` attention to the VAE decoder's `[B, H, S, D]` convention."""

    def attention(q, k, v):
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return attention
