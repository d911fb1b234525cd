"""Memory plans (issue #27): which parts sit on the GPU when, chosen before anything loads from the card's memory
(`--max-gpu-memory GB`, else the device's own) and the checkpoint's config.

Plans, fastest first (each one's peak is the largest of its three phases):

==========  ===========================================================================================================
resident    every part on the device for the whole run (the engine before #27)
phased      text phase first: only the text encoder is loaded, every prompt (fl2va presentation) of the queue or shard
            is encoded and kept in host memory (`h3render.text_phase`), the encoder is freed; then the DiT and
            both VAEs (a prompt that fails to encode fails its job alone)
streamed    phased, and the DiT blocks (and in the text phase the encoder's decoder layers) live in pinned host
            memory and stream in one block ahead of use on a side stream, double-buffered (`h3render.block_stream`);
            the VAEs come onto the device for the decode only
==========  ===========================================================================================================

Each plan runs at a precision: the run's (`--precision`), or, when none was given (command line or manifest) and
the devices run FP8 GEMMs (compute capability >= 8.9; `models.fp8.fp8_problem`), fp8 when the bf16 plan does not fit:
the ladder is resident, phased, phased fp8, streamed fp8. On Ampere (sm_80/86) the fp8 rungs are refused today
(weight-only FP8 with a dequantizing GEMM for Ampere is issue #27 item 2, not built); there the ladder is resident,
phased, streamed, all bf16.

The expected peak of a phase = the bytes of the parts on the device in it (`checkpoint.sizes.part_sizes`: the
config's modules built empty, counted; the DiT without its AdaLN projections, which load into host memory on CUDA at
either precision, `checkpoint.load._adaln_home`) + that phase's activations:

* denoise: `DIT_ACT_FIXED` + packed rows x `DIT_ACT_WIDTHS` x hidden x 2 bytes / ranks. First calibrated on the four
  VSA renders of docs/performance.md §9.4 (16.1 widths, 0.13 GB). The peak is inside VSA attention; since the qkv
  projection output (3 x 7168 = 4.0 widths) is freed before attending, the 1344x768x243 VSA renders peak at
  110.56 GB bf16 / 62.18 GB fp8 resident, 60.19 phased bf16, 12.68 streamed fp8 (§20): 12.5 widths, the larger of
  the bf16 (12.5) and fp8 (12.0) fits, so the model errs toward fitting (within 0.7 % of the resident and phased
  peaks, 3.7 % above the streamed one).
* decode: `VAE_ACT_BYTES` at 1344x768 with 8 work items per decoder batch, scaled by canvas pixels and --vae-batch
  (§7.3: the decode stage peaked 2.1 GB above the 97.18 GB resident, dense and VSA alike).
* text: `TEXT_ROWS_ESTIMATE` token rows through one decoder layer (hidden + 3 x intermediate widths, bf16): tens of MB.

Torch is imported by `part_sizes` (meta tensors only); this module's top level is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from h3render import spec

PLANS = ("resident", "phased", "streamed")
CHOICES = ("auto",) + PLANS  # --memory-plan
GB = 1e9  # the unit of --max-gpu-memory, the log line and the sidecar (docs/performance.md's GB too)

DIT_ACT_WIDTHS = 12.5  # bf16 hidden-widths alive per packed row at the denoise peak (calibrated, module docstring)
DIT_ACT_FIXED = 0.13 * GB  # per-job state beside the rows (tables, rope, sampler state, VSA metadata)
VAE_ACT_BYTES = 2.1 * GB  # decode activations at 1344x768, 8 items per batch (§7.3)
VAE_ACT_CANVAS = 1344 * 768
TEXT_ROWS_ESTIMATE = 512  # prompt tokens assumed before tokenizing (the bench prompts: 256 rows)
# What the device needs beyond the allocator's tensors when its own size is the limit: CUDA context, cuBLAS/cuDNN
# workspaces, NCCL buffers, allocator fragmentation. Not applied to --max-gpu-memory, which is the allocator's cap.
DEVICE_RESERVE = 3 * GB
STREAM_SLOTS = 2  # double-buffered: the block computing and the one arriving


class PlanError(ValueError):
    """No plan fits, or the one asked for does not: one line naming the smallest plan and its expected peak."""


@dataclass(frozen=True)
class Canvas:
    """The largest job's shape the plan must hold: packed rows of the DiT and pixels of the decode."""

    width: int
    height: int
    frames: int
    text_rows: int = TEXT_ROWS_ESTIMATE

    @property
    def rows(self) -> int:
        return self.text_rows + spec.video_rows(self.width, self.height, self.frames) + spec.audio_rows(
            self.frames)

    def describe(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


@dataclass(frozen=True)
class MemoryPlan:
    """A plan at a precision with its expected peaks (bytes) per phase and why it was chosen.

    Attributes:
        name: one of `PLANS`; precision: "bf16" or "fp8" (`--precision`: "bf16" means no FP8).
        dtype: the activations' dtype, "bf16" or "fp32" (`--dtype`; fp8 plans run bf16).
        phases: expected device peak of the "text", "denoise" and "decode" phases, bytes.
        host_bytes: host memory the plan holds beyond the resident parts' own (pinned streamed layers, AdaLN).
        limit: the device memory budget in bytes (None: unknown, the CPU); limit_source: where it came from.
        reason: one sentence: why this plan (the faster ones that did not fit and their peaks).
        canvas: the shape the peaks were computed at.
    """

    name: str
    precision: str
    phases: dict[str, int]
    host_bytes: int = 0
    limit: int | None = None
    limit_source: str = "none"
    reason: str = ""
    canvas: Canvas | None = None
    dtype: str = "bf16"

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def label(self) -> str:
        """`resident fp32`, `phased bf16`, `streamed fp8`: the plan and what its weights compute in (a CPU run's
        fp32 read "resident bf16": `--precision bf16` only means no FP8)."""
        return f"{self.name} {spec.ran_precision(self.precision, self.dtype)}"

    def fits(self) -> bool:
        return self.limit is None or self.peak <= self.limit

    def describe_peak(self) -> str:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in self.phases.items())
        return f"{_gb(self.peak)} GB expected peak ({parts})"

    def log_line(self) -> str:
        """The run's one log line: `h3render: memory plan phased bf16: 63.1 GB expected peak (...) of 80.0 GB
        (--max-gpu-memory); <reason>`."""
        limit = "no device limit" if self.limit is None else f"of {_gb(self.limit)} GB ({self.limit_source})"
        return f"h3render: memory plan {self.label}: {self.describe_peak()} {limit}; {self.reason}"

    def record(self) -> dict[str, Any]:
        """The sidecar's `run.memory` (docs/sidecar.md)."""
        return {"plan": self.name, "precision": spec.ran_precision(self.precision, self.dtype),
                "expected_peak_gb": round(self.peak / GB, 2),
                "expected_phases_gb": {k: round(v / GB, 2) for k, v in self.phases.items()},
                "host_gb": round(self.host_bytes / GB, 2),
                "limit_gb": None if self.limit is None else round(self.limit / GB, 2),
                "limit_source": self.limit_source, "reason": self.reason,
                "canvas": None if self.canvas is None else self.canvas.describe()}


def largest_canvas(jobs: Sequence) -> Canvas:
    """The jobs' shape with the most packed rows (the denoise peak), as a `Canvas`: a long clip's longest window
    (`Job.pass_frames`), not its whole frame count, which is no pass's (720 for 30 s raised "frames must be 17n + 5"
    here, a traceback for the README's own long-clip command)."""
    canvases = [Canvas(j.width, j.height, j.pass_frames) for j in jobs]
    if not canvases:
        raise ValueError("no jobs to plan memory for")
    return max(canvases, key=lambda c: (c.rows, c.width * c.height))


def expected_phases(sizes: dict, name: str, canvas: Canvas, hidden: int, *, text_hidden: int,
                    text_intermediate: int, vae_batch: int = 8, ranks: int = 1, vision: int = 0) -> dict[str, int]:
    """Expected device peak (bytes) of each phase of plan `name` for `sizes` (`checkpoint.sizes.part_sizes`).

    Args:
        hidden: the DiT's hidden width; text_hidden / text_intermediate: the text encoder's.
        ranks: Ulysses ranks (each holds every weight and 1/ranks of the rows).
        vision: bytes of the fl2va vision tower when a job has keyframes (text phase only), else 0.
    """
    dit, te, vv, av = sizes["dit"], sizes["text_encoder"], sizes["video_vae"], sizes["audio_vae"]
    dit_act = int(DIT_ACT_FIXED + canvas.rows * DIT_ACT_WIDTHS * hidden * 2 / ranks)
    vae_act = int(VAE_ACT_BYTES * canvas.width * canvas.height / VAE_ACT_CANVAS * vae_batch / 8)
    te_act = TEXT_ROWS_ESTIMATE * (text_hidden + 3 * text_intermediate) * 2
    vaes = vv.resident + av.resident
    if name == "resident":
        everything = dit.resident + te.resident + vaes + vision
        return {"text": everything + te_act, "denoise": everything + dit_act, "decode": everything + vae_act}
    if name == "phased":
        return {"text": te.resident + vision + te_act, "denoise": dit.resident + vaes + dit_act,
                "decode": dit.resident + vaes + vae_act}
    if name == "streamed":
        # the audio VAE stays on the device (`block_stream.stream_parts`); the video VAE comes for decodes only
        dit_dev = dit.outside_layers + STREAM_SLOTS * dit.layer + av.resident
        return {"text": te.outside_layers + STREAM_SLOTS * te.layer + vision + te_act, "denoise": dit_dev + dit_act,
                "decode": dit_dev + vv.resident + vae_act}
    raise ValueError(f"memory plan must be one of {', '.join(PLANS)}, got {name!r}")


def host_bytes(sizes: dict, name: str) -> int:
    """Host memory a plan holds: the AdaLN projections always; streamed adds the DiT blocks (pinned) and the text
    encoder's layers during the text phase (the larger of the two at once, as the encoder is freed first)."""
    dit, te = sizes["dit"], sizes["text_encoder"]
    held = dit.host_only
    if name == "streamed":
        held += dit.layer * dit.layers + sizes["video_vae"].resident + sizes["audio_vae"].resident
    return held


@dataclass
class Ladder:
    """What the chooser considers, in order: (plan, precision) pairs and what was skipped and why."""

    rungs: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def ladder(asked: str, precision: str, *, precision_given: bool, fp8_problem: str | None) -> Ladder:
    """The (plan, precision) rungs to try, fastest first: `asked` alone (at `precision`) when it names a plan; with
    "auto", resident
    and phased at `precision`, then (bf16 not pinned by --precision or a manifest, FP8 runnable here) phased fp8,
    then streamed at fp8 when allowed, else at `precision`."""
    out = Ladder()
    fp8_ok = fp8_problem is None
    may_switch = precision == "bf16" and not precision_given
    if may_switch and not fp8_ok:
        out.skipped.append(f"fp8 plans refused here ({fp8_problem})")
    stream_precision = "fp8" if may_switch and fp8_ok else precision
    if asked != "auto":
        out.rungs = [(asked, precision)]  # a plan asked for runs at the run's precision
        return out
    out.rungs = [("resident", precision), ("phased", precision)]
    if may_switch and fp8_ok:
        out.rungs.append(("phased", "fp8"))
    out.rungs.append(("streamed", stream_precision))
    return out


def choose(release, jobs: Sequence, *, asked: str = "auto", precision: str = "bf16", precision_given: bool = False,
           limit: int | None = None, limit_source: str = "none", fp8_problem: str | None = None, vae_batch: int = 8,
           ranks: int = 1, vsa: bool = False, dtype: str = "bf16") -> MemoryPlan:
    """The first rung of `ladder` whose expected peak fits `limit` (bytes; None: no limit, the first rung).

    Args:
        release: the checkpoint's `checkpoint.releases.Release` (architectures).
        jobs: the jobs to render (their largest canvas sets the activations; an fl2va job adds the vision tower).
        asked: "auto" or a plan name (`--memory-plan`); precision: the run's.
        precision_given: --precision (or a manifest's) was given: the chooser keeps it.
        fp8_problem: why FP8 cannot run on these devices (`models.fp8.fp8_problem`), or None.
        vsa: the DiT carries a FastH3 VSA student's gates.
        dtype: the activations' dtype, "bf16" or "fp32" (`--dtype`; fp8 plans always bf16).
    Raises:
        PlanError: no rung fits; the message names the smallest plan and its expected peak.
    """
    from h3render.checkpoint.sizes import part_sizes, vision_bytes

    canvas = largest_canvas(jobs)
    text = release.text_config
    vision = vision_bytes(release) if any(getattr(j, "task", "t2va") == "fl2va" for j in jobs) else 0
    steps = ladder(asked, precision, precision_given=precision_given, fp8_problem=fp8_problem)
    sizes_at: dict[str, dict] = {}
    tried: list[MemoryPlan] = []
    for name, prec in steps.rungs:
        if prec not in sizes_at:
            import torch

            loaded = torch.float32 if dtype == "fp32" and prec != "fp8" else torch.bfloat16
            sizes_at[prec] = part_sizes(release, prec, loaded, vsa=vsa)
        sizes = sizes_at[prec]
        phases = expected_phases(sizes, name, canvas, release.dit.hidden_size, text_hidden=text.hidden_size,
                                 text_intermediate=text.intermediate_size, vae_batch=vae_batch, ranks=ranks,
                                 vision=vision)
        plan = MemoryPlan(name, prec, phases, host_bytes(sizes, name), limit, limit_source, canvas=canvas,
                          dtype=dtype)
        if plan.fits():
            why = [f"{p.label} needs {p.peak / GB:.1f} GB" for p in tried] + steps.skipped
            if asked != "auto":
                reason = f"--memory-plan {asked}"
            elif limit is None:
                reason = "no device memory limit known: the fastest plan"
            else:
                reason = "the fastest plan that fits" + (f" ({'; '.join(why)})" if why else "")
            return replace(plan, reason=reason)
        tried.append(plan)
    smallest = min(tried, key=lambda p: p.peak)
    extra = f"; {'; '.join(steps.skipped)}" if steps.skipped else ""
    budget = f"{_gb(limit)} GB ({limit_source}) for the {canvas.describe()} job"
    if asked != "auto":  # the plan asked for, not the smallest of a search (a trial read "fits" as the opposite)
        raise PlanError(f"--memory-plan {asked} does not fit {budget}: {smallest.label} needs "
                        f"{smallest.describe_peak()}{extra}; choose another --memory-plan (or auto), render a smaller "
                        f"canvas or fewer frames, or use a larger GPU")
    raise PlanError(f"no memory plan fits {budget}: the smallest, {smallest.label}, needs {smallest.describe_peak()}"
                    f"{extra}; render a smaller canvas or fewer frames, or use a larger GPU")


def _gb(n: float) -> str:
    """Bytes as GB with one decimal, or two significant digits below 1 GB (0.0001 GB is not "0.0 GB")."""
    return f"{n / GB:.1f}" if n >= 0.95 * GB else f"{n / GB:.2g}"


def device_limit(run, world: int) -> tuple[int | None, str]:
    """The memory budget of one rank (bytes) and where it came from: --max-gpu-memory; else on CUDA the smallest
    visible GPU of the run less `DEVICE_RESERVE`; else None (the CPU: no device limit)."""
    if run.max_gpu_memory is not None:
        return int(run.max_gpu_memory * GB), "--max-gpu-memory"
    if run.device != "cuda":
        return None, "none (CPU)"
    import torch

    props = min((torch.cuda.get_device_properties(i) for i in range(max(1, world))), key=lambda p: p.total_memory)
    return (int(props.total_memory - DEVICE_RESERVE),
            f"{props.name} {props.total_memory / GB:.1f} GB less {DEVICE_RESERVE / GB:.0f} GB reserve")


def plan_run(run, info, jobs: Sequence, world: int = 1):
    """The run with its memory plan chosen (`choose`): `memory_plan` the plan's name, `precision` its precision (fp8
    only where the chooser may switch, see `ladder`), `memory` its sidecar record; and the plan (its `log_line`
    for the log).

    Raises:
        PlanError: no plan fits (one line, the smallest plan and its expected peak), or the streamed plan with a
            mixed queue (t2va jobs beside a FastH3 adapter: the student is fused into resident weights).
    """
    if not jobs:  # an empty shard: nothing loads
        return run, None

    limit, source = device_limit(run, world)
    problem = _fp8_problem(run, world)
    student = run.adapter is not None or info.layout != "builtin" and _has_contract(run.checkpoint)
    plan = choose(info.release, jobs, asked=run.memory_plan, precision=run.precision,
                  precision_given=run.precision_given, limit=limit, limit_source=source, fp8_problem=problem,
                  vae_batch=run.vae_batch, ranks=world, vsa=student, dtype=run.dtype)
    if plan.name == "streamed" and run.adapter is not None and any(j.mode != "fasth3" for j in jobs):
        raise PlanError(f"the streamed memory plan ({plan.reason}) cannot render a mixed queue (t2va jobs beside a "
                        "FastH3 adapter: the student is fused into resident weights); render them in two runs")
    return replace(run, memory_plan=plan.name, precision=plan.precision, memory=plan.record()), plan


def _fp8_problem(run, world: int) -> str | None:
    """Why the chooser may not switch this run to fp8 (`models.fp8.fp8_problem`, shortened), or None."""
    from h3render.models.fp8 import fp8_problem

    if run.dtype != "bf16":
        return f"FP8 runs bf16 activations, this run's are {run.dtype}"
    if fp8_problem(run.dtype, run.devices(world)) is not None:
        return ("FP8 GEMMs need compute capability 8.9 or newer; weight-only FP8 for Ampere, issue #27 item 2, is "
                "not built")
    return None


def _has_contract(checkpoint: str) -> bool:
    from h3render.checkpoint.students import locate_student

    try:
        return locate_student(checkpoint)[0] is not None
    except (OSError, ValueError):
        return False
