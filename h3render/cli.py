"""The `h3render` command: wiring only. Reads top to bottom: resolve jobs -> load -> render -> report.

Exit codes: 0 success (every job succeeded or was already done), 1 a job failed, 2 bad input (nothing rendered, one
line on stderr, no traceback), 130 interrupted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import click

from h3render import jobs as jobs_mod, manifest as manifest_mod, manifest_formats, shards

EXIT_USAGE = 2
TINY_NOTICE = ("h3render: no checkpoint given (--checkpoint / H3RENDER_CHECKPOINT): using the built-in tiny model "
               "with random weights, which renders noise")


class UsageError(Exception):
    """Bad command-line input: printed as one line, exit code 2."""


def _fail(message: str) -> NoReturn:
    raise UsageError(message)


class _LazyChoice(click.Choice):
    """`click.Choice` over a tuple of another module (`h3render.media.X264_PRESETS`, `checkpoint.load.PRECISIONS`),
    read when click first needs it: those modules load torch (about 3 s), which `h3render --help` and
    `h3render presets` should not wait for."""

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)
        super().__init__(())

    @property
    def choices(self):
        import importlib

        return getattr(importlib.import_module(self._where[0]), self._where[1])

    @choices.setter
    def choices(self, value) -> None:
        pass  # fixed: the writer's presets


# ---------------------------------------------------------------------------------------------------------------------
# shared options

def _engine_options(f):
    options = [
        click.option("--checkpoint", type=str, default=None,
                     help="Checkpoint folder (official or diffusers layout); default $H3RENDER_CHECKPOINT, else the "
                          "built-in tiny random model. A single-file DiT goes with --transformer."),
        click.option("--transformer", type=str, default=None,
                     help="Single-file DiT (.safetensors, ComfyUI style: q/k/v stacked) replacing the checkpoint's."),
        click.option("--mode", type=click.Choice(jobs_mod.MODES), default=None, help="t2va (base) or fasth3."),
        click.option("--adapter", type=str, default=None,
                     help="FastH3 adapter fused at load time: a .safetensors file, a variant folder, or the LoRA "
                          "bundle root (with --adapter-variant); on `prompt` it implies --mode fasth3."),
        click.option("--adapter-variant", type=str, default=None,
                     help="Variant of a FastH3 LoRA bundle root (e.g. vsa-datafree, dense-datafree)."),
        click.option("--fasth3-positions", type=click.Choice(["release", "fastvideo-example"]), default=None,
                     help="FastH3 pre-shift positions: the release's [0.999, 0.749, 0.5, 0.25, 0] or FastVideo "
                          "0.2.1's example linspace(1, 0, 5); default: the student's own."),
        click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
                     help="Default: cuda when available."),
        click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
                     help="Default: bf16 on CUDA, fp32 on CPU (bf16 with --precision fp8)."),
        click.option("--precision", type=_LazyChoice("h3render.checkpoint.load", "PRECISIONS"), default=None,
                     help="fp8: FP8 GEMMs in the DiT blocks, FP8 text-encoder weights, bf16 activations (needs CUDA "
                          "compute capability >= 8.9, or the CPU); default bf16, or the manifest's defaults."),
        click.option("--gpus", type=int, default=None, help="GPUs to use (default: every visible GPU; with --device cpu: CPU processes, for testing)."),
        click.option("--crf", type=click.IntRange(0, 51), default=18, show_default=True, help="x264 CRF."),
        click.option("--x264-preset", type=_LazyChoice("h3render.spec", "X264_PRESETS"), default="veryfast",
                     show_default=True, help="x264 speed preset (faster presets: bigger files at the same CRF)."),
        click.option("--attention", type=_LazyChoice("h3render.spec", "ATTENTION_BACKENDS"), default=None,
                     help="Attention backend on CUDA (default: fastest available, by measurement); on CPU "
                          "torch SDPA always runs. The sidecar's run.attention says what ran."),
        click.option("--save-latents", is_flag=True, hidden=True,
                     help="Also write <name>.latents.pt (final latents) beside each MP4, for comparing runs."),
        click.option("--vae-batch", type=click.IntRange(1, 256), default=8, show_default=True,
                     help="Video VAE work items (window x tile) per decoder forward."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _canvas_time_options(f):
    options = [
        click.option("--preset", default=None, help="Canvas/duration preset (see `h3render presets`)."),
        click.option("--aspect", default=None, help='Aspect ratio "W:H" (released canvas rule).'),
        click.option("--width", type=int, default=None, help="Canvas width in px (multiple of 32)."),
        click.option("--height", type=int, default=None, help="Canvas height in px (multiple of 32)."),
        click.option("--duration", type=float, default=None, help="Seconds; snapped up to 17n+5 frames at 24 fps."),
        click.option("--frames", type=int, default=None, help="Frame count; snapped up to 17n+5."),
        click.option("--steps", type=int, default=None, help="Sigma points (50 -> 49 forwards, released default)."),
        click.option("--seed", type=int, default=None, help="Noise seed (default 0)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _say(message: str) -> None:
    """Print on the launcher's rank 0 only (under torchrun/srun every rank parses the command line)."""
    from h3render.parallel.groups import launcher_env

    if launcher_env()[0] == 0:
        print(message, file=sys.stderr)


def _resolve_checkpoint(checkpoint: str | None) -> str:
    checkpoint = checkpoint or os.environ.get("H3RENDER_CHECKPOINT") or None
    if checkpoint is None:
        _say(TINY_NOTICE)
        return "tiny"
    if checkpoint not in ("tiny", "small") and not Path(checkpoint).exists():
        _fail(f"checkpoint {checkpoint} does not exist")
    if Path(checkpoint).is_file():
        _fail(f"checkpoint {checkpoint} is a single file: it holds only the DiT (no text encoder, no VAEs); pass the "
              "checkpoint folder with --checkpoint and this file with --transformer")
    return checkpoint


def _usage(fn, *args, prefix: str = ""):
    """`fn(*args)`, where an OSError or ValueError (CheckpointError included) is bad input: its first line, exit 2."""
    try:
        return fn(*args)
    except (OSError, ValueError) as exc:
        _fail(prefix + (str(exc).strip().splitlines() or [""])[0])


def _checkpoint_info(checkpoint: str):
    from h3render.checkpoint.layouts import read_checkpoint_info

    return _usage(read_checkpoint_info, checkpoint)


def _device(device: str | None) -> str:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda: no CUDA device is available")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _dtype(dtype: str | None, device: str, precision: str = "bf16"):
    """--dtype, else bf16 on CUDA and fp32 on CPU; fp8 implies bf16 activations (its GEMMs write bf16)."""
    import torch

    default = "bf16" if device == "cuda" or precision == "fp8" else "fp32"
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype or default]


def _check_precision(opts: dict, device: str, world: int, source: str | None = None) -> None:
    """--precision against --dtype and each GPU of the run (`engine.precision_problem`), before any weights load
    (world 0: against --dtype only); `source` names where a manifest set the precision."""
    import torch

    from h3render.engine import precision_problem

    devices = [torch.device(device, i) for i in range(world)] if device == "cuda" else [torch.device(device)]
    problem = precision_problem(opts["precision"], _dtype(opts["dtype"], device, opts["precision"]), devices[:world])
    if problem:
        _fail(problem if source is None else f"{source}: precision: {problem}")


def _check_mode(mode: str | None, adapter: str | None, checkpoint: str) -> None:
    from h3render.checkpoint.contract import read_v2_contract

    if mode == "fasth3" and adapter is None:
        try:
            v2 = checkpoint not in ("tiny", "small") and read_v2_contract(checkpoint) is not None
        except ValueError as exc:
            _fail(str(exc))
        if not v2:
            _fail("--mode fasth3 needs --adapter PATH (the FastH3 student adapter) or a FastH3 V2 checkpoint")
    if adapter is not None and not Path(adapter).exists():
        _fail(f"--adapter {adapter}: no such file or folder")


def _has_contract(checkpoint: str) -> bool:
    """Whether the checkpoint is a full FastH3 student (it carries its own `fastvideo_inference.json`)."""
    from h3render.checkpoint.contract import read_v2_contract

    try:
        return checkpoint not in ("tiny", "small") and read_v2_contract(checkpoint) is not None
    except ValueError as exc:
        _fail(str(exc))


def _adapter_mode(mode: str | None, adapter: str | None) -> str | None:
    """`h3render prompt`'s mode: --adapter fuses the FastH3 student, whose jobs are fasth3 jobs, so it implies
    --mode fasth3 (announced); --mode t2va with --adapter asks for both models at once and is refused."""
    if adapter is None or mode == "fasth3":
        return mode
    if mode == "t2va":
        _fail("--adapter fuses the FastH3 student, which runs --mode fasth3 only; drop --adapter to render with the "
              "base model, or --mode t2va to use the student")
    _say("h3render: --adapter given: rendering with the FastH3 student (--mode fasth3)")
    return "fasth3"


def _check_attention(attention: str | None, device: str) -> None:
    """--attention: on CPU the models keep torch SDPA (warned, and the sidecar's run.attention records it); on CUDA
    a backend this machine cannot run is refused before anything loads."""
    if attention is None:
        return
    if device != "cuda":
        _say(f"h3render: warning: --attention {attention} applies on CUDA only; on {device} attention runs torch "
             "SDPA (sdpa), as the sidecar's run.attention records")
        return
    from h3render.models.attention import available_backends

    if attention not in available_backends():
        _fail(f"--attention {attention}: not available on this machine (available: "
              f"{', '.join(available_backends())})")


def _check_transformer(transformer: str | None, info) -> None:
    """--transformer FILE: the loader's own check (`with_transformer_file`), headers only, before any weights load."""
    if transformer is None:
        return
    if info.layout == "builtin":
        _fail(f"--transformer {transformer} replaces a checkpoint folder's DiT: it needs --checkpoint DIR (the text "
              f"encoder and VAEs come from there); the built-in {info.path} model takes none")
    from h3render.checkpoint.layouts import with_transformer_file

    _usage(with_transformer_file, info, transformer, prefix="--transformer ")  # its messages start with the file


def _check_writable(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        _fail(f"output folder {folder} is not a directory")
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        _fail(f"output folder {folder} is not writable")


_RAN_DISTRIBUTED = False  # set once this process took part in a multi-rank run


def _exit(code: int) -> NoReturn:
    if _RAN_DISTRIBUTED:
        from h3render.parallel.launch import hard_exit

        hard_exit(code)
    sys.exit(code)


def _main_guard(fn, *args) -> int:
    from h3render.outputs import BatchUsageError
    from h3render.signals import exit_code_for, signal_name, signum_of

    try:
        return fn(*args)
    except KeyboardInterrupt as exc:  # a signal before the queue took over (start-up: imports, manifest, load)
        _say(f"h3render: interrupted ({signal_name(signum_of(exc))}) before any job started; nothing written")
        return exit_code_for(signum_of(exc))
    except (UsageError, BatchUsageError) as exc:
        _say(f"h3render: error: {exc}")
        return EXIT_USAGE
    except manifest_formats.ManifestError as exc:
        for line in getattr(exc, "errors", [str(exc)]):
            _say(f"h3render: error: {line}")
        return EXIT_USAGE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="h3render")
def cli() -> None:
    """Render MiniMax-H3 prompts to H.264/AAC MP4s."""


# ---------------------------------------------------------------------------------------------------------------------
# h3render prompt

@cli.command("prompt")
@click.argument("text")
@click.option("-o", "--output", required=True, help="Output .mp4 path (sidecar: same name, .json).")
@click.option("--quiet", is_flag=True, help="No stage progress (bars on a terminal, else a line per stage).")
@click.option("--first-frame", default=None, help="fl2va: image (PNG/JPEG/WebP) the video starts from.")
@click.option("--last-frame", default=None, help="fl2va: image (PNG/JPEG/WebP) the video ends on.")
@_canvas_time_options
@_engine_options
def prompt_command(text, output, **opts) -> None:
    """Render one prompt to OUTPUT (MP4) and its JSON sidecar (fields: docs/sidecar.md).

    Progress goes to stderr: a bar per stage (text encode, denoise, decode, encode) on a terminal; otherwise a
    line when each stage ends and, while one runs, a line every 10 s.
    """
    _exit(_main_guard(_prompt, text, output, opts))


def _prompt(text: str, output: str, opts: dict) -> int:
    out = Path(output)
    if out.suffix.lower() != ".mp4":
        _fail(f"output {output} must end in .mp4")
    _check_writable(out.parent if str(out.parent) else Path("."))
    checkpoint = _resolve_checkpoint(opts["checkpoint"])
    opts["mode"] = _adapter_mode(opts["mode"], opts["adapter"])
    _check_mode(opts["mode"], opts["adapter"], checkpoint)
    info = _checkpoint_info(checkpoint)
    _check_transformer(opts["transformer"], info)
    fields = {k: opts[k] for k in ("preset", "aspect", "width", "height", "duration", "frames", "steps", "seed",
                                   "mode", "first_frame", "last_frame")}
    fields.update(prompt=text, output=out.stem)
    job = manifest_mod.job_from_fields(fields, info.limits())
    opts["precision"] = opts["precision"] or manifest_mod.DEFAULT_PRECISION
    _say(f"h3render: {job.canvas_note()}, {job.time_note()}")
    if job.task == "fl2va":
        _say("h3render: fl2va: " + "; ".join(k.describe() for k in job.keyframes))
    sidecar = out.with_suffix(".json")
    return _run(checkpoint, info, [job], opts, single=(out, sidecar))


# ---------------------------------------------------------------------------------------------------------------------
# h3render batch

@cli.command("batch")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--out-dir", default="renders", show_default=True, help="Folder for MP4s, sidecars and the report.")
@click.option("--shard", default=None, help='This task\'s shard "i/n" (0-based); default from SLURM_ARRAY_TASK_*.')
@click.option("--skip-existing/--overwrite", default=True, show_default=True,
              help="Resume (skip finished, current jobs) or render everything again.")
@click.option("--fail-fast", is_flag=True, help="Stop after the first failed job.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; load nothing.")
@click.option("--quiet", is_flag=True, help="One log line per job; no bars, no stage lines.")
@click.option("--seed", type=int, default=None,
              help="Batch-wide default seed: replaces the manifest's defaults; a job's own seed wins.")
@click.option("--steps", type=int, default=None,
              help="Batch-wide default sigma points for t2va jobs: replaces the manifest's defaults; a job's own "
                   "steps win.")
@click.option("--preset", default=None,
              help="Batch-wide default canvas preset (see `h3render presets`): replaces the manifest's default "
                   "canvas; a job's own preset/aspect/width/height win.")
@_engine_options
def batch_command(manifest, out_dir, shard, skip_existing, fail_fast, dry_run, quiet, **opts) -> None:
    """Render every job of MANIFEST (JSONL or YAML; schema in docs/manifest.md) with one resident model.

    Jobs run one after another; each job's MP4 tail (encoder flush, trailer, fsync, rename, sidecar) finishes on
    the writer's thread while the next job's prompt encode and denoise start. --seed, --steps, --preset and --mode
    act as command-line defaults: above the manifest's defaults, below a job's own fields.

    Progress: on a terminal a queue bar and a bar per stage of the running job; in a log one line per job, plus
    stage lines only for a stage that runs 10 s or longer; --quiet keeps the job lines only.
    """
    _exit(_main_guard(_batch, manifest, out_dir, shard, skip_existing, fail_fast, dry_run, quiet, opts))


def _batch(manifest, out_dir, shard, skip_existing, fail_fast, dry_run, quiet, opts) -> int:
    checkpoint = _resolve_checkpoint(opts["checkpoint"])
    _check_mode(None, opts["adapter"], checkpoint)  # fasth3 jobs without a student: the manifest check below
    info = _checkpoint_info(checkpoint)
    _check_transformer(opts["transformer"], info)
    # Command-line defaults, passed like --mode: read_manifest applies them below each job's own fields.
    overrides = {k: opts[k] for k in ("mode", "seed", "steps", "preset")}
    student = opts["adapter"] is not None or _has_contract(checkpoint)
    m = manifest_mod.read_manifest(manifest, info.limits(), overrides, adapter_available=student,
                               precision=opts["precision"])
    if opts["adapter"] is None and m.adapter is not None:
        opts["adapter"] = str(m.adapter)  # named in the manifest's defaults; --adapter wins
    # Engine settings the manifest's defaults may give; each command-line option wins over its own field.
    source = None if opts["precision"] else f"{manifest}"  # the defaults set it when --precision did not
    opts["precision"] = m.precision
    _check_precision(opts, _device(opts["device"]), 0, source)  # --dtype fp32 with fp8: nothing created yet
    opts["adapter_variant"] = opts["adapter_variant"] or m.adapter_variant
    opts["fasth3_positions"] = opts["fasth3_positions"] or m.fasth3_positions
    try:
        shard_spec = shards.parse_shard(shard) if shard else shards.shard_from_slurm(os.environ)
    except ValueError as exc:
        _fail(str(exc))
    jobs = m.jobs if shard_spec is None else shards.shard_jobs(m.jobs, *shard_spec)
    # This run's checkpoint and encoder, for resume's "skipped: rendered earlier with ..." lines.
    current = {"checkpoint": {"path": info.recorded_path, "config_hash": info.config_hash,
                              "transformer": opts["transformer"] and str(Path(opts["transformer"]).resolve()),
                              "precision": opts["precision"]},
               "encoder": {"crf": opts["crf"], "x264_preset": opts["x264_preset"]}}
    if dry_run:
        print("\n".join(jobs_mod.plan_lines(jobs, Path(out_dir), overwrite=not skip_existing, current=current, run={
            "checkpoint": checkpoint, "precision": opts["precision"], "adapter": opts["adapter"]})))
        return 0
    _check_writable(Path(out_dir))
    from h3render.outputs import prepare_out_dir

    prepare_out_dir(out_dir)  # a file or a broken/looping symlink in the way: exit 2 before any rank starts
    return _run(checkpoint, info, jobs, opts, out_dir=out_dir, shard=shard_spec, overwrite=not skip_existing,
                fail_fast=fail_fast, quiet=quiet, current=current)


# ---------------------------------------------------------------------------------------------------------------------
# running on 1..N ranks

def _run(checkpoint, info, jobs, opts, **kw) -> int:
    from h3render.parallel.launch import plan_world, spawn

    device = _device(opts["device"])
    _check_attention(opts["attention"], device)
    try:
        world, warning = plan_world(opts["gpus"], device, info.release.dit.num_attention_heads)
    except ValueError as exc:
        _fail(str(exc))
    _check_precision(opts, device, world)
    if warning:
        print(f"h3render: warning: {warning}", file=sys.stderr)
    kw["heads"] = info.release.dit.num_attention_heads
    if world > 1:
        return spawn(world, _rank_main, checkpoint, jobs, opts, device, kw)
    return _rank_main(checkpoint, jobs, opts, device, kw)


def _rank_main(checkpoint, jobs, opts, device, kw) -> int:
    """Every rank: join the group, load once, then rank 0 runs the queue and the others follow it."""
    import torch

    from h3render.batch import run_batch
    from h3render.parallel.groups import init_parallel, largest_dividing_world, restrict, shutdown
    from h3render.parallel.launch import LeaderRenderer, follow
    from h3render.engine import Engine, EngineSettings

    ctx = init_parallel(device)
    if ctx.distributed:
        global _RAN_DISTRIBUTED
        _RAN_DISTRIBUTED = True
    if ctx.device.type == "cpu":
        # Random tiny weights drive activations into denormal floats, which x86 CPUs process 10-100x slower;
        # flushing them to zero left the rendered frames byte-identical in our runs.
        torch.set_flush_denormal(True)
    heads = kw["heads"]
    usable = largest_dividing_world(ctx.world_size, heads)
    if usable != ctx.world_size:
        if ctx.is_main:
            print(f"h3render: warning: using {usable} of {ctx.world_size} ranks: Ulysses splits the {heads} attention "
                  f"heads evenly; ranks {usable}..{ctx.world_size - 1} sit this run out", file=sys.stderr)
        ctx = restrict(ctx, usable)
        if ctx is None:
            shutdown()
            return 0
    settings = EngineSettings(crf=opts["crf"], x264_preset=opts["x264_preset"], vae_batch=opts["vae_batch"],
                              attention=opts["attention"],
                              progress=_progress(ctx.is_main and not (opts.get("quiet") or kw.get("quiet")),
                                                single="single" in kw),
                              save_latents=opts["save_latents"])
    dtype = _dtype(opts["dtype"], device, opts["precision"])

    def load():
        # A queue with t2va jobs beside a student adapter renders them on the base weights first, then fuses the
        # student once (Engine.fuse_student) for the fasth3 jobs.
        base_first = opts["adapter"] is not None and any(j.mode == "t2va" for j in jobs)
        engine = Engine.load(checkpoint, ctx, dtype, settings, adapter=opts["adapter"],
                             transformer_file=opts["transformer"], adapter_variant=opts["adapter_variant"],
                             fasth3_positions=opts["fasth3_positions"], base_jobs_first=base_first,
                             precision=opts["precision"])
        engine.prepare(_distinct_setups(jobs))
        return engine

    try:
        if not ctx.is_main:
            follow(load(), ctx)
            return 0
        loaded = []

        def factory():
            r = load()
            loaded.append(r)
            return LeaderRenderer(r, ctx) if ctx.distributed else r

        try:
            if "single" in kw:
                return _render_single(factory, jobs[0], *kw["single"])
            order = sorted(range(len(jobs)), key=lambda i: jobs[i].mode == "fasth3")  # t2va first, stable
            report = run_batch(jobs, factory, kw["out_dir"], overwrite=kw["overwrite"], fail_fast=kw["fail_fast"],
                               quiet=kw["quiet"], shard=kw["shard"], render_order=order, current=kw["current"])
            return report.exit_code
        finally:
            if ctx.distributed:
                if not loaded:  # followers are waiting to load; let them load and stop
                    factory()
                LeaderRenderer(loaded[0], ctx).stop()
    finally:
        shutdown()


def _progress(shown: bool, single: bool):
    """Stage progress (h3render.progress): bars on a terminal (under batch's queue bar, one row down); in a log a
    line per stage for `prompt`, and for `batch` (which logs a line per job) only stages of 10 s or longer."""
    from h3render.progress import Progress

    if not shown:
        return Progress("off")
    if sys.stderr.isatty():
        return Progress("bar", position=0 if single else 1)
    return Progress("lines" if single else "slow")


def _render_single(factory, job, mp4: Path, sidecar: Path) -> int:
    """`h3render prompt`: one job. The renderer writes `<name>.tmp.mp4` / sidecar temp files and renames them on
    success; on failure or Ctrl-C nothing is left under either name."""
    import time

    from h3render.outputs import temp_paths
    from h3render.report import remove_files

    mp4.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        factory().render(job, mp4, sidecar)
    except KeyboardInterrupt:
        remove_files(*temp_paths(mp4, sidecar))
        print("h3render: interrupted; no output written", file=sys.stderr)
        return 130
    except Exception as exc:
        remove_files(*temp_paths(mp4, sidecar))
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"h3render: failed: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    print(f"h3render: wrote {mp4} and {sidecar} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def _distinct_setups(jobs):
    """One representative job per distinct (schedule, canvas, length): AdaLN tables are built, the VAE compiled and
    the audio decode's CUDA graph captured for each before the first job, outside job timings."""
    seen, out = set(), []
    for job in jobs:
        key = (job.mode, job.task, job.steps, job.width, job.height, job.frames)
        if key not in seen:
            seen.add(key)
            out.append(job)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# h3render presets / make-checkpoint

@cli.command("presets")
@click.option("--checkpoint", default=None, help="As on `prompt`: default $H3RENDER_CHECKPOINT, else the tiny model.")
def presets_command(checkpoint) -> None:
    """List the canvas presets with canvas, frames and packed row counts, for the checkpoint `prompt` would use."""

    def run() -> int:
        for line in jobs_mod.preset_lines(_checkpoint_info(_resolve_checkpoint(checkpoint)).limits()):
            print(line)
        return 0

    sys.exit(_main_guard(run))


@cli.command("make-checkpoint")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--config", "config", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--layout", type=click.Choice(["official", "diffusers", "single-file"]), default="official",
              show_default=True, help="single-file: OUT is one .safetensors DiT (ComfyUI style, q/k/v stacked).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--adapter", type=click.Path(dir_okay=False), default=None,
              help="Also write a synthetic FastH3 adapter for this config to this file.")
def make_checkpoint_command(out, config, layout, seed, adapter) -> None:
    """Write a random checkpoint in the real on-disk format (no downloads)."""

    def run() -> int:
        from h3render.make_checkpoint.writer import check_output, make_checkpoint

        _usage(check_output, out, layout)  # before anything is written (make_checkpoint checks it again)
        path = make_checkpoint(out, config=config, layout=layout, seed=seed, adapter=adapter or None)
        print(f"h3render: wrote a random {config} checkpoint ({layout} layout) to {path}", file=sys.stderr)
        if adapter:
            print(f"h3render: wrote a synthetic FastH3 adapter to {adapter}", file=sys.stderr)
        return 0

    sys.exit(_main_guard(run))


def main() -> None:
    from h3render.signals import ProcessGuard

    ProcessGuard().install()  # from here on a signal gives 130 (75: SIGUSR1/2) and one line, not click's "Aborted!"
    try:
        code = cli.main(prog_name="h3render", standalone_mode=False)
    except click.UsageError as exc:
        # One line, like every other usage error of ours (click's own format is its usage block, then the error).
        where = exc.ctx.command_path if exc.ctx is not None else "h3render"
        print(f"h3render: error: {exc.format_message()} (see '{where} --help')", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        print(f"h3render: error: {exc.format_message()}", file=sys.stderr)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
