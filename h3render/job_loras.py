"""A job's LoRAs (issue #25): the `loras:` manifest field and `--lora FILE[:STRENGTH]`, read into `LoraRef`s
before any weights load. Torch-free on import; reading a file's header (`checkpoint.lora.read_lora`) brings torch
along, once per distinct file.

Manifest form: ``loras: [{path: style.safetensors, strength: 0.8}, {path: turbo.safetensors}]`` (strength
defaults to 1; a plain string is a path at strength 1), per job or in the defaults (a job's own list replaces the
defaults'; ``loras: []`` on a job runs it without). Paths are relative to the manifest's folder (``~`` expanded).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3render.suggest import unknown_field

LORA_KEYS = ("path", "strength", "schedule")


@dataclass(frozen=True)
class LoraRef:
    """One LoRA of a job, checked: ``given`` (as written), ``path`` (resolved), ``strength``, the file's
    ``sha256``, ``format`` (`checkpoint.lora.FORMATS`), the number of native ``modules`` it changes, and
    ``schedule`` (the named preset an entry gives, or None)."""

    given: str
    path: str
    strength: float
    sha256: str
    format: str
    modules: int
    schedule: str | None = None
    turbo: bool = False  # it brings a schedule: `schedule` names a preset, or the file states one in its header

    def key(self) -> dict[str, Any]:
        """What identifies it in a job's resume key: content and strength (a rename re-renders nothing)."""
        out = {"sha256": self.sha256, "strength": self.strength}
        if self.schedule is not None:
            out["schedule"] = self.schedule
        return out


def parse_lora_option(text: str) -> dict[str, Any]:
    """``--lora FILE[:STRENGTH]`` -> ``{"path", "strength"}``; a tail after the last ':' that is not a number is
    part of the path (``C:\\x.safetensors``, ``a:b.safetensors``).

    Raises:
        ValueError: an empty path.
    """
    path, sep, tail = text.rpartition(":")
    strength = 1.0
    if sep:
        try:
            strength = float(tail)
        except ValueError:
            path = text
    else:
        path = text
    if not path.strip():
        raise ValueError(f"--lora {text!r}: no file before ':'")
    return {"path": path, "strength": strength}


def loras_field_problems(value: Any) -> list[tuple[str, str]]:
    """Why a `loras` value is malformed on its own (types, keys, finite strengths): every problem of every entry,
    each ``(at, message)``, `at` its place under the field: ``""`` the value, ``"[1]"`` entry 1, ``"[1].strength"``
    its key (the manifest reader prints ``loras[1].strength: ...`` on that line). [] when it is well-formed."""
    if not isinstance(value, list):
        return [("", f"must be a list of {{path, strength}} mappings, got {type(value).__name__}")]
    return [problem for i, item in enumerate(value) for problem in _entry_problems(i, item)]


def _entry_problems(i: int, item: Any) -> list[tuple[str, str]]:
    """Every problem of entry `i` on its own (not its file): a 500-job manifest's user wants them all at once."""
    if isinstance(item, str):
        return [] if item.strip() else [(f"[{i}]", "path must not be empty")]
    if not isinstance(item, dict):
        return [(f"[{i}]", f"must be a mapping {{path, strength}} or a path string, got {type(item).__name__}")]
    unknown = sorted(map(str, set(item) - set(LORA_KEYS)))
    problems = [(f"[{i}].{key}", unknown_field(key, LORA_KEYS)) for key in unknown]
    if not isinstance(item.get("path"), str) or not item["path"].strip():
        problems.append((f"[{i}].path", "must be a non-empty string"))
    strength = item.get("strength", 1.0)
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        problems.append((f"[{i}].strength", f"must be a finite number, got {strength!r}"))
    if "schedule" in item and not isinstance(item["schedule"], str):
        problems.append((f"[{i}].schedule", "must be a preset name (string)"))
    return problems


_READ: dict[tuple[str, float], Any] = {}


def read_header(path: Path):
    """`checkpoint.lora.read_lora`, once per (file, mtime)."""
    from h3render.checkpoint.lora import read_lora

    key = (str(path), path.stat().st_mtime)
    if key not in _READ:
        _READ[key] = read_lora(path)
    return _READ[key]


def resolve_loras(value: Any, base_dir: str | Path) -> tuple[tuple[LoraRef, ...], list[tuple[str, str]]]:
    """Read each well-formed entry of a `loras` value (one `loras_field_problems` finds nothing wrong with; the
    others are its to report): file present, header readable, every key placed (`checkpoint.lora.read_lora`),
    schedule preset known. Every entry is read, so one run names every missing file.

    Returns:
        (the refs, []) or ((), every problem as ``(at, message)``, as `loras_field_problems`'s: a file's problem at
        the entry's path (``"[i].path"``, or ``"[i]"`` for a plain path string), its message
        ``"<absolute path>: ..."``, as a reference's or a keyframe's).
    """
    if not isinstance(value, list):
        return (), []
    refs, problems = [], []
    for i, item in enumerate(value):
        if _entry_problems(i, item):
            continue
        ref, problem = _read_entry(i, item, base_dir)
        if problem is not None:
            problems.append(problem)
        else:
            refs.append(ref)
    return (() if problems else tuple(refs)), problems


def _read_entry(i: int, item: str | dict, base_dir: str | Path) -> tuple[LoraRef | None, tuple[str, str] | None]:
    """One well-formed entry's LoRA, or its problem ``(at, message)``."""
    at = f"[{i}]" if isinstance(item, str) else f"[{i}].path"
    item = {"path": item} if isinstance(item, str) else item
    given = item["path"]
    # Absolute in messages, as a reference's or a keyframe's: for `batch sub/m.yaml` a LoRA printed
    # `sub/x.safetensors` (relative to the working folder) beside references printed `/abs/sub/...` (a trial).
    path = (Path(base_dir) / os.path.expanduser(given)).absolute()
    if not path.is_file():
        head, colon, tail = str(given).rpartition(":")
        head_path = (Path(base_dir) / os.path.expanduser(head)).absolute()
        if colon and head_path.is_file():  # FILE:STRENGTH, mistyped
            try:
                float(tail)
                hint = f"give its strength as {{path: {head}, strength: {tail}}} (FILE:STRENGTH is --lora's)"
            except ValueError:
                return None, (at, f"{path}: the strength after ':' ({tail!r}) is not a number ({head_path} is the "
                                  f"file)")
            return None, (at, f"{path}: LoRA file not found; {head_path} is one, {hint}")
        return None, (at, f"{path}: LoRA file not found")
    schedule = item.get("schedule")
    if schedule is not None:
        from h3render.checkpoint.lora_schedule import PRESETS

        if schedule not in PRESETS:
            return None, (f"[{i}].schedule", f"{schedule!r} is not a turbo preset; one of {', '.join(PRESETS)}")
    try:
        lora = read_header(path.resolve())
    except ValueError as exc:  # LoraError: names the file and key
        return None, (at, str(exc))
    from h3render.checkpoint.lora_schedule import METADATA_KEY

    return LoraRef(given, str(path.resolve()), float(item.get("strength", 1.0)), lora.sha256, lora.format,
                   len(lora.modules), schedule, schedule is not None or METADATA_KEY in lora.metadata), None
