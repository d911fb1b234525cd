"""Render jobs: the frozen `Job` a manifest line becomes, and the rules that resolve it before anything loads.

A job reads top to bottom: manifest line → `Job` → encode → pack → denoise → decode → write. This module owns the
job side of the first arrow: `Job`, the canvas presets in the repository's `presets/` folder, output names, the
`--dry-run` plan and the encoder options checked up front. A checkpoint's `Limits` and the canvas and time rules
(`parse_aspect`, `check_canvas`, `snap_frames`) are `h3render.spec`'s; the split of a batch into shards is
`h3render.shards`; fl2va keyframe files are checked by `h3render.job_keyframes`; the manifest formats (JSONL and
YAML) and their `file:line: field: problem` errors are `h3render.manifest`'s.

Units: canvas in pixels (width × height, both multiples of 32), time in frames at the fixed 24 fps or in seconds,
`steps` in sigma points of the schedule (N points → N − 1 forwards).
"""

from __future__ import annotations

import difflib
import hashlib
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

import h3render.presets
from h3render.job_keyframes import KeyframeRef
from h3render.job_references import ReferenceRef
from h3render.job_loras import LoraRef
from h3render.outputs import TEMP_MARK
from h3render.spec import (FPS, RELEASED_MAX_PIXELS, RELEASED_SHORT_EDGE, X264_PRESETS, Limits, audio_rows,
                           canvas_for_aspect, check_canvas, is_snapped, latent_frames, parse_aspect, seconds_text,
                           snap_frames, video_rows)
from h3render.windows import MAX_CLIP_FRAMES, Window, check_window, plan_note, plan_windows

# --- h3render choices (docs/manifest.md) ---------------------------------------------------------------------------
MODES = ("t2va", "fasth3")  # the sampler: base model or distilled FastH3 student (t2va-only)
DEFAULT_MODE = "t2va"
DEFAULT_SEED = 0  # a fixed value, so a manifest without seeds renders the same twice
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts 0 … 2**64 − 1
MAX_AUTO_NAME_BYTES = 120  # automatic output names (prompt slug + seed) stay at most this long
MAX_NAME_COMPONENT_BYTES = 200  # a path component of an explicit output; leaves room for ".tmp.json" under 255
# A whole output path: Linux's PATH_MAX is 4,096 bytes with the out dir and the ".tmp.mp4" suffix; 1,024 leaves the
# out dir about 3,000 (a longer out dir is caught per job: outputs.render_reason).
MAX_OUTPUT_BYTES = 1024
REPORT_STEM = "batch-report"  # batch.py writes <out_dir>/batch-report*.json: no job may own that name

# The repository's presets/ folder, shipped in the wheel as the data package h3render.presets (pyproject.toml).
PRESETS_DIR = Path(h3render.presets.__file__).resolve().parent

_PRESET_FIELDS = ("description", "aspect", "width", "height", "duration", "frames")

_FORBIDDEN_NAME_CHARS = set('<>:"|?*\\')  # not portable in file names (Windows) or separators in disguise
# Control (Cc: C0, DEL and C1), format (Cf: bidi overrides such as U+202E that display "gpj.exe" as "exe.jpg",
# zero-width characters, BOM) and line/paragraph separators: invisible or reordering in a listing, so two names that
# look alike differ, or a name shows as another.
_INVISIBLE = {"Cc", "Cf", "Zl", "Zp"}
_WINDOWS_DEVICE_NAMES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)),
                         *(f"lpt{i}" for i in range(1, 10))}


class Source(NamedTuple):
    """Where a job came from: the manifest file and the 1-based line of the job (0 when not from a file)."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass(frozen=True)
class Requested:
    """What the user asked for, before snapping and defaults; kept for the log ("10 s → 243 frames = 10.125 s").

    All fields None when the job took the checkpoint's defaults. `aspect` is the text given ("16:9"); `width` and
    `height` are set only for an explicit canvas; `duration` in s; `canvas_from` names the keyframe whose aspect
    set the canvas of an fl2va job that named none ("first frame's aspect (640x480)").
    """

    preset: str | None = None
    aspect: str | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    frames: int | None = None
    canvas_from: str | None = None


@dataclass(frozen=True)
class Job:
    """One render: everything the pipeline needs, already validated and resolved.

    Attributes:
        id: the manifest's id, or None.
        prompt: the text prompt, verbatim.
        width, height: canvas in px, multiples of 32.
        frames: frame count at 24 fps, of the form 17n + 5.
        seed: seed of the CPU generator that draws the noise (0 … 2**64 − 1).
        steps: sigma points of the base schedule (N points → N − 1 DiT forwards); None for "fasth3" jobs, whose
            fixed few-step schedule comes with the FastH3 adapter (4 forwards; 8 for the V2 checkpoint).
        mode: "t2va" (base sampler) or "fasth3" (distilled FastH3 student).
        output: relative POSIX path without extension; the MP4 is `<out_dir>/<output>.mp4`, the sidecar
            `<out_dir>/<output>.json`.
        requested: what the user asked for (`Requested`).
        source: manifest file and line, for messages.
        first_frame, last_frame: fl2va keyframe files (`h3render.job_keyframes.KeyframeRef`), or None; either one
            makes the job's `task` "fl2va".
        references: ref2va reference files in request order (`h3render.job_references.ReferenceRef`); any makes
            the job's `task` "ref2va".
        frame_keyframes: keyframes anchored at frame indices (`keyframes:` / `--keyframe 240:mid.png`), ascending;
            any makes the job fl2va. Index 0 is a first frame, index frames - 1 a last frame, bit for bit.
        window, overlap: a clip longer than one pass (`h3render.windows`): the longest window (17n + 5 frames) and
            the frames windows share (17j + 5); `frames` is then the clip's exact frame count (not snapped) and the
            job's `task` "continuation". None / 0 for a one-pass job.
        loras: the job's LoRAs, stacked (`h3render.job_loras.LoraRef`: file, strength, sha256), applied to the
            resident DiT for this job only.
    """

    id: str | None
    prompt: str
    width: int
    height: int
    frames: int
    seed: int
    steps: int | None
    mode: str
    output: str
    requested: Requested = field(default_factory=Requested)
    source: Source = Source("<job>", 0)
    first_frame: KeyframeRef | None = None
    last_frame: KeyframeRef | None = None
    references: tuple[ReferenceRef, ...] = ()
    frame_keyframes: tuple[KeyframeRef, ...] = ()
    window: int | None = None
    overlap: int = 0
    loras: tuple[LoraRef, ...] = ()

    def __post_init__(self) -> None:
        check_canvas(self.width, self.height)
        if self.window is not None:
            check_window(self.window, self.overlap)
            if not self.window < self.frames <= MAX_CLIP_FRAMES:
                raise ValueError(f"Job {self.output!r}: a windowed clip has {self.window + 1}..{MAX_CLIP_FRAMES} "
                                 f"frames, got {self.frames}")
        elif not is_snapped(self.frames):
            raise ValueError(f"Job {self.output!r}: frames {self.frames} is not of the form 17n+5")
        if self.mode not in MODES:
            raise ValueError(f"Job {self.output!r}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "fasth3" and self.task == "fl2va":
            raise ValueError(f"Job {self.output!r}: FastH3 students are t2va-only; an fl2va job needs mode t2va")
        if self.references and self.keyframes:
            raise ValueError(f"Job {self.output!r}: references (ref2va) and keyframes (fl2va) cannot be combined")
        if self.mode == "fasth3" and self.references:
            raise ValueError(f"Job {self.output!r}: FastH3 students are t2va-only; a ref2va job needs mode t2va")
        if self.references and any(ref.strength != 0 for ref in self.loras):  # the LoRA state covers the base DiT
            raise ValueError(f"Job {self.output!r}: LoRAs apply to t2va and fl2va jobs; a ref2va job (references) "
                             f"runs the Ref2VA DiT, which takes none yet")
        problem = output_path_problem(self.output)
        if problem:
            raise ValueError(f"Job output {self.output!r}: {problem}")
        problems = keyframe_problems(self.keyframes, self.frames)
        if problems:
            raise ValueError(f"Job {self.output!r}: {problems[0][1]}")
        if self.references and self.window is not None:
            raise ValueError(f"Job {self.output!r}: ref2va renders one pass (at most {self.window} frames here); "
                             f"references with a longer clip are not supported")

    def params(self) -> dict[str, Any]:
        """Everything that determines the rendered output, as plain JSON values: the resume key and the sidecar's
        `"job"` entry. The output name and the manifest position are not part of it. An fl2va job adds `task` and
        each keyframe's content hash (`first_frame_sha256`, `last_frame_sha256`): editing a picture re-renders the
        job, renaming it does not (its path is in the sidecar's `extra.fl2va`)."""
        params = {"prompt": self.prompt, "seed": self.seed, "width": self.width, "height": self.height,
                  "frames": self.frames, "steps": self.steps, "mode": self.mode}
        if self.keyframes:  # the pictures' content, not their paths
            params["task"] = "fl2va"
            params.update({f"{k.anchor}_frame_sha256": k.sha256 for k in (self.first_frame, self.last_frame) if k})
            if self.frame_keyframes:
                params["keyframes"] = [[k.anchor, k.sha256] for k in self.frame_keyframes]
        if self.references:  # order, type, content and the sound used; not the paths
            params["task"] = "ref2va"
            params["references"] = [r.params() for r in self.references]
        if self.window is not None:
            params.update(task="continuation", window=self.window, overlap=self.overlap)
        active = [ref.key() for ref in self.loras if ref.strength != 0]  # strength 0 renders as no LoRA
        if active:
            params["loras"] = active
        return params

    @property
    def lora_set(self) -> tuple:
        """The identity of the job's LoRA set (the queue groups jobs by it); () without LoRAs."""
        return tuple((r.path, r.strength, r.schedule) for r in self.loras if r.strength != 0)

    @property
    def task(self) -> str:
        """"continuation" for a clip longer than one pass (`window`), "ref2va" when references are given, "fl2va"
        when a keyframe is, else "t2va"."""
        if self.window is not None:
            return "continuation"
        if self.references:
            return "ref2va"
        return "fl2va" if self.keyframes else "t2va"

    @property
    def windows(self) -> tuple[Window, ...]:
        """The window plan (`windows.plan_windows`): one window of `frames` for a one-pass job."""
        if self.window is None:
            return (Window(0, 0, self.frames, 0, self.frames),)
        return plan_windows(self.frames, self.window, self.overlap)

    @property
    def pass_frames(self) -> int:
        """Frames of the longest pass: `frames`, or the longest window of a windowed clip (what one DiT pass
        costs: `latent_frames`, `video_rows` and `audio_rows` are of it)."""
        return max(w.frames for w in self.windows)

    @property
    def keyframes(self) -> tuple[KeyframeRef, ...]:
        """The given keyframes in packed order: by frame (first, frame indices ascending, last)."""
        given = (self.first_frame, *self.frame_keyframes, self.last_frame)
        return tuple(sorted((k for k in given if k is not None), key=lambda k: k.frame(self.frames)))

    @property
    def seconds(self) -> float:
        """Duration of the rendered video in s (frames / 24)."""
        return self.frames / FPS

    @property
    def latent_frames(self) -> int:
        return latent_frames(self.pass_frames)

    @property
    def video_rows(self) -> int:
        return video_rows(self.width, self.height, self.pass_frames)

    @property
    def audio_rows(self) -> int:
        return audio_rows(self.pass_frames)

    def mp4_path(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / f"{self.output}.mp4"

    def sidecar_path(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / f"{self.output}.json"

    def time_note(self, limits: Limits | None = None) -> str:
        """How the frame count came about, e.g. "10 s → 243 frames = 10.125 s"; with the checkpoint's `limits`, a
        count outside the durations its weights were trained on says so ("4 s → 107 frames = 4.458 s, outside the
        5–15 s the model was trained on"): it renders, but diffusers would refuse it and quality is not known."""
        note = self._time_origin()
        if self.window is not None:  # every window is inside the trained range (windows.default_window)
            return f"{note} {plan_note(self.frames, self.window, self.overlap, conditioned=self.mode != 'fasth3')}"
        outside = limits.training_note(self.frames) if limits is not None else ""
        return f"{note}, {outside}" if outside else note

    def _time_origin(self) -> str:
        result = f"{self.frames} frames = {seconds_text(self.frames)} s"
        if self.requested.duration is not None:
            return f"{self.requested.duration:g} s → {result}"
        if self.requested.frames is not None and self.requested.frames != self.frames:
            return f"{self.requested.frames} frames → {result}"
        if self.requested.frames is None and self.requested.preset is None:
            return f"{result} (default)"
        return result

    def conditions_note(self) -> str | None:
        """What conditions the video beside the prompt, for the plan line of `h3render prompt`: "ref2va: <each
        reference>" or "fl2va: <each keyframe>", then "LoRA <file> at <strength>" for each LoRA (a trial: only the
        sidecar said a LoRA was applied), or None for a prompt alone."""
        notes = []
        if self.references:
            notes.append("ref2va: " + "; ".join(r.describe() for r in self.references))
        elif self.keyframes:
            notes.append("fl2va: " + "; ".join(k.describe() for k in self.keyframes))
        notes += [f"LoRA {ref.given} at {ref.strength:g}" for ref in self.loras]
        return "; ".join(notes) or None

    def canvas_note(self) -> str:
        """How the canvas came about, e.g. "16:9 → 1344x768" or "1344x768 (default)"."""
        canvas = f"{self.width}x{self.height}"
        if self.requested.canvas_from is not None:
            return f"{self.requested.canvas_from} → {canvas}"
        if self.requested.preset is not None:
            return f"preset {self.requested.preset} → {canvas}"
        if self.requested.aspect is not None:
            return f"{self.requested.aspect} → {canvas}"
        if self.requested.width is not None:
            return canvas
        return f"{canvas} (default)"


def _given(ref: KeyframeRef) -> str:
    """A keyframe as the user wrote it: `first_frame a.png`, `last_frame b.png` or `keyframe 240:c.png`."""
    return f"keyframe {ref.anchor}:{ref.given}" if isinstance(ref.anchor, int) else f"{ref.anchor}_frame {ref.given}"


def keyframe_problems(keyframes: tuple[KeyframeRef, ...], frames: int) -> list[tuple[int, str]]:
    """Why a job's keyframes cannot be anchored in a `frames`-frame clip: ``(position in keyframes, problem)`` for
    each keyframe past the last frame, or on a frame an earlier one anchors (a first_frame and `keyframes: ["0:..."]`
    are both frame 0); [] when they fit. The position lets the manifest name the entry (`keyframes[2]`)."""
    seen: dict[int, KeyframeRef] = {}
    problems = []
    for position, ref in enumerate(keyframes):
        index = ref.frame(frames)
        if not 0 <= index < frames:
            problems.append((position, f"{ref.label} is past the clip's last frame {frames - 1} ({frames} frames)"))
        elif index in seen:
            # named by what was given ("keyframe 0:b.png and first_frame b.png"), not "frame 0 and first frame are
            # both frame 0" (a trial)
            problems.append((position, f"{_given(ref)} and {_given(seen[index])} both anchor frame {index}; give one "
                                       f"picture per frame"))
        else:
            seen[index] = ref
    return problems


# --- Presets ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preset:
    """A named canvas + default duration from `presets/<name>.yaml`.

    Exactly one of `aspect` ("W:H", resolved by the checkpoint's canvas rule) or `width` + `height` (px), and
    exactly one of `duration` (s) or `frames`.
    """

    name: str
    description: str
    aspect: str | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    frames: int | None = None

    def canvas(self, limits: Limits | None = None) -> tuple[int, int]:
        """(width, height) in px; an aspect preset follows `limits`' canvas rule (released rule when None)."""
        if self.aspect is None:
            return self.width, self.height
        short_edge = limits.canvas_short_edge if limits else RELEASED_SHORT_EDGE
        max_pixels = limits.canvas_max_pixels if limits else RELEASED_MAX_PIXELS
        return canvas_for_aspect(*parse_aspect(self.aspect), short_edge=short_edge, max_pixels=max_pixels)

    def snapped_frames(self, limits: Limits | None = None) -> int:
        return snap_frames(frames=self.frames, duration=self.duration, limits=limits)


@dataclass(frozen=True)
class PresetInfo:
    """One row of `h3render presets`: canvas (px), frames and s, and the packed-sequence rows it costs."""

    name: str
    description: str
    width: int
    height: int
    frames: int
    seconds: float
    video_rows: int
    audio_rows: int
    note: str = ""  # what this checkpoint makes of the preset, when its name or description would mislead


def load_presets(presets_dir: str | Path | None = None) -> dict[str, Preset]:
    """Read every `<name>.yaml` in the presets folder (default: the repository's `presets/`, `h3render.presets`).

    Raises:
        ValueError: a missing folder, or a preset file with bad YAML, unknown keys or conflicting fields (the
            message names the file).
    """
    folder = Path(presets_dir) if presets_dir is not None else PRESETS_DIR
    if not folder.is_dir():
        raise ValueError(f"presets folder not found: {folder}")
    presets = {}
    for path in sorted(folder.glob("*.yaml")):
        presets[path.stem] = _read_preset(path)
    return presets


def _read_preset(path: Path) -> Preset:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: cannot read preset: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset must be a mapping of {', '.join(_PRESET_FIELDS)}")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", path.stem):
        raise ValueError(f"{path}: preset names use lower-case letters, digits and '-'")
    unknown = sorted(str(k) for k in data if k not in _PRESET_FIELDS)
    if unknown:
        raise ValueError(f"{path}: unknown preset key(s) {', '.join(unknown)}; allowed: {', '.join(_PRESET_FIELDS)}")
    if not isinstance(data.get("description"), str):
        raise ValueError(f"{path}: description must be a string")
    if (data.get("aspect") is None) == (data.get("width") is None and data.get("height") is None):
        raise ValueError(f"{path}: give either aspect or width + height")
    if (data.get("duration") is None) == (data.get("frames") is None):
        raise ValueError(f"{path}: give either duration or frames")
    preset = Preset(name=path.stem, **{k: data.get(k) for k in _PRESET_FIELDS})
    try:
        if preset.aspect is not None and not isinstance(preset.aspect, str):
            raise ValueError('aspect must be a quoted string such as "16:9"')
        if preset.aspect is None:
            check_canvas(preset.width, preset.height)
        preset.canvas()
        preset.snapped_frames()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return preset


def list_presets(limits: Limits | None = None, presets_dir: str | Path | None = None) -> list[PresetInfo]:
    """Every preset with its resolved canvas, frames and row counts, sorted by name (`h3render presets`).

    With `limits`, aspect presets follow that checkpoint's canvas rule; frame counts are not range-checked here
    (a job using the preset is).
    """
    rows = []
    for name, preset in sorted(load_presets(presets_dir).items()):
        width, height = preset.canvas(limits)
        frames = preset.snapped_frames()
        rows.append(PresetInfo(name, preset.description, width, height, frames, frames / FPS,
                               video_rows(width, height, frames), audio_rows(frames),
                               _preset_note(preset, width, height, frames, limits)))
    return rows


def _preset_note(preset: Preset, width: int, height: int, frames: int, limits: Limits | None) -> str:
    """What a checkpoint with smaller `limits` than the release's makes of a preset: a job using it is refused (frames
    or rows beyond the checkpoint's limits), or a fixed-size preset (no aspect) keeps its size beyond the
    checkpoint's canvas budget, so that "fast-960x544" is the tiny model's largest, slowest preset; else ""."""
    if limits is None:
        return ""
    rows = video_rows(width, height, frames)
    if not limits.min_frames <= frames <= limits.max_frames:
        return f"refused here: {frames} frames outside this checkpoint's {limits.min_frames}..{limits.max_frames}"
    if rows > limits.max_video_rows:
        return f"refused here: {rows:,} video rows, over this checkpoint's {limits.max_video_rows:,}"
    if preset.aspect is None and width * height > limits.canvas_max_pixels:
        return (f"fixed size, {width * height / limits.canvas_max_pixels:.0f}x this checkpoint's canvas budget "
                f"({limits.canvas_max_pixels:,} px): its largest, slowest preset here")
    return ""


def preset_lines(limits: Limits | None = None, presets_dir: str | Path | None = None,
                 model: str | None = None) -> list[str]:
    """`list_presets` as aligned text lines: with `model` (what the checkpoint is, e.g. "the built-in tiny model
    (random weights)") a first line saying how its canvas rule applies; then the column header and one line per
    preset, with `PresetInfo.note` after its description in brackets."""
    infos = list_presets(limits, presets_dir)
    width = max([len(i.name) for i in infos] + [6])
    lines = []
    if model is not None:
        short_edge = limits.canvas_short_edge if limits else RELEASED_SHORT_EDGE
        max_pixels = limits.canvas_max_pixels if limits else RELEASED_MAX_PIXELS
        lines.append(f"presets for {model}: an aspect preset takes its canvas rule (short edge {short_edge} px, at "
                     f"most {max_pixels:,} px); a fixed-size preset keeps its size")
    lines.append(f"{'preset':<{width}}  {'canvas':>9}  {'frames':>13}  {'video rows':>10}  {'audio rows':>10}  "
                 "description")
    for i in infos:
        frames = f"{i.frames} ({seconds_text(i.frames)} s)"
        lines.append(f"{i.name:<{width}}  {f'{i.width}x{i.height}':>9}  {frames:>13}  "
                     f"{i.video_rows:>10,}  {i.audio_rows:>10,}  {i.description}" + (f" [{i.note}]" if i.note else ""))
    return lines


# --- Output names ----------------------------------------------------------------------------------------------------

def output_path_problem(output: str) -> str | None:
    """Why `output` cannot name a job's files under the out-dir, or None when it can.

    Allowed: a relative POSIX path of non-empty components (subfolders welcome). Refused: absolute paths, drive
    letters, `.`/`..` components, backslashes and other characters not portable in file names, control, format
    (bidi) and separator characters, lone surrogates, Windows device names, components over 200 bytes, paths over
    1,024 bytes, the batch report's own name, and a last component ending in ".tmp" (the temp namespace).
    """
    if not isinstance(output, str) or not output.strip():
        return "must be a non-empty string"
    if output.startswith("/") or output.startswith("~"):
        return "must be relative to the out-dir (no leading '/' or '~')"
    if re.match(r"[A-Za-z]:", output):
        return "must be relative to the out-dir (no drive letter)"
    surrogate = lone_surrogate(output)
    if surrogate:
        return surrogate
    bad = sorted({c for c in output if c in _FORBIDDEN_NAME_CHARS or unicodedata.category(c) in _INVISIBLE})
    if bad:
        return f"contains characters not allowed in file names: {', '.join(_char_name(c) for c in bad)}"
    if len(output.encode("utf-8")) > MAX_OUTPUT_BYTES:
        return (f"is {len(output.encode('utf-8')):,} bytes long, more than {MAX_OUTPUT_BYTES:,} (with the out dir "
                "it must fit the OS's 4,096-byte path limit)")
    for part in output.split("/"):
        if part in ("", ".", ".."):
            return "path components must be non-empty and not '.' or '..' (it may not leave the out-dir)"
        if part != part.strip():
            return "path components may not start or end with spaces"
        if part.split(".")[0].lower() in _WINDOWS_DEVICE_NAMES:
            return f"{part!r} is a reserved device name"
        if len(part.encode("utf-8")) > MAX_NAME_COMPONENT_BYTES:
            return f"a path component is longer than {MAX_NAME_COMPONENT_BYTES} bytes"
    if output.lower() == REPORT_STEM or output.lower().startswith(REPORT_STEM + "."):
        return f"{output!r} is reserved for the batch report"
    # A final name ending in ".tmp" is another job's temp name (<b>.tmp.mp4, outputs.temp_paths): refused, so final
    # and temp names never meet. Compared case-folded: "B.TMP.mp4" is "b.tmp.mp4" on a case-folding file system.
    if output_key(output.rsplit("/", 1)[-1]).endswith(TEMP_MARK):
        return f"may not end in {TEMP_MARK!r}: that suffix is reserved for the temp files of the job without it"
    return None


def lone_surrogate(text: str) -> str | None:
    """Why `text` is not valid Unicode (a lone surrogate, from a JSON "\\ud83d" escape or undecodable command-line
    bytes), or None. Such text cannot be encoded to UTF-8: not as a file name, a tokenizer input or a log line."""
    for index, c in enumerate(text):
        if 0xD800 <= ord(c) <= 0xDFFF:
            return f"contains a lone surrogate U+{ord(c):04X} at character {index + 1} (not valid Unicode text)"
    return None


def _char_name(c: str) -> str:
    """`'|'` or `U+202E (RIGHT-TO-LEFT OVERRIDE)`: an invisible character is named, never printed."""
    if unicodedata.category(c) not in _INVISIBLE:
        return repr(c)
    return f"U+{ord(c):04X}" + (f" ({unicodedata.name(c)})" if unicodedata.name(c, "") else "")


def output_name(name: str) -> str:
    """The name a job's files are written under: `name` in Unicode NFC, the form macOS, Windows and most Linux
    tools produce, so an id typed on any of them gives the same file name."""
    return unicodedata.normalize("NFC", name)


def output_key(name: str) -> str:
    """The key two output names clash on: NFC, case-folded, NFC again (canonical caseless matching, Unicode §3.13),
    so "Café" (NFC), "café" (NFD: "e" + U+0301) and "CAFÉ" are one file on a case-folding file system."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", name).casefold())


def prompt_slug(prompt: str, seed: int, *, counter: int = 1, max_bytes: int = MAX_AUTO_NAME_BYTES) -> str:
    """An output name for a job without id or output: "<words of the prompt>-s<seed>[-<counter>]".

    The prompt is NFKD-normalized and reduced to ASCII (accents dropped; other scripts vanish; non-ASCII spaces
    and punctuation separate words), lower-cased, and its letter/digit runs joined with "-", cut at a word
    boundary so the whole name is at most `max_bytes`. A prompt with no ASCII letters or digits becomes
    "h3-<first 8 hex of its SHA-1>". `counter` > 1 appends "-<counter>".
    """
    # NFKD splits "ö" into "o" + a combining mark; marks and non-ASCII letters are dropped, while non-ASCII spaces
    # and punctuation (U+2028, "«", "—") still separate words.
    ascii_text = "".join(c if c.isascii() else "" if unicodedata.category(c)[0] in "LM" else " "
                         for c in unicodedata.normalize("NFKD", prompt))
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())
    if not words:
        words = ["h3", hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:8]]
    tail = f"-s{seed}" + (f"-{counter}" if counter > 1 else "")
    # The base keeps room for a counter up to -99, so a name and its -2, -3 … stay the same word for word.
    budget = max_bytes - len(f"-s{seed}-{max(counter, 99)}")
    base = ""
    for word in words:
        candidate = f"{base}-{word}" if base else word
        if len(candidate) > budget:
            if not base:  # a single word longer than the budget: cut inside it
                base = word[:budget]
            break
        base = candidate
    return base + tail


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (YAML and OS errors span several), for `file: problem` messages."""
    return " ".join(str(exc).split())


# --- Encoder options, checked before load, so a typo fails in the first second rather than after denoising --------


def check_x264_preset(name: str) -> str:
    """`name` if it is an x264 preset (`X264_PRESETS`), for `--x264-preset`.

    Raises:
        ValueError: one line naming the option, the value, the closest preset and the full list.
    """
    if isinstance(name, str) and name in X264_PRESETS:
        return name
    close = difflib.get_close_matches(str(name), X264_PRESETS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"--x264-preset {name!r} is not an x264 preset{hint}; one of {', '.join(X264_PRESETS)}")
