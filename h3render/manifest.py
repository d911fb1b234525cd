"""Manifests: the field layers of a JSONL or YAML file resolved into `Job`s, every problem reported at once.

Schema and error forms: docs/manifest.md. Each problem is one line `file:line: field: problem` (in YAML the field's
own line; a list entry's named `loras[1].strength`, on the entry's own line); the whole file is checked against the
checkpoint's `Limits` before anything loads. Reading the two file formats into layers is `h3render.manifest_formats`
(with `ManifestError`); `Job` and output names are in `h3render.jobs`, the canvas and time rules in `h3render.spec`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

from h3render.job_keyframes import KEYFRAME_FIELDS
from h3render.job_loras import resolve_loras
from h3render.jobs import (DEFAULT_MODE, DEFAULT_SEED, Job, Preset, Requested, Source, keyframe_problems,
                           load_presets, one_line, output_key, output_name, output_path_problem, prompt_slug)
from h3render.manifest_fields import (engine_choices, field_problems, keyframe_canvas, leading_keyframe,
                                      resolve_keyframes, resolve_references, strip_mp4)
from h3render.manifest_formats import Errors, Layer, ManifestError, Value, Where, read_jsonl, read_yaml
from h3render.outputs import lock_path, temp_paths
from h3render.spec import PRECISIONS, Limits, canvas_for_aspect, check_canvas, parse_aspect, snap_frames, video_rows
from h3render.suggest import unknown_field
from h3render.windows import DEFAULT_OVERLAP, check_window, plan_windows, resolve_frames

JOB_FIELDS = ("id", "prompt", "preset", "aspect", "width", "height", "duration", "frames", "seed", "steps", "mode",
              "output", "loras", *KEYFRAME_FIELDS, "keyframes", "window", "overlap", "references", "reference_audio")
# not in `defaults` or command-line defaults
JOB_ONLY_FIELDS = ("id", "prompt", "output", *KEYFRAME_FIELDS, "keyframes", "references")
# Engine settings (the weights load once per run): set in `defaults`; a job may repeat the run's value, never change it.
ENGINE_FIELDS = ("precision",)
# Only in the manifest's `defaults`; the command line's --adapter, --adapter-variant, --fasth3-positions win.
DEFAULTS_ONLY_FIELDS = ("adapter", "adapter_variant", "fasth3_positions")
DEFAULT_FIELDS = tuple(f for f in JOB_FIELDS if f not in JOB_ONLY_FIELDS) + ENGINE_FIELDS + DEFAULTS_ONLY_FIELDS
_KNOWN_FIELDS = JOB_FIELDS + ENGINE_FIELDS + DEFAULTS_ONLY_FIELDS
DEFAULT_PRECISION = PRECISIONS[0]
_CANVAS_FIELDS = ("preset", "aspect", "width", "height")
_TIME_FIELDS = ("duration", "frames")
_COMMAND_LINE = "<command line>"
# The option each list field comes from on the command line: a problem in one of its values names the option as
# typed (`--lora #1 (x.safetensors:0.8)`), not the manifest's `loras[0].path`, which a `prompt` user never wrote.
LIST_OPTIONS = {"loras": "--lora", "references": "--reference", "keyframes": "--keyframe"}


@dataclass(frozen=True)
class Manifest:
    """A validated manifest: its `path`, its resolved `jobs` in file order, the FastH3 `adapter` its defaults
    name (resolved against the manifest's folder; None when absent; a command-line `--adapter` takes precedence)
    with its `adapter_variant` and `fasth3_positions` (None when absent), and the run's `precision`: the command
    line's, else the defaults', else "bf16"."""

    path: Path
    jobs: list[Job]
    adapter: Path | None = None
    precision: str = DEFAULT_PRECISION
    adapter_variant: str | None = None
    fasth3_positions: str | None = None


def read_manifest(path: str | Path, limits: Limits, defaults_overrides: Mapping[str, Any] | None = None, *,
                  presets_dir: str | Path | None = None, adapter_available: bool | None = None,
                  precision: str | None = None, option_values: Mapping[str, list[str]] | None = None) -> Manifest:
    """Read a JSONL (`.jsonl`, `.ndjson`) or YAML (`.yaml`, `.yml`) manifest into resolved jobs, in file order.

    Precedence for each field: the job's own value, then `defaults_overrides` (command-line defaults; None values
    are ignored), then the manifest's `defaults`, then the preset in effect (canvas, duration), then `limits`.
    The whole manifest is validated before anything is returned. Schema: docs/manifest.md.

    Args:
        adapter_available: whether a FastH3 adapter is at hand without the manifest (`--adapter`, or a FastH3 V2
            checkpoint). False: each `mode: fasth3` job is an error unless the manifest's `defaults` name an
            `adapter`; True: t2va and fasth3 jobs may mix. None (default): not checked here.
        precision: the command line's `--precision` (None: the defaults' `precision`, else "bf16"); a job whose
            own `precision` differs from the run's is an error.
        option_values: the command-line values of a list field in `defaults_overrides`, as typed
            (`{"loras": ["x.safetensors:0.8"]}`), so that their problems name the option (`LIST_OPTIONS`).

    Raises:
        ManifestError: every problem found, one line each, naming file, line and field.
    """
    path = Path(path)
    errors = Errors()
    presets = _load_presets_for(errors, str(path), presets_dir)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".yaml", ".yml"):
        raise ManifestError([f"{path}: unknown manifest type {suffix or '(no extension)'!r}; use .jsonl (or .ndjson) "
                             f"or .yaml (or .yml)"])
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ManifestError([f"{path}: manifest not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError([f"{path}: cannot read manifest: {one_line(exc)}"]) from None
    reader = read_jsonl if suffix in (".jsonl", ".ndjson") else read_yaml
    defaults, job_layers = reader(text, str(path), errors)
    overrides = _command_line_layer(_COMMAND_LINE, defaults_overrides or {}, option_values or {})
    adapter = _manifest_adapter(defaults, path, errors)
    if adapter_available is not None:
        adapter_available = adapter_available or adapter is not None
    jobs = _resolve_all(job_layers, [overrides, defaults], limits, presets, errors, adapter_available)
    run_precision = _run_precision(precision, defaults, job_layers, errors)
    if not job_layers and not errors.found:
        errors.add(Where(str(path)), "the manifest has no jobs")
    errors.raise_if_any()
    return Manifest(path, jobs, adapter, run_precision, defaults.get("adapter_variant"),
                    defaults.get("fasth3_positions"))


def load_manifest(path: str | Path, limits: Limits, defaults_overrides: Mapping[str, Any] | None = None, *,
                  presets_dir: str | Path | None = None, adapter_available: bool | None = None) -> list[Job]:
    """`read_manifest(...).jobs`: the resolved jobs only. Raises `ManifestError` as `read_manifest` does."""
    return read_manifest(path, limits, defaults_overrides, presets_dir=presets_dir,
                         adapter_available=adapter_available).jobs


def job_from_fields(fields: Mapping[str, Any], limits: Limits, *, source: str = _COMMAND_LINE,
                    presets_dir: str | Path | None = None, adapter_available: bool | None = None,
                    option_values: Mapping[str, list[str]] | None = None) -> Job:
    """One job from a mapping of manifest fields (e.g. `h3render prompt "text" --aspect 16:9`), by the same
    rules as a manifest line. None values are ignored; `adapter_available` and `option_values` as for
    `read_manifest`.

    Raises:
        ManifestError: as `read_manifest`, with `source` in place of the file name.
    """
    errors = Errors()
    presets = _load_presets_for(errors, source, presets_dir)
    layer = _command_line_layer(source, fields, option_values or {})
    jobs = _resolve_all([layer], [], limits, presets, errors, adapter_available)
    errors.raise_if_any()
    return jobs[0]


def _command_line_layer(source: str, fields: Mapping[str, Any], option_values: Mapping[str, list[str]]) -> Layer:
    """`fields` (None values left out) as one layer; each list field in `option_values` labelled by its option:
    the field as `--lora`, its entry i as `--lora #i+1 (<value as typed>)` (`Layer.where`)."""
    layer = Layer(source, 0)
    for name, value in fields.items():
        if value is None:
            continue
        option, typed = LIST_OPTIONS.get(name), option_values.get(name)
        labels = None if option is None or typed is None else {
            "": option, **{f"[{i}]": f"{option} #{i + 1} ({text})" for i, text in enumerate(typed)}}
        layer.fields[name] = Value(value, 0, None, labels)
    return layer


def _run_precision(cli: str | None, defaults: Layer, job_layers: list[Layer], errors: Errors) -> str:
    """The run's precision (`--precision`, else the defaults', else "bf16"); a job that sets another one is an error
    naming where the run's came from (a job repeating the run's value is fine; a bad value is _check_layer's)."""
    if cli is None and "precision" not in defaults.fields and not any("precision" in j.fields for j in job_layers):
        return DEFAULT_PRECISION
    choices = engine_choices("precision")
    run, where = (cli, "--precision") if cli else (choices[0], "the default")
    if cli is None and defaults.get("precision") in choices:
        run, where = defaults.get("precision"), f"the defaults at {defaults.file}:{defaults.where('precision').line}"
    for job in job_layers:
        value = job.get("precision")
        if "precision" in job.fields and value in choices and value != run:
            errors.add(job.where("precision"), f"{value!r} differs from this run's precision {run!r} (from {where}): "
                       "precision is one engine setting for the whole run (the weights load once); remove it from "
                       "this job, or render the job in a batch of its own")
    return run


def _manifest_adapter(defaults: Layer, manifest: Path, errors: Errors) -> Path | None:
    """`defaults: adapter:` relative to the manifest's folder (a file, a variant folder or a LoRA bundle root, as
    --adapter); missing is an error now, not after the t2va jobs."""
    value = defaults.get("adapter")
    if not isinstance(value, str) or not value.strip():
        return None  # absent, or reported by _check_layer
    adapter = manifest.parent / os.path.expanduser(value)
    if not adapter.exists():
        errors.add(defaults.where("adapter"), f"no such file: {adapter}")
        return None
    return adapter


def _load_presets_for(errors: Errors, where: str, presets_dir: str | Path | None) -> dict[str, Preset]:
    try:
        return load_presets(presets_dir)
    except ValueError as exc:  # reported with the manifest's other problems; jobs naming a preset fail as unknown
        errors.add(Where(where), str(exc))
    return {}


def _check_layer(layer: Layer, presets: Mapping[str, Preset], limits: Limits, errors: Errors, *,
                 is_job: bool) -> bool:
    """Type- and value-check one level's fields; returns False when anything was wrong (the job is dropped)."""
    before = len(errors.found)
    for name in list(layer.fields):
        value = layer.get(name)
        where = layer.where(name)
        if name not in _KNOWN_FIELDS:
            errors.add(where, unknown_field(name, JOB_FIELDS + ENGINE_FIELDS if is_job else DEFAULT_FIELDS))
            continue
        if not is_job and name in JOB_ONLY_FIELDS:
            errors.add(where, "may only be set on a job, not in defaults")
            continue
        if name in DEFAULTS_ONLY_FIELDS and (is_job or layer.file == _COMMAND_LINE):
            flag = "--" + name.replace("_", "-")
            errors.add(where, "may only be set in the manifest's defaults" +
                       (f" (on the command line: {flag})" if layer.file == _COMMAND_LINE else ""))
            continue
        for problem in field_problems(name, value, presets, limits):
            errors.add(*layer.blame(name, problem))
    if "preset" in layer.fields and any(f in layer.fields for f in ("aspect", "width", "height")):
        errors.add(layer.where("preset"), "conflicts with aspect/width/height on the same level (a preset sets the "
                                          "canvas)")
    elif "aspect" in layer.fields and any(f in layer.fields for f in ("width", "height")):
        errors.add(layer.where("aspect"), "conflicts with width/height on the same level")
    elif ("width" in layer.fields) != ("height" in layer.fields):
        missing = "height" if "width" in layer.fields else "width"
        present = "width" if missing == "height" else "height"
        errors.add(layer.where(present), f"needs {missing} as well")
    elif "width" in layer.fields and not any(field_problems(f, layer.get(f), presets, limits)
                                             for f in ("width", "height")):
        try:
            check_canvas(layer.get("width"), layer.get("height"))
        except ValueError as exc:
            errors.add(layer.where("width"), str(exc))
    if "duration" in layer.fields and "frames" in layer.fields:
        errors.add(layer.where("duration"), "conflicts with frames on the same level; give one of them")
    if is_job and "prompt" not in layer.fields:
        errors.add(layer.where()._replace(field="prompt"), "missing (every job needs a prompt)")
    return len(errors.found) == before


def _first(layers: Iterable[Layer], names: Iterable[str]) -> Layer | None:
    names = tuple(names)
    return next((layer for layer in layers if any(n in layer.fields for n in names)), None)


def _resolve_all(job_layers: list[Layer], default_layers: list[Layer], limits: Limits,
                 presets: Mapping[str, Preset], errors: Errors, adapter_available: bool | None) -> list[Job]:
    defaults_ok = all([_check_layer(layer, presets, limits, errors, is_job=False) for layer in default_layers])
    resolved: list[tuple[Layer, dict[str, Any]]] = []
    for layer in job_layers:
        # Every job is checked even when the defaults are bad, and its files are read even when its fields are
        # bad, so one run reports every problem (a trial: a missing file showed up only once the typos were fixed).
        fields_ok = _check_layer(layer, presets, limits, errors, is_job=True) and defaults_ok
        files = _read_files(layer, [layer, *default_layers], errors)
        if not fields_ok or files is None:
            continue
        values = _resolve_job(layer, [layer, *default_layers], limits, presets, errors, adapter_available, files)
        if values is not None:
            resolved.append((layer, values))
    repeated_ids = _check_ids(job_layers, errors)
    names = _assign_outputs(resolved, repeated_ids, errors)
    if errors.found:
        return []
    return [Job(source=Source(layer.file, layer.line), output=name, **values)
            for (layer, values), name in zip(resolved, names)]


class _Files(NamedTuple):
    """What a job's files resolved to (`_read_files`)."""

    keyframes: dict[str, Any]  # Job keyword arguments: first_frame, last_frame, frame_keyframes
    placed: list  # ((field, at), KeyframeRef) for each keyframe: where to blame one past the clip's end
    references: tuple
    loras: tuple
    loras_layer: Layer | None  # the level the job's `loras` come from


def _read_files(job: Layer, layers: list[Layer], errors: Errors) -> _Files | None:
    """Read every file the job names, relative to the manifest's folder (keyframe images, references; LoRAs from
    the level its `loras` come from), each well-formed entry even when other fields are wrong; None when a file
    was missing or bad (each reported on its own entry)."""
    base_dir = "." if job.file == _COMMAND_LINE else os.path.dirname(job.file) or "."
    keyframes, problems, placed = resolve_keyframes({f: job.get(f) for f in (*KEYFRAME_FIELDS, "keyframes")
                                                     if f in job.fields}, base_dir)
    for name, problem in problems:
        errors.add(*job.blame(name, problem))
    failed = bool(problems)
    references: tuple = ()
    if "references" in job.fields:  # ref2va: every file probed now, in order; they never set the canvas
        audio_layer = _first(layers, ["reference_audio"])
        use_audio = audio_layer.get("reference_audio") if audio_layer else True
        references, problems = resolve_references(job.get("references"), base_dir, use_audio is not False)
        for problem in problems:
            errors.add(*job.blame("references", problem))
        failed = failed or bool(problems)
    loras: tuple = ()
    loras_layer = _first(layers, ["loras"])  # a job's own list replaces the defaults' (`[]`: none)
    if loras_layer is not None:
        file = loras_layer.file
        loras, problems = resolve_loras(loras_layer.get("loras"),
                                        "." if file == _COMMAND_LINE else os.path.dirname(file) or ".")
        for problem in problems:  # the defaults' are one line each, not one per job (`Errors.add`)
            errors.add(*loras_layer.blame("loras", problem))
        failed = failed or bool(problems)
    return None if failed else _Files(keyframes, placed, references, loras, loras_layer)


def _resolve_job(job: Layer, layers: list[Layer], limits: Limits, presets: Mapping[str, Preset],
                 errors: Errors, adapter_available: bool | None, files: _Files) -> dict[str, Any] | None:
    """Apply precedence to one checked job whose files were read; returns Job keyword arguments (without
    output/source) or None."""
    requested: dict[str, Any] = {}
    keyframes, references = files.keyframes, files.references
    if references and keyframes:
        errors.add(job.where("references"), "references (ref2va) and keyframes (fl2va: first_frame, last_frame, "
                                            "keyframes) cannot be combined in one job")
        return None
    canvas_layer = _first(layers, _CANVAS_FIELDS)
    preset = None
    if canvas_layer is None and keyframes:  # the canvas follows the leading keyframe (first given)
        leading = leading_keyframe(keyframes)
        requested["canvas_from"] = f"{leading.label}'s aspect ({leading.width}x{leading.height})"
        width, height = keyframe_canvas(leading, limits)
    elif canvas_layer is None:
        width, height = limits.default_canvas
    elif "preset" in canvas_layer.fields:
        preset = presets[canvas_layer.get("preset")]
        requested["preset"] = preset.name
        width, height = preset.canvas(limits)
    elif "aspect" in canvas_layer.fields:
        requested["aspect"] = canvas_layer.get("aspect")
        width, height = canvas_for_aspect(*parse_aspect(requested["aspect"]), short_edge=limits.canvas_short_edge,
                                          max_pixels=limits.canvas_max_pixels)
    else:
        width, height = canvas_layer.get("width"), canvas_layer.get("height")
        requested.update(width=width, height=height)

    time_layer = _first(layers, _TIME_FIELDS)
    window = None  # past one pass: the longest window of a windowed continuation (h3render.windows)
    field = None
    try:
        if time_layer is not None:
            field = "duration" if "duration" in time_layer.fields else "frames"
            where = time_layer.where(field)
            requested.update(duration=time_layer.get("duration"), frames=time_layer.get("frames"))
            frames, window = resolve_frames(time_layer.get("frames"), time_layer.get("duration"), limits)
        elif preset is not None:
            where = f"{canvas_layer.where('preset')} (preset {preset.name})"
            requested.update(duration=preset.duration, frames=preset.frames)
            frames = preset.snapped_frames(limits)
        else:
            where = job.where()
            frames = snap_frames(limits.default_frames, None, limits)
    except ValueError as exc:
        # spec's messages start with what was asked ("frames 3 snaps to ..."), which the location names already
        text = str(exc)
        errors.add(where, text[len(field) + 1:] if field and text.startswith(f"{field} ") else text)
        return None
    problems = keyframe_problems(tuple(ref for _, ref in files.placed), frames)
    for position, problem in problems:  # on its entry (`keyframes[2]`), as the list's other problems
        name, at = files.placed[position][0]
        errors.add(job.where(name, at), problem)
    if problems:
        return None
    overlap = 0
    if window is not None:  # a long clip: its window and overlap (h3render.windows), the defaults unless set
        window_layer, overlap_layer = _first(layers, ["window"]), _first(layers, ["overlap"])
        window = window_layer.get("window") if window_layer else window
        overlap = overlap_layer.get("overlap") if overlap_layer else DEFAULT_OVERLAP
        try:
            check_window(window, overlap)
            if not limits.min_frames <= window <= limits.max_frames:
                raise ValueError(f"window {window} is outside this checkpoint's range {limits.min_frames}–"
                                 f"{limits.max_frames} frames")
        except ValueError as exc:
            blame = window_layer or overlap_layer
            errors.add(blame.where("window" if window_layer else "overlap") if blame else where, str(exc))
            return None
    if window is not None and references:
        errors.add(job.where("references"), f"ref2va renders one pass (at most {limits.max_frames} frames); this "
                                            f"clip of {frames} frames needs windows: shorten it")
        return None
    pass_frames = frames if window is None else max(w.frames for w in plan_windows(frames, window, overlap))
    rows = video_rows(width, height, pass_frames)
    if rows > limits.max_video_rows:  # canvas x time: refused before load, not minutes into a render
        blame = (canvas_layer.where(next(f for f in _CANVAS_FIELDS if f in canvas_layer.fields))
                 if canvas_layer is not None else where)
        errors.add(blame, f"canvas {width}x{height} at {pass_frames} frames is {rows:,} packed video rows, more than this "
                          f"checkpoint's limit of {limits.max_video_rows:,} (Limits.max_video_rows)")
        return None

    mode_layer = _first(layers, ["mode"])
    mode = mode_layer.get("mode") if mode_layer else DEFAULT_MODE
    steps_layer = _first(layers, ["steps"])
    if mode == "fasth3" and adapter_available is False:
        origin = mode_layer.where("mode")
        inherited = ("" if mode_layer is job else " (from --mode)" if origin.file == _COMMAND_LINE
                     else f" (from the defaults at {origin.file}:{origin.line})")
        errors.add(job.where("mode"), f"fasth3{inherited} needs a FastH3 adapter and none is given: pass --adapter "
                                      f"PATH, or name one in the manifest's defaults (adapter: PATH)")
        return None
    if mode == "fasth3" and keyframes:
        origin = mode_layer.where("mode")
        named = f" {job.get('id')!r}" if job.get("id") else ""
        given = next(f for f in job.fields if f in (*KEYFRAME_FIELDS, "keyframes"))
        errors.add(job.where(given), f"job{named} is fl2va (keyframes given) but its mode is fasth3"
                   f"{'' if mode_layer is job else f' (from {origin})'}: FastH3 students are t2va-only; render it "
                   f"with mode t2va")
        return None
    if mode == "fasth3" and references:
        origin = mode_layer.where("mode")
        errors.add(job.where("references"), f"the job is ref2va (references given) but its mode is fasth3"
                   f"{'' if mode_layer is job else f' (from {origin})'}: FastH3 students are t2va-only; render it "
                   f"with mode t2va")
        return None
    # The student only works on the schedule it was distilled for, which comes with the adapter: a steps inherited
    # from defaults does not apply, one on the job itself is a mistake.
    if mode == "fasth3" and "steps" in job.fields:
        errors.add(job.where("steps"), "mode fasth3 runs the FastH3 adapter's fixed distilled schedule; remove steps")
        return None
    steps = None if mode == "fasth3" else steps_layer.get("steps") if steps_layer else limits.default_steps
    loras, loras_layer = files.loras, files.loras_layer
    if references and any(ref.strength != 0 for ref in loras):  # it rendered without them, silently (a trial)
        fix = ("drop --lora" if loras_layer.file == _COMMAND_LINE else "remove its loras" if loras_layer is job else
               f"give it loras: [] over the defaults' ({loras_layer.where('loras')})")
        errors.add(job.where("references"), f"LoRAs apply to t2va and fl2va jobs; this ref2va job runs the Ref2VA "
                                            f"DiT, which takes none yet ({fix})")
        return None
    if any(ref.turbo and ref.strength != 0 for ref in loras):  # it runs its LoRA's own schedule (docs/lora.md)
        if "steps" in job.fields:
            errors.add(job.where("steps"), "a turbo LoRA of this job brings its own schedule; remove steps")
            return None
        steps = None
    seed_layer = _first(layers, ["seed"])
    return dict(loras=loras, id=job.get("id"), prompt=job.get("prompt"), width=width, height=height, frames=frames,
                seed=seed_layer.get("seed") if seed_layer else DEFAULT_SEED, steps=steps, mode=mode,
                requested=Requested(**requested), references=references, window=window, overlap=overlap,
                **keyframes)


def _check_ids(job_layers: list[Layer], errors: Errors) -> set[int]:
    """Report repeated ids, compared in Unicode NFC (NFC "café" and NFD "café" look alike and are one id);
    returns the `id()` of each repeating layer."""
    first_line: dict[str, Where] = {}
    repeats = set()
    for layer in job_layers:
        job_id = layer.get("id")
        if not isinstance(job_id, str):
            continue
        key = output_name(job_id)
        if key in first_line:
            errors.add(layer.where("id"), f"duplicate id {job_id!r} (first at {first_line[key].file}:"
                                          f"{first_line[key].line})")
            repeats.add(id(layer))
        else:
            first_line[key] = layer.where()
    return repeats


def _assign_outputs(resolved: list[tuple[Layer, dict[str, Any]]], repeated_ids: set[int],
                    errors: Errors) -> list[str]:
    """Output names: explicit `output`, else the id, else a prompt slug made unique with -2, -3, …

    Names are written in Unicode NFC and compared by `output_key` (NFC, case-folded: macOS and Windows file
    systems fold case, and NFC/NFD spellings look alike); explicit names that clash are errors, automatic names
    step aside.
    """
    taken: dict[str, str] = {}
    names: list[str | None] = []
    for layer, values in resolved:
        name_field = "output" if "output" in layer.fields else "id" if "id" in layer.fields else None
        if name_field is None:
            names.append(None)
            continue
        name = output_name(strip_mp4(layer.get(name_field)))
        problem = output_path_problem(name)
        if problem:  # an output's own problems were reported by _check_layer; an id used as a name is checked here
            if name_field == "id":
                errors.add(layer.where("id"), f"cannot serve as the output name ({problem}); set output")
            names.append(None)
            continue
        key = output_key(name)
        if key in taken:
            if name_field == "id" and id(layer) in repeated_ids:  # already reported as a duplicate id
                names.append(name)
                continue
            errors.add(layer.where(name_field), f"output {name!r} is also written by the job at {taken[key]}")
        else:
            taken[key] = f"{layer.file}:{layer.line}"
        names.append(name)
    for index, (layer, values) in enumerate(resolved):
        if names[index] is not None:
            continue
        counter = 1
        name = prompt_slug(values["prompt"], values["seed"])
        while output_key(name) in taken:
            counter += 1
            name = prompt_slug(values["prompt"], values["seed"], counter=counter)
        taken[output_key(name)] = f"{layer.file}:{layer.line}"
        names[index] = name
    _check_folders(resolved, names, errors)
    return names


def _check_folders(resolved: list[tuple[Layer, dict[str, Any]]], names: list[str], errors: Errors) -> None:
    """A job's folder may not be another job's file: output "a.mp4/x" needs a folder where job "a" writes its MP4
    (or its sidecar, temps or lock), so whichever renders second would fail. Found here, before anything renders."""
    files: dict[str, tuple[str, Layer]] = {}
    for (layer, _), name in zip(resolved, names):
        mp4, sidecar = Path(name + ".mp4"), Path(name + ".json")
        for path in (mp4, sidecar, *temp_paths(mp4, sidecar), lock_path(mp4)):
            files.setdefault(output_key(path.as_posix()), (path.as_posix(), layer))
    for (layer, _), name in zip(resolved, names):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if output_key(folder) in files:
                path, other = files[output_key(folder)]
                field = "output" if "output" in layer.fields else "id"
                errors.add(layer.where(field), f"{name!r} needs a folder {folder!r}, which is the file {path} "
                                               f"of the job at {other.file}:{other.line}")
                break

