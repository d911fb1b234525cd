"""The `h3render` command: wiring only. Reads top to bottom: parse -> resolve the run's settings and jobs -> check
once -> run (`h3render.runner`) -> exit code.

Exit codes (`h3render.exits`): 0 success (every job succeeded or was already done), 1 a job failed, 2 bad input
(nothing rendered, one line on stderr, no traceback), 75 stopped for a requeue (SIGUSR1/2), 130 interrupted.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import click
from click.core import ParameterSource

from h3render import jobs as jobs_mod
from h3render.cli_options import canvas_time_options, engine_options
from h3render.cli_say import end_status, say, status
from h3render.dry_run import plan_lines
from h3render.exits import EXIT_OK, EXIT_USAGE, UsageError, error_exit_code
from h3render.job_loras import parse_lora_option
from h3render.manifest import job_from_fields, read_manifest
from h3render.outputs import blocker, existing_outputs_problem, prepare_out_dir
from h3render.runner import Queue, plan_ranks, ran_distributed, run_jobs, to_render
from h3render.settings import (RunSettings, SettingsError, checkpoint_info, has_v2_contract, prompt_mode,
                               resolve_checkpoint, usage)
from h3render.shards import parse_shard, shard_from_slurm, shard_jobs
from h3render.signals import ProcessGuard, signal_name, signum_of

# Modules that load torch (h3render.parallel, checkpoint, make_checkpoint) are imported where used, so that
# `h3render --help` and click's usage errors answer at once.


def _check(run: RunSettings, info, mode: str | None = None, jobs=None) -> int:
    """Plan the ranks and check the settings once against them (and `prompt`'s mode or `batch`'s jobs); print the
    warnings; the world size."""
    world, warning = plan_ranks(run, info.release.dit.num_attention_heads)
    for line in run.check(info, mode=mode, jobs=jobs, world=world):
        say(line)
    if warning:
        say(f"h3render: warning: {warning}")
    return world


def _plan_memory(run: RunSettings, info, jobs, world: int, quiet: bool) -> RunSettings:
    """The run with its memory plan (`h3render.memplan`: --memory-plan / --max-gpu-memory / the GPU's size),
    announced in one line (unless `quiet`, or a CPU run without a limit stays resident); no plan fits: one line,
    exit 2, before anything loads."""
    from h3render.memplan import PlanError, plan_run

    try:
        run, plan = plan_run(run, info, jobs, world)
    except PlanError as exc:
        raise SettingsError(str(exc)) from None
    if not quiet and plan is not None and (plan.limit is not None or run.memory_plan != "resident"):
        say(plan.log_line())  # a CPU run with no limit runs resident, as always: the sidecar says so
    return run


def _check_partitions(info, jobs) -> None:
    """ref2va jobs run the checkpoint's Ref2VA DiT: a checkpoint without that partition is refused before anything
    loads (a built-in model makes its own)."""
    ref = next((j for j in jobs if j.task == "ref2va"), None)
    if ref is not None and info.layout != "builtin" and info.transformer_ref is None:
        raise SettingsError(f"{info.path}: no ref2va DiT partition (official Ref2VA/transformer/, diffusers "
                            f"transformer_ref/), and job {ref.output!r} has references")


def _check_writable(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise SettingsError(f"output folder {folder} is not a directory")
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        if probe == folder:
            raise SettingsError(f"output folder {folder} is not writable")
        raise SettingsError(f"output folder {folder} cannot be made: {probe} is not writable")
    # The mode bits are not the whole story (root passes them; /proc, /sys or a read-only mount refuse anyway, which
    # was found after the whole render): create and remove a file of our own there. (A file in the way is
    # `outputs.prepare_out_dir`'s to name.)
    if not probe.is_dir():
        return
    try:
        fd, name = tempfile.mkstemp(prefix=".h3render-probe-", dir=probe)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if probe != folder:
            raise SettingsError(f"output folder {folder} cannot be made in {probe}: {why}") from None
        raise SettingsError(f"output folder {folder} takes no file (creating one there failed: {why})") from None
    os.close(fd)
    os.unlink(name)


def _exit(code: int) -> NoReturn:
    if ran_distributed():
        from h3render.parallel.launch import hard_exit

        hard_exit(code)
    sys.exit(code)


def _main_guard(fn, *args) -> int:
    """`fn(*args)`'s exit code; a usage error (a manifest's: one line per problem) or a signal before the queue
    took over gives its code (`exits.error_exit_code`) and one line each."""
    try:
        return fn(*args)
    except KeyboardInterrupt as exc:  # a signal before the queue took over (start-up: imports, manifest, load)
        say(f"h3render: interrupted ({signal_name(signum_of(exc))}) before any job started; nothing written")
        return error_exit_code(exc)
    except UsageError as exc:
        for line in getattr(exc, "errors", [str(exc)]):
            say(f"h3render: error: {line}")
        return error_exit_code(exc)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="h3render")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Render MiniMax-H3 prompts to H.264/AAC MP4s."""
    if ctx.invoked_subcommand is None:
        # Bare `h3render` is a request for the overview, not a mistake: click's default is the help as a usage
        # error (stderr, exit 2), which our one-line error format then mangled; print it on stdout and exit 0.
        click.echo(ctx.get_help())
        ctx.exit(EXIT_OK)


# ---------------------------------------------------------------------------------------------------------------------
# h3render prompt

@cli.command("prompt", short_help="Render one prompt to an MP4 and its JSON sidecar.")
@click.argument("text")
@click.option("-o", "--output", required=True,
              help="Output .mp4 path (sidecar: same name, .json); one that exists is refused unless --overwrite.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing -o MP4 and its sidecar; they are kept until the new render is complete.")
@click.option("--quiet", is_flag=True, help="Print only warnings and errors: no notices, plan line, progress or "
                                            "final line.")
@click.option("--first-frame", default=None, help="fl2va: image (PNG/JPEG/WebP) the video starts from.")
@click.option("--last-frame", default=None, help="fl2va: image (PNG/JPEG/WebP) the video ends on.")
@click.option("--reference", "references", multiple=True,
              help="ref2va: an image, video or audio reference file; repeat it, the order is kept.")
@click.option("--reference-no-audio", is_flag=True, default=None,
              help="ref2va: do not use the reference videos' soundtracks.")
@click.option("--keyframe", "keyframes", multiple=True, metavar="FRAME:IMAGE",
              help="fl2va: image anchored at a 0-based frame index (repeatable): --keyframe 0:a.png --keyframe "
                   "240:b.png.")
@canvas_time_options
@engine_options
def prompt_command(text, output, overwrite, quiet, **opts) -> None:
    """Render one prompt to the -o MP4 and its JSON sidecar beside it (fields: docs/sidecar.md). An -o MP4 or
    sidecar that exists is refused before anything loads (exit 2); --overwrite replaces them.

    Docs, JSON schemas and the SLURM script are installed with h3render: `python -m h3render.docs` lists them.

    Progress goes to stderr: a bar per stage (text encode, denoise, decode, encode) on a terminal; otherwise a
    line when each stage ends and, while one runs, a line every 10 s.
    """
    _exit(_main_guard(_prompt, text, output, overwrite, quiet, opts))


def _prompt(text: str, output: str, overwrite: bool, quiet: bool, opts: dict) -> int:
    out = Path(output)
    if out.suffix.lower() != ".mp4":
        raise SettingsError(f"output {output} must end in .mp4")
    sidecar = out.with_suffix(".json")
    for final in (out, sidecar):  # found now, not by the rename after the whole render
        if final.is_dir():
            raise SettingsError(f"output {final} is a folder; nothing can be written there")
    if not overwrite and (problem := existing_outputs_problem(out, sidecar)):
        raise SettingsError(problem)  # an earlier render was replaced without a word (a trial)
    _check_writable(out.parent if str(out.parent) else Path("."))
    if not quiet:
        status("h3render: checking the job and the checkpoint ...")
    # The checks that need no torch come first (option values and files, the checkpoint's configs, the job's
    # fields and keyframes), so a typo answers at once; then the device and the weights' headers.
    checkpoint, notice = resolve_checkpoint(opts["checkpoint"], os.environ)
    mode, note = prompt_mode(opts["mode"], opts["adapter"])
    info = checkpoint_info(checkpoint)
    RunSettings.check_options(opts, info)
    fields = {k: opts[k] for k in ("preset", "aspect", "width", "height", "duration", "frames", "steps", "seed",
                                   "first_frame", "last_frame")}
    fields.update(prompt=text, output=out.stem, mode=mode, references=list(opts["references"]) or None,
                  reference_audio=False if opts["reference_no_audio"] else None,
                  keyframes=list(opts["keyframes"]) or None)
    if opts.get("lora"):
        fields["loras"] = _lora_options(opts["lora"])
    # each list option's values as typed: a problem names `--lora #2 (b.safetensors:0.5)`, not `loras[1].path`
    typed = {"loras": opts.get("lora"), "references": opts["references"], "keyframes": opts["keyframes"]}
    job = job_from_fields(fields, info.limits(), option_values={k: list(v) for k, v in typed.items() if v})
    _check_partitions(info, [job])
    run = RunSettings.resolve(opts, checkpoint=checkpoint, info=info)
    world = _check(run, info, mode=mode)
    run = _plan_memory(run, info, [job], world, quiet)
    if not quiet:  # checked: the run renders, and these say what it renders (never before an unrelated error)
        for line in (notice, note, f"h3render: {job.canvas_note()}, {job.time_note(info.limits())}"):
            if line:
                say(line)
        if job.conditions_note():
            say(f"h3render: {job.conditions_note()}")
    end_status()
    return run_jobs(run, [job], world, info.release.dit.num_attention_heads, quiet=quiet,
                    single=(out, sidecar))


def _lora_options(values) -> list[dict]:
    """--lora FILE[:STRENGTH] (repeated) as a `loras` field value (`job_loras.parse_lora_option`)."""
    try:
        return [parse_lora_option(v) for v in values]
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


# ---------------------------------------------------------------------------------------------------------------------
# h3render batch

@cli.command("batch", short_help="Render every job of a JSONL or YAML manifest, resumably.")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--out-dir", default="renders", show_default=True, help="Folder for MP4s, sidecars and the report.")
@click.option("--shard", default=None, help='This task\'s shard "i/n" (0-based); default from SLURM_ARRAY_TASK_*.')
@click.option("--skip-existing", is_flag=True, help="Resume: skip finished, current jobs (the default).")
@click.option("--overwrite", is_flag=True, help="Render every job again, replacing its outputs (a job another queue "
                                               "on this out dir finishes while this one runs is not rendered twice).")
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
@engine_options
def batch_command(manifest, out_dir, shard, skip_existing, overwrite, fail_fast, dry_run, quiet, **opts) -> None:
    """Render every job of MANIFEST (JSONL or YAML; schema in docs/manifest.md) with one resident model.

    Docs, JSON schemas and the SLURM script are installed with h3render: `python -m h3render.docs` lists them.

    Jobs run one after another; each job's MP4 tail (encoder flush, trailer, fsync, rename, sidecar) finishes on
    the writer's thread while the next job's prompt encode and denoise start. --seed, --steps, --preset and --mode
    act as command-line defaults: above the manifest's defaults, below a job's own fields.

    Progress: on a terminal a queue bar and a bar per stage of the running job; in a log one line per job, plus
    stage lines only for a stage that runs 10 s or longer; --quiet keeps the job lines only.
    """
    if skip_existing and overwrite:  # a flag pair let the last one win: skipping asked for, outputs replaced
        _exit(_main_guard(_refuse, "--skip-existing and --overwrite ask for opposite things; give one"))
    resume = _resume_command(click.get_current_context())
    _exit(_main_guard(_batch, manifest, out_dir, shard, not overwrite, fail_fast, dry_run, quiet, opts, resume))


def _resume_command(ctx: click.Context) -> str:
    """This `h3render batch` command as the shell would take it again, for the last lines after a signal: the
    arguments and options the command line gave, rebuilt from click's parameters (an in-process call has no
    argv of its own), without --overwrite, which would render the finished jobs again."""
    words = ["h3render", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE or param.name == "overwrite":
            continue
        if isinstance(param, click.Argument):
            words.append(str(value))
            continue
        flag = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            words += [flag] if value else [max(param.secondary_opts, key=len)] if param.secondary_opts else []
        else:
            words += [word for item in (value if param.multiple else (value,)) for word in (flag, str(item))]
    return shlex.join(words)


def _refuse(message: str) -> int:
    raise SettingsError(message)


def _batch(manifest, out_dir, shard, skip_existing, fail_fast, dry_run, quiet, opts, resume) -> int:
    # As `_prompt`: the torch-free checks (options, files, the checkpoint's configs, the manifest) first.
    if not quiet:
        status("h3render: checking the manifest and the checkpoint ...")
    checkpoint, notice = resolve_checkpoint(opts["checkpoint"], os.environ)
    info = checkpoint_info(checkpoint)
    RunSettings.check_options(opts, info)
    # Command-line defaults, passed like --mode: read_manifest applies them below each job's own fields.
    overrides = {k: opts[k] for k in ("mode", "seed", "steps", "preset")}
    if opts.get("lora"):
        overrides["loras"] = _lora_options(opts["lora"])
    student = opts["adapter"] is not None or has_v2_contract(checkpoint)  # else fasth3 jobs are manifest errors
    m = read_manifest(manifest, info.limits(), overrides, adapter_available=student, precision=opts["precision"],
                      option_values={"loras": list(opts["lora"])} if opts.get("lora") else None)
    try:
        shard_spec = parse_shard(shard) if shard else shard_from_slurm(os.environ)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    jobs = m.jobs if shard_spec is None else shard_jobs(m.jobs, *shard_spec)
    _check_partitions(info, jobs)
    if not dry_run:
        _check_writable(Path(out_dir))
    elif (problem := blocker(Path(out_dir))) is not None:  # read-only: what the run would refuse (a third trial)
        raise SettingsError(f"--out-dir {out_dir}: {problem}")
    run = RunSettings.resolve(opts, checkpoint=checkpoint, info=info, manifest=m)
    if dry_run:
        for line in run.check(info, jobs=jobs):  # against the dtype only: nothing is created
            say(line)
        if notice and not quiet:  # what the run would render with, once the plan holds
            say(notice)
        end_status()
        print("\n".join(plan_lines(jobs, Path(out_dir), overwrite=not skip_existing,
                                            current=run.record(), run=run.summary(), limits=info.limits())))
        return EXIT_OK
    world = _check(run, info, jobs=jobs)
    queue = Queue(out_dir, shard=shard_spec, overwrite=not skip_existing, fail_fast=fail_fast, resume=resume)
    rendering = bool(to_render(jobs, queue))  # resumed with every job rendered: no memory plan, nothing loads
    if rendering:
        run = _plan_memory(run, info, jobs, world, quiet)
    prepare_out_dir(out_dir)  # a file or a broken/looping symlink in the way: exit 2 before any rank starts
    if notice and not quiet and rendering:  # checked: the queue runs (--quiet keeps the queue's own log only)
        say(notice)
    end_status()
    return run_jobs(run, jobs, world, info.release.dit.num_attention_heads, quiet=quiet, queue=queue)


# ---------------------------------------------------------------------------------------------------------------------
# h3render presets / make-checkpoint

@cli.command("presets", short_help="List the canvas presets of the checkpoint.")
@click.option("--checkpoint", default=None, help="As on `prompt`: default $H3RENDER_CHECKPOINT, else the tiny model.")
def presets_command(checkpoint) -> None:
    """List the canvas presets with canvas, frames and packed row counts, for the checkpoint `prompt` would use."""

    def run() -> int:
        name = resolve_checkpoint(checkpoint, os.environ)[0]
        info = checkpoint_info(name)
        model = (f"the built-in {name} model (random weights)" if info.layout == "builtin" else
                 f"checkpoint {info.path}")
        for line in jobs_mod.preset_lines(info.limits(), model=model):
            print(line)
        return EXIT_OK

    sys.exit(_main_guard(run))


@cli.command("make-checkpoint", short_help="Write a random checkpoint (or FastH3 student) in a real on-disk layout.")
@click.argument("out", type=click.Path())  # checked by make_checkpoint.targets (a single file is a file)
@click.option("--config", "config", type=click.Choice(["tiny", "small"]), default="tiny", show_default=True)
@click.option("--layout", type=click.Choice(["official", "diffusers", "single-file"]), default="official",
              show_default=True, help="single-file: OUT is one .safetensors DiT (ComfyUI style, q/k/v stacked).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--adapter", type=click.Path(dir_okay=False), default=None,
              help="Also write a synthetic FastH3 adapter (fastvideo-lora-v2) for this config to this new file.")
@click.option("--adapter-kind", type=click.Choice(["dense", "vsa"]), default=None,
              help="The --adapter's kind: dense (default; no gates) or vsa (an attn.to_gate_compress.set_weight "
                   "gate per DiT block, as the VSA students carry).")
@click.option("--adapter-bundle", type=click.Path(file_okay=False), default=None,
              help="Also write the v1 LoRA bundle (vsa-datafree, vsa-synthetic-step1300, vsa-synthetic-step1900, "
                   "dense-datafree and adapter_manifest.json) to this new folder; pick one with --adapter-variant.")
@click.option("--student", type=click.Choice(["v2", "v1-vsa-datafree", "v1-vsa-synthetic-step1300",
                                              "v1-vsa-synthetic-step1900", "v1-dense-datafree"]), default=None,
              help="OUT is a full FastH3 student checkpoint instead: the base weights, the VSA gates in the "
                   "transformer (not for the dense student) and fastvideo_inference.json; render it with --mode "
                   "fasth3 (official or diffusers layout).")
def make_checkpoint_command(out, config, layout, seed, adapter, adapter_kind, adapter_bundle, student) -> None:
    """Write a random checkpoint in the real on-disk format (no downloads), and with the options every published
    FastH3 student kind for it: a dense or VSA adapter file, the v1 LoRA bundle, or a full student checkpoint."""

    def run() -> int:
        from h3render.make_checkpoint.targets import check_extras, check_output

        # Before anything is written or torch is imported (the writers check again).
        if adapter_kind is not None and adapter is None:
            raise SettingsError("--adapter-kind needs --adapter FILE")
        if student is not None and layout == "single-file":
            raise SettingsError(f"--student {student}: a full FastH3 student is a checkpoint folder; use --layout "
                                f"official or diffusers")
        if student is not None and (adapter or adapter_bundle):
            raise SettingsError(f"--student {student} writes a full FastH3 checkpoint, which takes no adapter; "
                                f"drop --adapter / --adapter-bundle")
        usage(check_output, out, layout)
        usage(check_extras, adapter, adapter_bundle, out)
        from h3render.make_checkpoint.writer import make_checkpoint, write_synthetic_full_student

        if student is not None:
            path = write_synthetic_full_student(out, student, config, layout, seed)
            print(f"h3render: wrote a random {config} FastH3 {student} student checkpoint ({layout} layout) to "
                  f"{path}; render it with --checkpoint {path} --mode fasth3", file=sys.stderr)
            return EXIT_OK
        path = make_checkpoint(out, config=config, layout=layout, seed=seed, adapter=adapter or None,
                               adapter_kind=adapter_kind or "dense", bundle=adapter_bundle or None)
        print(f"h3render: wrote a random {config} checkpoint ({layout} layout) to {path}", file=sys.stderr)
        if adapter:
            print(f"h3render: wrote a synthetic {adapter_kind or 'dense'} FastH3 adapter to {adapter}",
                  file=sys.stderr)
        if adapter_bundle:
            print(f"h3render: wrote a synthetic FastH3 v1 LoRA bundle to {adapter_bundle} (choose a variant with "
                  f"--adapter-variant)", file=sys.stderr)
        return EXIT_OK

    sys.exit(_main_guard(run))


def main() -> None:
    # First, before anything heavy is imported: from here on a signal gives 130 (75: SIGUSR1/2) and one line, not
    # click's "Aborted!"; one inside an import (torch's, 0.3-2 s) is held until the import is done.
    guard = ProcessGuard().install()
    try:
        code = cli.main(prog_name="h3render", standalone_mode=False)
    except click.Abort as exc:  # a signal while click itself ran (parsing), outside `_main_guard`
        cause = exc.__cause__ if isinstance(exc.__cause__, KeyboardInterrupt) else KeyboardInterrupt()
        print(f"h3render: interrupted ({signal_name(signum_of(cause))}) before any job started; nothing written",
              file=sys.stderr)
        code = error_exit_code(cause)
    except click.UsageError as exc:
        # One line, like every other usage error of ours (click's own format is its usage block, then the error).
        where = exc.ctx.command_path if exc.ctx is not None else "h3render"
        print(f"h3render: error: {exc.format_message()} (see '{where} --help')", file=sys.stderr)
        code = EXIT_USAGE
    except click.ClickException as exc:
        print(f"h3render: error: {exc.format_message()}", file=sys.stderr)
        code = exc.exit_code
    finally:
        guard.settle()  # the outcome is decided (also on sys.exit from a command): ignore signals until exit
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    main()
