"""The run-wide settings: one frozen `RunSettings`, resolved once (command line > manifest defaults > default),
checked once (`RunSettings.check`), recorded once (`RunSettings.record`: the resume key and the sidecar's settings).

A `Job` (h3render.jobs) is what one render does; `RunSettings` is what the whole run shares: the checkpoint and the
weights loaded from it (transformer file, FastH3 adapter, precision, dtype), where it runs (device, GPUs, attention
backend) and how frames are written (x264 CRF and preset, VAE batch). The engine holds one (`engine.settings`).

Torch-free at import (`python -c 'import h3render.settings'` loads no torch): the functions that need device facts
or checkpoint headers import torch and `h3render.checkpoint` when called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from h3render.exits import UsageError
from h3render.jobs import check_x264_preset
from h3render.manifest import DEFAULT_PRECISION
from h3render.spec import X264_CRF, check_precision, ran_precision

DTYPES = ("bf16", "fp32")  # --dtype: the activations' (block stack's) dtype
DEVICES = ("cuda", "cpu")
FASTH3_MODE = "fasth3"
CHECKPOINT_ENV = "H3RENDER_CHECKPOINT"
TINY_NOTICE = (f"h3render: no checkpoint given (--checkpoint / {CHECKPOINT_ENV}): using the built-in tiny model "
               "with random weights, which renders noise")


# The fields `RunSettings.check_options` checks, by their option names (click's, with _ for -).
OPTION_FIELDS = ("crf", "vae_batch", "gpus", "max_gpu_memory", "dtype", "device", "x264_preset", "adapter",
                 "transformer")


class SettingsError(UsageError):
    """A run setting that cannot work (bad option, missing file, precision this machine cannot run): one line,
    exit 2, found before any weights load."""


@dataclass(frozen=True)
class RunSettings:
    """Everything a run shares, resolved and fixed for its life (an `Engine` holds one as `engine.settings`).

    Attributes:
        checkpoint: checkpoint folder (official or diffusers layout) as given, or "tiny"/"small" (built-in random).
        checkpoint_path, config_hash: the checkpoint as recorded (`CheckpointInfo.recorded_path`: absolute) and
            its config hash; None when not resolved from a checkpoint (then `record` uses `checkpoint`).
        transformer: single-file DiT (.safetensors, ComfyUI layout) replacing the checkpoint's, or None.
        adapter, adapter_variant: the FastH3 student adapter (file, variant folder or LoRA bundle root) and the
            bundle's variant; None for none.
        fasth3_positions: "release" / "fastvideo-example" replaces the student's own pre-shift positions; None: its own.
        precision: "bf16" or "fp8" (`spec.PRECISIONS`).
        dtype: activations, "bf16" or "fp32" (default: bf16 on CUDA or with fp8, else fp32).
        device: "cuda" or "cpu"; gpus: ranks asked for (None: every visible GPU; on CPU one process).
        attention: "fa3", "cudnn", "sdpa", or None to choose by measurement (CUDA only).
        crf, x264_preset: H.264 quality (x264 CRF 1..51: `spec.X264_CRF`) and speed preset.
        vae_batch: video VAE decode work items (window x tile) per decoder forward, at most (`VideoVAE.batch_for`).
        compile_vae: on CUDA, `torch.compile` the video VAE decoder blocks where it pays (`VideoVAE.compile_pays`:
            bf16 blocks, 1x H200: 8.5 s -> 7.1 s for 72 latent frames at 1344x768; FP8 blocks run their fused
            kernels eagerly, 1.4-1.9 % faster than compiled); compiled in `Engine.prepare`, outside job timings.
        graph_audio: on CUDA, replay the audio VAE decode from a CUDA graph captured per audio length (in
            `Engine.prepare` for the jobs' lengths; a new length is captured by the first job that has it, which
            records it in the sidecar's `extra.job_warmup`). Same output bit for bit as the eager decode
            (h3render/graphs.py).
        graph_text: on CUDA, replay the t2va prompt encode from a CUDA graph captured per padded prompt length
            (`h3render.text_graph`: in `Engine.prepare` for the jobs' prompts; a new length is captured by the
            first job that has it). The padding is the same with or without the graph.
        save_latents: also write the final latents (`<name>.latents.pt`: video `[24, T, h, w]`, audio
            `[2, 32, Ta]`, float32) beside the MP4, for comparing runs (e.g. 1 vs N GPUs).
        memory_plan: "auto" (chosen from the GPU's memory, `h3render.memplan`), "resident", "phased" or
            "streamed"; after `memplan.plan_run` the plan that runs.
        max_gpu_memory: --max-gpu-memory, GB (1e9 bytes) of device memory the plan must fit (CUDA: the allocator
            is capped there too); None: the device's own size.
        precision_given: --precision was given, or a manifest's defaults set fp8 (the chooser keeps it; else it
            may pick fp8 when bf16 does not fit; a manifest stating bf16 is not told apart from the default).
        memory: the chosen plan's record for the sidecar's `run.memory` (`MemoryPlan.record`), or None.
        precision_from: where a manifest set the precision (its path), for the refusal's message; None otherwise.
        progress, step_bar_position: UI, not run settings (never recorded or compared): each job's stage
            progress, a `h3render.progress.Progress` (bars on a terminal, lines in a log), or True for tqdm bars at
            `step_bar_position` (the batch queue bar is at 0), False for none.
    """

    checkpoint: str = "tiny"
    checkpoint_path: str | None = None
    config_hash: str | None = None
    transformer: str | None = None
    adapter: str | None = None
    adapter_variant: str | None = None
    fasth3_positions: str | None = None
    precision: str = DEFAULT_PRECISION
    dtype: str | None = None
    device: str = "cpu"
    gpus: int | None = None
    attention: str | None = None
    crf: int = 18
    x264_preset: str = "veryfast"
    vae_batch: int = 8
    compile_vae: bool = True
    graph_audio: bool = True
    graph_text: bool = True
    save_latents: bool = False
    memory_plan: str = "auto"
    max_gpu_memory: float | None = None
    precision_given: bool = field(default=False, compare=False)
    memory: dict | None = field(default=None, compare=False)
    lora_mode: str = "auto"
    vsa_sparsity: float | None = None
    precision_from: str | None = field(default=None, compare=False)
    progress: Any = field(default=True, compare=False)  # bool | h3render.progress.Progress
    step_bar_position: int = field(default=1, compare=False)

    def __post_init__(self) -> None:
        if self.dtype is None:  # the rule lives here only: fp8 writes its GEMM outputs in bf16
            default = "bf16" if self.device == "cuda" or self.precision == "fp8" else "fp32"
            object.__setattr__(self, "dtype", default)

    # -- resolve ------------------------------------------------------------------------------------------------

    @classmethod
    def resolve(cls, cli: Mapping[str, Any], *, checkpoint: str, info=None, manifest=None) -> "RunSettings":
        """The run's settings: each field from the command line (`cli`, click's option names; None: not given),
        else the manifest's defaults (`manifest.Manifest`: adapter, adapter_variant, fasth3_positions,
        precision), else the default above. `checkpoint` comes from `resolve_checkpoint`; `info`
        (`checkpoint.CheckpointInfo`) gives its recorded path and config hash. The device is resolved here
        (cuda when available); the dtype by `device` and `precision`.

        Raises:
            SettingsError: --device cuda without a CUDA device.
        """
        def pick(name: str, from_manifest: Any = None) -> Any:
            value = cli.get(name)
            return value if value is not None else from_manifest

        m = manifest
        precision = pick("precision", m and m.precision) or cls.precision
        precision_from = None
        if cli.get("precision") is None and m is not None and precision != cls.precision:
            precision_from = str(m.path)  # only the defaults can set another precision than the default
        given = {name: cli[name] for name in ("gpus", "attention", "crf", "x264_preset", "vae_batch", "compile_vae",
                                              "graph_audio", "graph_text", "save_latents", "memory_plan",
                                              "max_gpu_memory", "lora_mode", "vsa_sparsity")
                 if cli.get(name) is not None}
        adapter = pick("adapter", m and m.adapter)
        return cls(checkpoint=checkpoint,
                   checkpoint_path=None if info is None else info.recorded_path,
                   config_hash=None if info is None else info.config_hash,
                   transformer=cli.get("transformer"),
                   adapter=None if adapter is None else str(adapter),
                   adapter_variant=pick("adapter_variant", m and m.adapter_variant),
                   fasth3_positions=pick("fasth3_positions", m and m.fasth3_positions),
                   precision=precision, precision_from=precision_from, dtype=cli.get("dtype"),
                   precision_given=cli.get("precision") is not None or precision_from is not None,
                   device=resolve_device(cli.get("device")), **given)

    # -- check --------------------------------------------------------------------------------------------------

    def check(self, info=None, *, mode: str | None = None, jobs: Sequence | None = None,
              world: int | None = None) -> list[str]:
        """Every check of the settings, before any weights load; returns the warnings to print (rank 0).

        Args:
            info: the checkpoint's `CheckpointInfo` (for --transformer's header check), or None to skip it.
            mode: `h3render prompt`'s job mode (None: t2va): fasth3 needs an adapter or a full FastH3 checkpoint,
                which in turn renders fasth3 only.
            jobs: a batch's `Job`s (in place of `mode`), each held to the same rule (the manifest reader refuses a
                fasth3 job without a student; a t2va job on a full FastH3 checkpoint is refused here).
            world: the ranks the run uses: fp8 is checked against each of their GPUs (compute capability); None
                checks it against the dtype only (`--dry-run`, nothing created).
        Raises:
            SettingsError: the first problem, one line: bad crf/vae_batch/x264 preset/dtype/device, fasth3
                without a student, a t2va job on a full FastH3 checkpoint, a missing adapter or one the loader
                refuses (a bundle root without its variant, an unknown variant, an unreadable header, tensors that
                do not fit the DiT: `students.read_student`; a NaN/Inf/huge value: `adapter.scan_adapter`), an
                unusable --transformer, fp8 with fp32
                activations or on a GPU older than sm_89, an attention backend this machine lacks.
        """
        self.check_options({name: getattr(self, name) for name in OPTION_FIELDS}, info)
        if self.lora_mode == "fuse" and self.precision == "fp8":
            raise SettingsError("--lora-mode fuse cannot go with --precision fp8 (the FP8 DiT keeps no bf16 weights "
                                "to fuse into); use --lora-mode side or auto")
        self._check_student(info, mode, jobs)
        problem = precision_problem(self.precision, self.dtype, self.devices(world))
        if problem:
            raise SettingsError(problem if self.precision_from is None else
                                f"{self.precision_from}: precision: {problem}")
        return self._attention_warnings()

    @staticmethod
    def check_options(values: Mapping[str, Any], info=None) -> None:
        """The checks of `check` that need no torch, on option values by field name (click's options, or a
        `RunSettings`' own; a missing or None value is not checked) and the checkpoint's configs (`info`, from the
        torch-free `checkpoint.info`; None: only that a --transformer file exists). The command line runs them
        first, so that a typo answers at once instead of after the imports the other checks need (torch,
        transformers' Qwen3-VL: ~6 s); `check` runs them again on the resolved settings (API callers).

        Raises:
            SettingsError: a bad crf, vae_batch, gpus, max_gpu_memory, dtype, device or x264 preset; an --adapter path that does not
                exist; an unusable --transformer (`check_transformer`: missing, the built-in model, a header the
                loader refuses).
        """
        crf, vae_batch, gpus = (values.get(name) for name in ("crf", "vae_batch", "gpus"))
        problem = None if crf is None else crf_problem(crf)
        if problem:
            raise SettingsError(f"--crf {problem}")
        if vae_batch is not None and vae_batch < 1:
            raise SettingsError(f"--vae-batch {vae_batch}: must be >= 1")
        if gpus is not None and gpus < 1:
            raise SettingsError(f"--gpus must be >= 1, got {gpus}")
        max_gb = values.get("max_gpu_memory")
        if max_gb is not None and not max_gb > 0:
            raise SettingsError(f"--max-gpu-memory {max_gb}: GB of device memory, must be > 0")
        dtype, device = values.get("dtype"), values.get("device")
        if dtype not in (None, *DTYPES) or device not in (None, *DEVICES):
            raise SettingsError(f"--dtype {dtype} / --device {device}: one of {DTYPES} / {DEVICES}")
        if values.get("x264_preset") is not None:
            usage(check_x264_preset, values["x264_preset"])
        if values.get("adapter") is not None and not Path(values["adapter"]).exists():
            raise SettingsError(f"--adapter {values['adapter']}: no such file or folder")
        transformer = values.get("transformer")
        if info is not None:
            check_transformer(transformer, info)
        elif transformer is not None and not Path(transformer).exists():
            raise SettingsError(f"--transformer {transformer}: no such file")

    def _check_student(self, info, mode: str | None, jobs: Sequence | None) -> None:
        """The student the load would fuse, found and read as the loader does (`students.locate_student`: listings
        and JSON; with `info`, `students.read_student`: the adapter's header against the DiT config too), against
        the jobs' modes."""
        from h3render.checkpoint.adapter import scan_adapter
        from h3render.checkpoint.students import locate_student, read_student

        contract, source = usage(locate_student, self.checkpoint, self.adapter, self.adapter_variant,
                                 self.fasth3_positions)
        parts = None
        if info is not None and (source is not None or contract is not None):
            parts = usage(lambda: read_student(self.checkpoint, info, self.adapter, variant=self.adapter_variant,
                                               positions=self.fasth3_positions))
            if parts is not None and parts.adapter is not None:
                # Every value (NaN/Inf/huge, a NaN gate), in the pass that hashes the file for the sidecar anyway.
                usage(scan_adapter, parts.adapter)
        if self.vsa_sparsity is not None and source is None and contract is None:
            raise SettingsError("--vsa-sparsity needs a VSA FastH3 student (--adapter with gates, or a VSA "
                                "checkpoint)")
        if self.vsa_sparsity is not None and parts is not None and not parts.attention.vsa:
            raise SettingsError(f"--vsa-sparsity {self.vsa_sparsity}: the student is dense "
                                f"({parts.attention.mode_source})")
        if mode == FASTH3_MODE and self.adapter is None and contract is None:
            raise SettingsError("--mode fasth3 needs --adapter PATH (the FastH3 student adapter) or a FastH3 V2 "
                                "checkpoint")
        if contract is None:
            return
        # Without this the engine loaded the student, then failed each job with "base-model jobs must run before
        # the student is fused", which is about mixed queues, not about this checkpoint.
        where = (f"--checkpoint {self.checkpoint} is a full FastH3 student ({contract.model_id}), which renders "
                 "--mode fasth3 only")
        if jobs is None:
            if mode != FASTH3_MODE:
                raise SettingsError(f"{where}: pass --mode fasth3")
            return
        t2va = [j for j in jobs if j.mode != FASTH3_MODE]
        if t2va:
            first = t2va[0]
            name = f" {first.id!r}" if first.id else ""
            raise SettingsError(f"{first.source}: mode: job{name} is t2va ({len(t2va)} of {len(jobs)} jobs), but "
                                f"{where}: pass --mode fasth3 (or `mode: fasth3` in the manifest's defaults)")

    def devices(self, world: int | None) -> list:
        """The `torch.device`s of `world` ranks on this machine (`cuda:0..world-1`, or the CPU); [] for None."""
        if world is None:
            return []
        import torch

        if self.device == "cuda":
            return [torch.device("cuda", i) for i in range(world)]
        return [torch.device(self.device)]

    def _attention_warnings(self) -> list[str]:
        """--attention: on CPU the models keep torch SDPA (a warning; the sidecar's run.attention records it); on
        CUDA a backend this machine cannot run is refused."""
        if self.attention is None:
            return []
        if self.device != "cuda":
            return [f"h3render: warning: --attention {self.attention} applies on CUDA only; on {self.device} "
                    "attention runs torch SDPA (sdpa), as the sidecar's run.attention records"]
        from h3render.models.attention import available_backends

        if self.attention not in available_backends():
            raise SettingsError(f"--attention {self.attention}: not available on this machine (available: "
                                f"{', '.join(available_backends())})")
        return []

    # -- record -------------------------------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The resume key and the settings part of the sidecar: ``{"checkpoint": {"path", "config_hash",
        "transformer", "precision"}, "encoder": {"crf", "x264_preset"}}``, which `batch.run_batch(current=)`,
        `jobs.plan_lines(current=)` and `timing.rendered_with` compare against an earlier sidecar's
        ``checkpoint`` and ``run.encoder`` / ``run.precision`` (docs/sidecar.md): its format is the on-disk one, so
        sidecars of older versions still resume.
        ``transformer`` is the --transformer file's absolute path, or None."""
        transformer = self.transformer and str(Path(self.transformer).resolve())
        return {"checkpoint": {"path": self.checkpoint_path if self.checkpoint_path is not None else self.checkpoint,
                               "config_hash": self.config_hash, "transformer": transformer,
                               "precision": self.ran_precision},
                "encoder": {"crf": self.crf, "x264_preset": self.x264_preset}}

    def summary(self) -> dict[str, Any]:
        """`--dry-run`'s first line: checkpoint (as given), precision (what runs), adapter (None values left out
        there)."""
        return {"checkpoint": self.checkpoint, "precision": self.ran_precision, "adapter": self.adapter}

    @property
    def ran_precision(self) -> str:
        """What the linears compute in (`spec.ran_precision`): "fp8", else the dtype ("fp32" on a CPU by default),
        for the dry run's line, the sidecar's `run.precision` and the resume key."""
        return ran_precision(self.precision, self.dtype)

    @property
    def torch_dtype(self):
        """`dtype` as a torch dtype (imports torch)."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


# ---------------------------------------------------------------------------------------------------------------------
# the pieces, each also usable alone


def resolve_checkpoint(given: str | None, env: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """The run's checkpoint: --checkpoint, else $H3RENDER_CHECKPOINT, else the built-in "tiny" model; with the
    notice to print when it fell back to the random tiny model (else None).

    Raises:
        SettingsError: the path does not exist, or is a single file (a DiT for --transformer, not a checkpoint).
    """
    checkpoint = given or env.get(CHECKPOINT_ENV) or None
    if checkpoint is None:
        return "tiny", TINY_NOTICE
    from h3render.checkpoint.releases import BUILTIN

    where = "" if given else f" (from ${CHECKPOINT_ENV})"  # the user may not know the variable is set
    if checkpoint not in BUILTIN and not Path(checkpoint).exists():
        raise SettingsError(f"checkpoint {checkpoint}{where} does not exist")
    if Path(checkpoint).is_file():
        raise SettingsError(f"checkpoint {checkpoint}{where} is a single file: it holds only the DiT (no text encoder, no "
                            "VAEs); pass the checkpoint folder with --checkpoint and this file with --transformer")
    return checkpoint, None


def resolve_device(device: str | None) -> str:
    """--device, else cuda when available, else cpu.

    Raises:
        SettingsError: --device cuda without a CUDA device.
    """
    if device == "cpu":
        return device  # no torch import: a dry run or a resumed queue with nothing left answers at once
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SettingsError("--device cuda: no CUDA device is available")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def checkpoint_info(checkpoint: str):
    """`checkpoint.read_checkpoint_info(checkpoint)`, its error as a one-line SettingsError."""
    from h3render.checkpoint.info import read_checkpoint_info

    return usage(read_checkpoint_info, checkpoint)


def has_v2_contract(checkpoint: str) -> bool:
    """Whether the checkpoint is a full FastH3 student (it carries its own `fastvideo_inference.json`).

    Raises:
        SettingsError: the contract file is unreadable or invalid.
    """
    from h3render.checkpoint.contract import contract_path
    from h3render.checkpoint.releases import BUILTIN

    if checkpoint in BUILTIN or contract_path(checkpoint) is None:
        return False  # found without importing torch (the students module's) for the common case
    from h3render.checkpoint.students import locate_student

    return usage(locate_student, checkpoint)[0] is not None


def prompt_mode(mode: str | None, adapter: str | None) -> tuple[str | None, str | None]:
    """`h3render prompt`'s mode and the note to print: --adapter fuses the FastH3 student, whose jobs are fasth3
    jobs, so it implies --mode fasth3 (announced); --mode t2va with --adapter asks for both models at once.

    Raises:
        SettingsError: --adapter with --mode t2va.
    """
    if adapter is None or mode == FASTH3_MODE:
        return mode, None
    if mode == "t2va":
        raise SettingsError("--adapter fuses the FastH3 student, which runs --mode fasth3 only; drop --adapter to "
                            "render with the base model, or --mode t2va to use the student")
    return FASTH3_MODE, "h3render: --adapter given: rendering with the FastH3 student (--mode fasth3)"


def check_transformer(transformer: str | None, info) -> None:
    """--transformer FILE: the loader's own check (`checkpoint.with_transformer_file`), headers only.

    Raises:
        SettingsError: the built-in model (no folder to take the text encoder and VAEs from), or a file the loader
            refuses (its message, which starts with the file).
    """
    if transformer is None:
        return
    if info.layout == "builtin":
        raise SettingsError(f"--transformer {transformer} replaces a checkpoint folder's DiT: it needs --checkpoint "
                            f"DIR (the text encoder and VAEs come from there); the built-in {info.path} model takes "
                            "none")
    from h3render.checkpoint.info import with_transformer_file

    usage(with_transformer_file, info, transformer, prefix="--transformer ")


def precision_problem(precision: str, dtype: str, devices: Iterable = ()) -> str | None:
    """Why `precision` cannot run with these activations or on these devices, or None (the one check's FP8 part;
    the rule itself is `models.fp8.fp8_problem`, which `Engine.load` applies to API callers too).

    Args:
        precision: "bf16" or "fp8" (`spec.PRECISIONS`).
        dtype: the activations' dtype, "bf16" or "fp32".
        devices: the `torch.device`s the run uses.
    Raises:
        ValueError: an unknown precision.
    """
    if check_precision(precision) != "fp8":
        return None
    from h3render.models.fp8 import fp8_problem

    return fp8_problem(dtype, devices)


def crf_problem(crf: int) -> str | None:
    """Why `crf` cannot encode our MP4s (the text after "--crf "), or None. x264 refuses CRF 0 (lossless) in the
    High profile (`spec.X264_CRF`), which showed only when the first job's writer opened, after its denoise."""
    low, high = X264_CRF
    if crf == 0:
        return (f"0 is lossless, which x264 cannot encode in the High profile the MP4s use; choose {low}..{high} "
                "(18 is visually lossless)")
    if not low <= crf <= high:
        return f"{crf}: x264's CRF is {low}..{high} for these MP4s (High profile)"
    return None


def usage(fn, *args, prefix: str = ""):
    """`fn(*args)`, where an OSError or ValueError (CheckpointError included) is bad input: a SettingsError of its
    first line (after `prefix`), exit 2."""
    try:
        return fn(*args)
    except SettingsError:
        raise
    except (OSError, ValueError) as exc:
        raise SettingsError(prefix + (str(exc).strip().splitlines() or [""])[0]) from None
