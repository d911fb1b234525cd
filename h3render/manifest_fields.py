"""Manifest fields on their own: each value's type and range (`field_problems`), and the files a job names read
(keyframes into `KeyframeRef`s: `resolve_keyframes`; references: `resolve_references`). `h3render.manifest` applies
them to every level of a manifest and adds `file:line: field:` to each problem.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from h3render.job_loras import loras_field_problems
from h3render.job_keyframes import (ANCHOR_OF_FIELD, KEYFRAME_FIELDS, KeyframeRef, parse_keyframe_spec,
                                    read_keyframe_ref)
from h3render.job_references import (ReferenceRef, entry_problems, read_reference, references_problem,
                                     unsupported_problems)
from h3render.jobs import MAX_SEED, MODES, Preset, lone_surrogate, output_path_problem
from h3render.spec import (CANVAS_MULTIPLE, POSITION_CHOICES, PRECISIONS, Limits, canvas_for_aspect, is_int,
                           parse_aspect)

STRING_FIELDS = ("id", "prompt", "preset", "aspect", "mode", "output", "adapter", "adapter_variant",
                 "fasth3_positions", "precision", *KEYFRAME_FIELDS)
# Integers longer than this are never a valid value of any field (the largest, a seed, has 20 digits); they are kept
# as their digit count, so a 5,001-digit number is a field error rather than Python's int-conversion ValueError.
MAX_INT_DIGITS = 100


class TooLong(NamedTuple):
    """An integer literal too long to be any field's value."""

    digits: int  # an integer literal of more than MAX_INT_DIGITS digits, kept as its digit count



def field_problems(name: str, value: Any, presets: Mapping[str, Preset], limits: Limits) -> list:
    """Why one field's value is wrong on its own (type, range, known name); [] when it is not. A list field
    (`loras`, `references`, `keyframes`) gives every bad entry's problems (a 500-job manifest's user wants them all
    at once), each ``(at, message)``, `at` its place under the field (``"[1]"``, ``"[1].strength"``), which
    `manifest_formats.Layer.blame` prints as ``loras[1].strength`` on its own line. Files are read later, by
    `resolve_keyframes`, `resolve_references` and `job_loras.resolve_loras`, for the entries well-formed here."""
    if isinstance(value, TooLong):
        return [f"an integer of {value.digits:,} digits is out of range"]
    if name == "loras":
        return loras_field_problems(value)
    if name == "references":
        if not isinstance(value, list) or not value:
            return [f"must be a non-empty list of reference files, got {type_name(value)}"]
        return [(f"[{i}]{at}", message) for i, entry in enumerate(value) for at, message in entry_problems(entry)]
    if name == "keyframes":
        if not isinstance(value, list) or not value:
            return ['must be a non-empty list of "FRAME:IMAGE" strings (e.g. ["0:first.png", "240:mid.png"])']
        problems = []
        for index, item in enumerate(value):
            try:
                parse_keyframe_spec(item)
            except ValueError as exc:
                problems.append((f"[{index}]", str(exc)))
        return problems
    problem = _value_problem(name, value, presets, limits)
    return [problem] if problem else []


def _value_problem(name: str, value: Any, presets: Mapping[str, Preset], limits: Limits) -> str | None:
    """Why the value of a field that is not a list is wrong on its own, or None."""
    if name in STRING_FIELDS and not isinstance(value, str):
        return f"must be a string, got {type_name(value)}"
    if name in STRING_FIELDS and lone_surrogate(value):  # a prompt would fail every job at the warm-up's encode
        return lone_surrogate(value)
    if name in ("id", "prompt", "adapter", "adapter_variant", *KEYFRAME_FIELDS) and not value.strip():
        return "must not be empty"
    if name in ("precision", "fasth3_positions") and value not in engine_choices(name):
        return f"{value!r} is not one of {', '.join(engine_choices(name))}"
    if name == "prompt" and len(value) > limits.max_prompt_chars:
        return (f"{len(value):,} characters is longer than this checkpoint's limit of {limits.max_prompt_chars:,} "
                f"characters")
    if name == "id" and any(ord(c) < 32 for c in value):
        return "must not contain control characters"
    if name == "preset" and value not in presets:
        known = ", ".join(sorted(presets)) or "(none found)"
        return f"unknown preset {value!r}; available: {known}"
    if name == "aspect":
        try:
            canvas_for_aspect(*parse_aspect(value))
        except ValueError as exc:
            return str(exc)
    if name in ("width", "height"):
        if not is_int(value):
            return f"must be an integer number of px, got {type_name(value)}"
        if value <= 0 or value % CANVAS_MULTIPLE:
            return f"{value} is not a positive multiple of {CANVAS_MULTIPLE}"
    if name == "duration":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number of seconds, got {type_name(value)}"
        if not math.isfinite(value) or value <= 0:
            return f"{value} must be a positive number of seconds"
    if name in ("window", "overlap") and (not is_int(value) or value <= 0):
        return f"must be a positive integer number of frames (17n + 5), got {value!r}"
    if name in ("frames", "seed", "steps") and not is_int(value):
        return f"must be an integer{' number of sigma points' * (name == 'steps')}, got {type_name(value)}"
    if name == "frames" and value <= 0:
        return f"{value} must be positive"
    if name == "seed" and not 0 <= value <= MAX_SEED:
        return f"{value} is outside 0 … 2**64-1"
    if name == "steps":
        if value < 2:
            return f"{value} sigma points is too few (at least 2: N points run N-1 forwards)"
        if value > limits.max_sigma_points:
            return f"{value} sigma points is more than this checkpoint's limit of {limits.max_sigma_points:,}"
    if name == "reference_audio" and not isinstance(value, bool):
        return f"must be true or false, got {type_name(value)}"
    if name == "mode" and value not in MODES:
        return f"{value!r} is not one of {', '.join(MODES)}"
    if name == "output":
        problem = output_path_problem(strip_mp4(value))
        if problem:
            return problem
    return None


def engine_choices(name: str) -> tuple[str, ...]:
    """The values an engine-level field takes, from their one home: `precision` (`spec.PRECISIONS`, "bf16" first:
    the default) or `fasth3_positions` (`spec.POSITION_CHOICES`)."""
    return PRECISIONS if name == "precision" else POSITION_CHOICES


def type_name(value: Any) -> str:
    return {bool: "a boolean", type(None): "null", list: "a list", dict: "a mapping", str: "a string",
            float: "a decimal number", int: "an integer"}.get(type(value), type(value).__name__)


def strip_mp4(output: str) -> str:
    return output[:-4] if output.lower().endswith(".mp4") else output


def resolve_keyframes(values: Mapping[str, Any], base_dir: str | Path) -> tuple[dict[str, Any], list[tuple], list]:
    """Read the keyframe fields a job sets (`{"first_frame": "a.png", ...}`, paths relative to `base_dir`): every
    well-formed one (`field_problems` reports the others), so one pass reports every missing or bad file.

    Returns:
        `({field: KeyframeRef or, for keyframes, a tuple of them}, [(field, problem), ...], placed)`: a `keyframes`
        entry's problem is ``("[i]", message)``, as `field_problems`'s; `placed` pairs each ref read with its place
        ``(field, at)`` (``("keyframes", "[2]")``), first_frame, last_frame, then the keyframes by frame, so that a
        problem found later (a frame past the clip's end) names its entry.
    """
    refs, problems, placed = {}, [], []
    for name in KEYFRAME_FIELDS:
        if isinstance(values.get(name), str) and values[name].strip():
            try:
                refs[name] = read_keyframe_ref(values[name], ANCHOR_OF_FIELD[name], base_dir)
                placed.append(((name, ""), refs[name]))
            except ValueError as exc:
                problems.append((name, str(exc)))
    if isinstance(values.get("keyframes"), list):  # ["240:mid.png", ...]: Job.frame_keyframes, ascending
        specs = []
        for given, value in enumerate(values["keyframes"]):
            try:
                specs.append((parse_keyframe_spec(value), given))
            except ValueError:
                continue  # field_problems' to report
        at = []
        for (index, path), given in sorted(specs):
            try:
                at.append(read_keyframe_ref(path, index, base_dir))
                placed.append((("keyframes", f"[{given}]"), at[-1]))
            except ValueError as exc:
                problems.append(("keyframes", (f"[{given}]", str(exc))))
        refs["frame_keyframes"] = tuple(at)
    return refs, problems, placed


def resolve_references(entries: Any, base_dir: str | Path, use_audio: bool = True) -> tuple[
        tuple[ReferenceRef, ...], list]:
    """Read a job's `references` list in order, paths relative to `base_dir`: every well-formed entry
    (`field_problems` reports the others); `use_audio` False (`reference_audio: false`, `--reference-no-audio`)
    drops the videos' soundtracks unless an entry says `audio: true`.

    Returns:
        `(refs, problems)`: every entry's problem (``("[i]", "<path>: ...")``, as `field_problems`'s, also for a type
        h3render cannot render yet), and once every entry was read the list's own (the counts, audio alone).
    """
    if not isinstance(entries, list):
        return (), []
    refs, problems, complete = [], [], True
    for index, entry in enumerate(entries):
        if entry_problems(entry):
            complete = False
            continue
        try:
            refs.append(read_reference(entry, base_dir, no_audio=not use_audio))
        except ValueError as exc:
            problems.append((f"[{index}]", str(exc)))
    if problems or not complete:
        return (), problems
    problem = references_problem(refs)
    problems = ([problem] if problem else []) + unsupported_problems(refs)
    return (() if problems else tuple(refs)), problems


def leading_keyframe(refs: Mapping[str, Any]) -> KeyframeRef:
    """The keyframe that sets an fl2va job's canvas when it names none: the earliest one (first_frame, else the
    lowest `keyframes:` index, else last_frame), as diffusers' leading `image`."""
    for name in ("first_frame", "frame_keyframes", "last_frame"):
        ref = refs.get(name)
        if ref:
            return ref[0] if isinstance(ref, tuple) else ref
    raise ValueError("no keyframe given")


def keyframe_canvas(leading: KeyframeRef, limits: Limits) -> tuple[int, int]:
    """The canvas of an fl2va job that names none: the checkpoint's canvas rule at the leading keyframe's aspect
    ratio (released: a 4:3 picture -> 1024 x 768), as diffusers' `MiniMaxH3ResizeStep` does."""
    return canvas_for_aspect(leading.width, leading.height, short_edge=limits.canvas_short_edge,
                             max_pixels=limits.canvas_max_pixels)
