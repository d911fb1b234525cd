"""Render jobs: a manifest line becomes a frozen `Job`, with every default resolved once, before anything loads.

A job reads top to bottom: manifest line → `Job` → encode → pack → denoise → decode → write. This module owns the
first arrow: the manifest formats (JSONL and YAML, `docs/manifest.md`), the canvas and time rules of MiniMax-H3
(`canvas_for_aspect`, `snap_frames`), the canvas presets in the repository's `presets/` folder, output names, the
`--dry-run` plan and the split of a batch into shards (`--shard i/n`, SLURM arrays).

Units: canvas in pixels (width × height, both multiples of 32), time in frames at the fixed 24 fps or in seconds,
`steps` in sigma points of the schedule (N points → N − 1 forwards).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import yaml

import h3render.presets

# --- model facts (DESIGN.md §1; diffusers 0.42.1 `modular_pipelines/minimax_h3/modular_pipeline.py`) ---------------
FPS = 24  # fixed frame rate of MiniMax-H3
CANVAS_MULTIPLE = 32  # 16× VAE downsampling × (2, 2) patch: one video row per 32×32 pixels
FRAMES_PER_CHUNK = 17  # video VAE clip length: frame counts are 17n + 5 ...
FRAMES_REMAINDER = 5  # ... and give 5n + 2 latent frames
AUDIO_LATENTS_PER_SECOND = 40  # audio VAE: 32 kHz with hop 800
AUDIO_CHANNELS = 2  # stereo is two channel-major blocks of audio rows
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0  # aspect ratios the released checkpoint was trained over
RELEASED_SHORT_EDGE = 768  # released canvas rule: short edge 768 ...
RELEASED_MAX_PIXELS = 768 * 1344  # ... with the area capped at the 16:9 canvas

# --- h3render choices (docs/manifest.md) ---------------------------------------------------------------------------
MODES = ("t2va", "fasth3")
DEFAULT_MODE = "t2va"
DEFAULT_SEED = 0  # a fixed value, so a manifest without seeds renders the same twice
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts 0 … 2**64 − 1
MAX_AUTO_NAME_BYTES = 120  # automatic output names (prompt slug + seed) stay at most this long
MAX_NAME_COMPONENT_BYTES = 200  # a path component of an explicit output; leaves room for ".tmp.json" under 255
REPORT_STEM = "batch-report"  # batch.py writes <out_dir>/batch-report*.json: no job may own that name

# The repository's presets/ folder, shipped in the wheel as the data package h3render.presets (pyproject.toml).
PRESETS_DIR = Path(h3render.presets.__file__).resolve().parent

JOB_FIELDS = ("id", "prompt", "preset", "aspect", "width", "height", "duration", "frames", "seed", "steps", "mode",
              "output")
JOB_ONLY_FIELDS = ("id", "prompt", "output")  # may not appear in `defaults` or in command-line defaults
DEFAULT_FIELDS = tuple(f for f in JOB_FIELDS if f not in JOB_ONLY_FIELDS)
_CANVAS_FIELDS = ("preset", "aspect", "width", "height")
_TIME_FIELDS = ("duration", "frames")
_STRING_FIELDS = ("id", "prompt", "preset", "aspect", "mode", "output")
_PRESET_FIELDS = ("description", "aspect", "width", "height", "duration", "frames")

_FORBIDDEN_NAME_CHARS = set('<>:"|?*\\')  # not portable in file names (Windows) or separators in disguise
_WINDOWS_DEVICE_NAMES = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)),
                         *(f"lpt{i}" for i in range(1, 10))}


class ManifestError(ValueError):
    """Every problem found in one manifest; each line of the message reads `file:line: field: problem`.

    Attributes:
        errors: the message lines, in file order.
    """

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class Source(NamedTuple):
    """Where a job came from: the manifest file and the 1-based line of the job (0 when not from a file)."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass(frozen=True)
class Limits:
    """What a checkpoint accepts, given by the caller from the checkpoint config (h3render never guesses it).

    Released MiniMax-H3: frames 107–362 (4–15 s requested, model card and vLLM-Omni; diffusers takes 124–345),
    default canvas 16:9 → (1344, 768), 50 sigma points. The tiny test model has its own frames 22–362 and a small
    canvas.

    Attributes:
        min_frames, max_frames: inclusive range of snapped frame counts.
        default_canvas: (width, height) in px for jobs that name no canvas; multiples of 32.
        default_frames: frame count (17n + 5) for jobs that name no duration.
        default_steps: sigma points of the base sampler for jobs that name none (released: 50 → 49 forwards).
        canvas_short_edge, canvas_max_pixels: the aspect-ratio canvas rule (released: 768, 768 × 1344).

    Raises:
        ValueError: inconsistent limits.
    """

    min_frames: int
    max_frames: int
    default_canvas: tuple[int, int]
    default_frames: int
    default_steps: int
    canvas_short_edge: int = RELEASED_SHORT_EDGE
    canvas_max_pixels: int = RELEASED_MAX_PIXELS

    def __post_init__(self) -> None:
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"Limits: bad frame range {self.min_frames}–{self.max_frames}")
        if not self.min_frames <= self.default_frames <= self.max_frames or not is_snapped(self.default_frames):
            raise ValueError(f"Limits: default_frames {self.default_frames} must be 17n+5 within "
                             f"{self.min_frames}–{self.max_frames}")
        width, height = self.default_canvas
        check_canvas(width, height)
        if self.default_steps < 2:
            raise ValueError("Limits: a schedule needs at least 2 sigma points")


@dataclass(frozen=True)
class Requested:
    """What the user asked for, before snapping and defaults; kept for the log ("10 s → 243 frames = 10.125 s").

    All fields None when the job took the checkpoint's defaults. `aspect` is the text given ("16:9"); `width` and
    `height` are set only for an explicit canvas; `duration` in s.
    """

    preset: str | None = None
    aspect: str | None = None
    width: int | None = None
    height: int | None = None
    duration: float | None = None
    frames: int | None = None


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

    def __post_init__(self) -> None:
        check_canvas(self.width, self.height)
        if not is_snapped(self.frames):
            raise ValueError(f"Job {self.output!r}: frames {self.frames} is not of the form 17n+5")
        if self.mode not in MODES:
            raise ValueError(f"Job {self.output!r}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        problem = output_path_problem(self.output)
        if problem:
            raise ValueError(f"Job output {self.output!r}: {problem}")

    def params(self) -> dict[str, Any]:
        """Everything that determines the rendered output, as plain JSON values: the resume key and the sidecar's
        `"job"` entry. The output name and the manifest position are not part of it."""
        return {"prompt": self.prompt, "seed": self.seed, "width": self.width, "height": self.height,
                "frames": self.frames, "steps": self.steps, "mode": self.mode}

    @property
    def seconds(self) -> float:
        """Duration of the rendered video in s (frames / 24)."""
        return self.frames / FPS

    @property
    def latent_frames(self) -> int:
        return latent_frames(self.frames)

    @property
    def video_rows(self) -> int:
        return video_rows(self.width, self.height, self.frames)

    @property
    def audio_rows(self) -> int:
        return audio_rows(self.frames)

    def mp4_path(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / f"{self.output}.mp4"

    def sidecar_path(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / f"{self.output}.json"

    def time_note(self) -> str:
        """How the frame count came about, e.g. "10 s → 243 frames = 10.125 s"."""
        result = f"{self.frames} frames = {_secs(self.frames)} s"
        if self.requested.duration is not None:
            return f"{self.requested.duration:g} s → {result}"
        if self.requested.frames is not None and self.requested.frames != self.frames:
            return f"{self.requested.frames} frames → {result}"
        if self.requested.frames is None and self.requested.preset is None:
            return f"{result} (default)"
        return result

    def canvas_note(self) -> str:
        """How the canvas came about, e.g. "16:9 → 1344x768" or "1344x768 (default)"."""
        canvas = f"{self.width}x{self.height}"
        if self.requested.preset is not None:
            return f"preset {self.requested.preset} → {canvas}"
        if self.requested.aspect is not None:
            return f"{self.requested.aspect} → {canvas}"
        if self.requested.width is not None:
            return canvas
        return f"{canvas} (default)"


# ---------------------------------------------------------------------------------------------------------------------
# Canvas and time rules
# ---------------------------------------------------------------------------------------------------------------------

def canvas_for_aspect(aspect_w: float, aspect_h: float, *, short_edge: int = RELEASED_SHORT_EDGE,
                      max_pixels: int = RELEASED_MAX_PIXELS, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int]:
    """The canvas MiniMax-H3 generates on for an aspect ratio: returns (width, height) in px.

    Released rule (DESIGN.md §1, diffusers `resolve_canvas_size`): the short edge starts at 768, the area is then
    scaled down to at most 768 × 1344 keeping the ratio, and only then is each axis rounded to the nearest multiple
    of 32 — so the final area may end a little above the cap: 9:5 → 1376×768, 2:1 → 1440×704, 16:9 → 1344×768,
    9:16 → 768×1344, 4:3 → 1024×768, 1:1 → 768×768.

    Args:
        aspect_w, aspect_h: the ratio's two terms (> 0); only their quotient matters.
        short_edge, max_pixels: the checkpoint's rule (released: 768 and 768 × 1344).
        multiple: what both axes round to (32).

    Raises:
        ValueError: a non-positive term, or a ratio outside 1:4 … 4:1.
    """
    if not (aspect_w > 0 and aspect_h > 0 and math.isfinite(aspect_w) and math.isfinite(aspect_h)):
        raise ValueError(f"aspect {aspect_w:g}:{aspect_h:g}: both terms must be positive numbers")
    ratio = aspect_w / aspect_h
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise ValueError(f"aspect {aspect_w:g}:{aspect_h:g} is outside the supported 1:4 … 4:1")
    width, height = (short_edge * ratio, float(short_edge)) if ratio >= 1 else (float(short_edge), short_edge / ratio)
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = width * scale, height * scale
    # Python's round() (half to even) as the reference does; a tie needs an axis of exactly (k + ½)·32 px.
    return (max(multiple, round(width / multiple) * multiple), max(multiple, round(height / multiple) * multiple))


def parse_aspect(text: str) -> tuple[float, float]:
    """Parse "W:H" (e.g. "16:9", "2.39:1") into its two positive terms.

    Raises:
        ValueError: not of the form W:H with positive numbers.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*:\s*(\d+(?:\.\d+)?)\s*", text)
    if not match or float(match[1]) <= 0 or float(match[2]) <= 0:
        raise ValueError(f'aspect {text!r} must look like "16:9" (two positive numbers joined by ":")')
    return float(match[1]), float(match[2])


def check_canvas(width: int, height: int) -> None:
    """Check an explicit canvas: positive multiples of 32 px with an aspect ratio within 1:4 … 4:1.

    Raises:
        ValueError: naming the offending axis or ratio.
    """
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % CANVAS_MULTIPLE:
            raise ValueError(f"{name} {value!r} must be a positive multiple of {CANVAS_MULTIPLE} px")
    if not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise ValueError(f"canvas {width}x{height} has an aspect ratio outside the supported 1:4 … 4:1")


def is_snapped(frames: int) -> bool:
    """Whether a frame count is of the form 17n + 5, the counts the video VAE encodes without padding."""
    return frames >= FRAMES_REMAINDER and frames % FRAMES_PER_CHUNK == FRAMES_REMAINDER


def snap_frames(frames: int | None = None, duration: float | None = None, limits: Limits | None = None) -> int:
    """The frame count a request renders: the smallest 17n + 5 at or above the requested count.

    A duration (s) first becomes a whole number of frames at 24 fps, rounded to the nearest frame, so a duration
    quoted to two decimals maps back to its count: 10 s → 240 → 243 frames (10.125 s); 15 s → 360 → 362;
    4.46 s → 107.04 → 107 (4.458 s).

    Args:
        frames: requested frame count (int > 0), or
        duration: requested duration in s (> 0); exactly one of the two.
        limits: when given, the snapped count must lie within `limits.min_frames … limits.max_frames`.

    Raises:
        ValueError: neither or both given, a non-positive request, or a result outside the limits (the message
            states the range in frames and seconds).
    """
    if (frames is None) == (duration is None):
        raise ValueError("give exactly one of frames and duration")
    if duration is not None:
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration) \
                or duration <= 0:
            raise ValueError(f"duration {duration!r} must be a positive number of seconds")
        wanted = max(1, round(duration * FPS))
        asked = f"duration {duration:g} s ({wanted} frames)"
    else:
        if isinstance(frames, bool) or not isinstance(frames, int) or frames <= 0:
            raise ValueError(f"frames {frames!r} must be a positive integer")
        wanted = frames
        asked = f"frames {frames}"
    snapped = wanted + (FRAMES_REMAINDER - wanted) % FRAMES_PER_CHUNK
    if limits is not None and not limits.min_frames <= snapped <= limits.max_frames:
        raise ValueError(f"{asked} snaps to {snapped} frames, outside this checkpoint's range "
                         f"{limits.min_frames}–{limits.max_frames} frames "
                         f"({_secs(limits.min_frames)}–{_secs(limits.max_frames)} s)")
    return snapped


def latent_frames(frames: int) -> int:
    """Latent frames of the video VAE for a 17n + 5 frame count: 5n + 2 (243 → 72)."""
    if not is_snapped(frames):
        raise ValueError(f"frames {frames} is not of the form 17n+5")
    return (frames - FRAMES_REMAINDER) // FRAMES_PER_CHUNK * 5 + 2


def video_rows(width: int, height: int, frames: int) -> int:
    """Video rows of the packed sequence: latent frames × (H/32) × (W/32) (1344×768, 243 frames → 72,576)."""
    return latent_frames(frames) * (height // CANVAS_MULTIPLE) * (width // CANVAS_MULTIPLE)


def audio_rows(frames: int) -> int:
    """Audio rows of the packed sequence: 2 channels × round(frames / 24 · 40) latents (243 frames → 810)."""
    return AUDIO_CHANNELS * round(frames / FPS * AUDIO_LATENTS_PER_SECOND)


def _secs(frames: int) -> str:
    return f"{round(frames / FPS, 3):g}"


# ---------------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------------

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
        raise ValueError(f"{path}: cannot read preset: {_one_line(exc)}") from None
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
                               video_rows(width, height, frames), audio_rows(frames)))
    return rows


def preset_lines(limits: Limits | None = None, presets_dir: str | Path | None = None) -> list[str]:
    """`list_presets` as aligned text lines, a header first."""
    infos = list_presets(limits, presets_dir)
    width = max([len(i.name) for i in infos] + [6])
    lines = [f"{'preset':<{width}}  {'canvas':>9}  {'frames':>13}  {'video rows':>10}  {'audio rows':>10}  description"]
    for i in infos:
        lines.append(f"{i.name:<{width}}  {f'{i.width}x{i.height}':>9}  {f'{i.frames} ({_secs(i.frames)} s)':>13}  "
                     f"{i.video_rows:>10,}  {i.audio_rows:>10,}  {i.description}")
    return lines


# ---------------------------------------------------------------------------------------------------------------------
# Output names
# ---------------------------------------------------------------------------------------------------------------------

def output_path_problem(output: str) -> str | None:
    """Why `output` cannot name a job's files under the out-dir, or None when it can.

    Allowed: a relative POSIX path of non-empty components (subfolders welcome). Refused: absolute paths, drive
    letters, `.`/`..` components, backslashes and other characters not portable in file names, control characters,
    Windows device names, components over 200 bytes, and the batch report's own name.
    """
    if not isinstance(output, str) or not output.strip():
        return "must be a non-empty string"
    if output.startswith("/") or output.startswith("~"):
        return "must be relative to the out-dir (no leading '/' or '~')"
    if re.match(r"[A-Za-z]:", output):
        return "must be relative to the out-dir (no drive letter)"
    bad = sorted({c for c in output if c in _FORBIDDEN_NAME_CHARS or ord(c) < 32 or ord(c) == 127})
    if bad:
        return f"contains characters not allowed in file names: {' '.join(repr(c) for c in bad)}"
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
    return None


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


# ---------------------------------------------------------------------------------------------------------------------
# Manifests
# ---------------------------------------------------------------------------------------------------------------------

class _Value(NamedTuple):
    value: Any
    line: int  # 1-based line of the field; 0 when not from a file


@dataclass
class _Layer:
    """The fields set at one level (a job line, manifest defaults, command-line defaults), with their lines."""

    file: str
    line: int
    fields: dict[str, _Value] = field(default_factory=dict)

    def where(self, name: str | None = None) -> _Where:
        """The place to blame: the field's own line when it has one, else the job's."""
        line = self.fields[name].line if name in self.fields and self.fields[name].line else self.line
        return _Where(self.file, line, name)

    def get(self, name: str) -> Any:
        return self.fields[name].value if name in self.fields else None


class _Where(NamedTuple):
    file: str
    line: int = 0
    field: str | None = None

    def __str__(self) -> str:
        location = f"{self.file}:{self.line}" if self.line else self.file
        return f"{location}: {self.field}" if self.field else location


class _Errors:
    """Collects problems from every pass; reports them in file order (command-line defaults first)."""

    def __init__(self) -> None:
        self.found: list[tuple[_Where, str]] = []

    def add(self, where: _Where, message: str) -> None:
        self.found.append((where, message))

    @property
    def lines(self) -> list[str]:
        ordered = sorted(self.found, key=lambda item: item[0].line)  # stable: same-line problems keep pass order
        return [f"{where}: {message}" for where, message in ordered]

    def raise_if_any(self) -> None:
        if self.found:
            raise ManifestError(self.lines)


def load_manifest(path: str | Path, limits: Limits, defaults_overrides: Mapping[str, Any] | None = None, *,
                  presets_dir: str | Path | None = None) -> list[Job]:
    """Read a JSONL (`.jsonl`, `.ndjson`) or YAML (`.yaml`, `.yml`) manifest into resolved jobs, in file order.

    Precedence for each field: the job's own value, then `defaults_overrides` (command-line defaults; None values
    are ignored), then the manifest's `defaults`, then the preset in effect (canvas, duration), then `limits`.
    The whole manifest is validated before anything is returned. Schema: docs/manifest.md.

    Raises:
        ManifestError: every problem found, one line each, naming file, line and field.
    """
    path = Path(path)
    errors = _Errors()
    presets = _load_presets_for(errors, str(path), presets_dir)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".yaml", ".yml"):
        raise ManifestError([f"{path}: unknown manifest type {suffix or '(no extension)'!r}; use .jsonl or .yaml"])
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ManifestError([f"{path}: manifest not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError([f"{path}: cannot read manifest: {_one_line(exc)}"]) from None
    reader = _read_jsonl if suffix in (".jsonl", ".ndjson") else _read_yaml
    defaults, job_layers = reader(text, str(path), errors)
    overrides = _Layer("<command line>", 0, {k: _Value(v, 0) for k, v in (defaults_overrides or {}).items()
                                             if v is not None})
    jobs = _resolve_all(job_layers, [overrides, defaults], limits, presets, errors)
    if not job_layers and not errors.found:
        errors.add(_Where(str(path)), "the manifest has no jobs")
    errors.raise_if_any()
    return jobs


def job_from_fields(fields: Mapping[str, Any], limits: Limits, *, source: str = "<command line>",
                    presets_dir: str | Path | None = None) -> Job:
    """One job from a mapping of manifest fields (e.g. `h3render render "prompt" --aspect 16:9`), by the same
    rules as a manifest line. None values are ignored.

    Raises:
        ManifestError: as `load_manifest`, with `source` in place of the file name.
    """
    errors = _Errors()
    presets = _load_presets_for(errors, source, presets_dir)
    layer = _Layer(source, 0, {k: _Value(v, 0) for k, v in fields.items() if v is not None})
    jobs = _resolve_all([layer], [], limits, presets, errors)
    errors.raise_if_any()
    return jobs[0]


def _load_presets_for(errors: _Errors, where: str, presets_dir: str | Path | None) -> dict[str, Preset]:
    try:
        return load_presets(presets_dir)
    except ValueError as exc:
        errors.add(_Where(where), str(exc))
        return {}


def _read_jsonl(text: str, file: str, errors: _Errors) -> tuple[_Layer, list[_Layer]]:
    defaults = _Layer(file, 0)
    jobs: list[_Layer] = []
    # split on "\n" only: str.splitlines() also breaks at U+2028, which json.dumps(ensure_ascii=False) leaves raw
    for number, raw in enumerate(text.split("\n"), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        duplicates: list[str] = []

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            seen: dict[str, Any] = {}
            for key, value in items:
                if key in seen:
                    duplicates.append(key)
                seen[key] = value
            return seen

        try:
            obj = json.loads(stripped, object_pairs_hook=pairs)
        except json.JSONDecodeError as exc:
            errors.add(_Where(file, number), f"not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        for key in duplicates:
            errors.add(_Where(file, number, key), "field given twice")
        if not isinstance(obj, dict):
            errors.add(_Where(file, number), "each line must be a JSON object (one job)")
            continue
        if "defaults" in obj:
            if jobs or defaults.line or len(obj) != 1 or not isinstance(obj["defaults"], dict):
                errors.add(_Where(file, number, "defaults"),
                           'a defaults line is {"defaults": {...}} alone on a line, before the first job')
                continue
            defaults = _Layer(file, number, {k: _Value(v, number) for k, v in obj["defaults"].items()})
            continue
        jobs.append(_Layer(file, number, {k: _Value(v, number) for k, v in obj.items()}))
    return defaults, jobs


def _read_yaml(text: str, file: str, errors: _Errors) -> tuple[_Layer, list[_Layer]]:
    defaults = _Layer(file, 0)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        errors.add(_Where(file, line), f"not valid YAML: {exc.problem or exc.context}")
        return defaults, []
    except yaml.YAMLError as exc:
        errors.add(_Where(file), f"not valid YAML: {_one_line(exc)}")
        return defaults, []
    loader = yaml.SafeLoader("")
    if root is None:
        return defaults, []
    if isinstance(root, yaml.SequenceNode):
        job_nodes = root
    elif isinstance(root, yaml.MappingNode):
        job_nodes = None
        for key, value in _yaml_pairs(root, loader, file, errors):
            if key.value == "defaults":
                if isinstance(value, yaml.MappingNode):
                    defaults = _yaml_layer(value, loader, file, errors)
                elif not _is_null(value):
                    errors.add(_Where(file, _line(value), "defaults"), "must be a mapping of fields")
            elif key.value == "jobs":
                job_nodes = value
            elif not str(key.value).startswith("x-"):  # x-… keys hold YAML anchors for `<<` merges
                errors.add(_Where(file, _line(key), key.value), "unknown top-level key; expected defaults and jobs")
        if job_nodes is None:
            errors.add(_Where(file, _line(root)), "missing the jobs: list")
            return defaults, []
        if not isinstance(job_nodes, yaml.SequenceNode):
            errors.add(_Where(file, _line(job_nodes), "jobs"), "must be a list of jobs")
            return defaults, []
    else:
        errors.add(_Where(file, _line(root)), "a YAML manifest is a mapping with defaults: and jobs:")
        return defaults, []
    jobs = []
    for node in job_nodes.value:
        if isinstance(node, yaml.MappingNode):
            jobs.append(_yaml_layer(node, loader, file, errors))
        else:
            errors.add(_Where(file, _line(node)), "each job must be a mapping of fields")
    return defaults, jobs


def _yaml_pairs(node: yaml.MappingNode, loader: yaml.SafeLoader, file: str, errors: _Errors):
    """A mapping's (key, value) nodes with `<<` merges applied; keys given twice on the mapping itself are errors
    (PyYAML would silently keep the last)."""
    seen: set[str] = set()
    for key, _ in node.value:
        if key.tag != "tag:yaml.org,2002:merge" and key.value in seen:
            errors.add(_Where(file, _line(key), key.value), "field given twice")
        seen.add(key.value)
    try:
        loader.flatten_mapping(node)
    except yaml.YAMLError as exc:
        errors.add(_Where(file, _line(node)), f"bad YAML merge: {_one_line(exc)}")
    return [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]


def _yaml_layer(node: yaml.MappingNode, loader: yaml.SafeLoader, file: str, errors: _Errors) -> _Layer:
    layer = _Layer(file, _line(node))
    for key, value in _yaml_pairs(node, loader, file, errors):
        layer.fields[key.value] = _Value(_yaml_value(key.value, value, loader, file, errors), _line(key))
    return layer


def _yaml_value(name: str, node: yaml.Node, loader: yaml.SafeLoader, file: str, errors: _Errors) -> Any:
    # Text fields take the scalar's own text: YAML 1.1 would read `aspect: 16:9` as the base-60 integer 969 and
    # `id: 007` as 7.
    if name in _STRING_FIELDS and isinstance(node, yaml.ScalarNode) and not _is_null(node):
        return node.value
    try:
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        errors.add(_Where(file, _line(node), name), f"bad value: {_one_line(exc)}")
        return None


def _is_null(node: yaml.Node) -> bool:
    return node.tag == "tag:yaml.org,2002:null"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_layer(layer: _Layer, presets: Mapping[str, Preset], errors: _Errors, *, is_job: bool) -> bool:
    """Type- and value-check one level's fields; returns False when anything was wrong (the job is dropped)."""
    before = len(errors.found)
    for name in list(layer.fields):
        value = layer.get(name)
        where = layer.where(name)
        if name not in JOB_FIELDS:
            close = difflib.get_close_matches(name, JOB_FIELDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; allowed: {', '.join(JOB_FIELDS)}"
            errors.add(where, f"unknown field{hint}")
            continue
        if not is_job and name in JOB_ONLY_FIELDS:
            errors.add(where, "may only be set on a job, not in defaults")
            continue
        problem = _field_problem(name, value, presets)
        if problem:
            errors.add(where, problem)
    if "preset" in layer.fields and any(f in layer.fields for f in ("aspect", "width", "height")):
        errors.add(layer.where("preset"), "conflicts with aspect/width/height on the same level (a preset sets the "
                                          "canvas)")
    elif "aspect" in layer.fields and any(f in layer.fields for f in ("width", "height")):
        errors.add(layer.where("aspect"), "conflicts with width/height on the same level")
    elif ("width" in layer.fields) != ("height" in layer.fields):
        missing = "height" if "width" in layer.fields else "width"
        present = "width" if missing == "height" else "height"
        errors.add(layer.where(present), f"needs {missing} as well")
    elif "width" in layer.fields and not any(_field_problem(f, layer.get(f), presets) for f in ("width", "height")):
        try:
            check_canvas(layer.get("width"), layer.get("height"))
        except ValueError as exc:
            errors.add(layer.where("width"), str(exc))
    if "duration" in layer.fields and "frames" in layer.fields:
        errors.add(layer.where("duration"), "conflicts with frames on the same level; give one of them")
    if is_job and "prompt" not in layer.fields:
        errors.add(layer.where()._replace(field="prompt"), "missing (every job needs a prompt)")
    return len(errors.found) == before


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problem(name: str, value: Any, presets: Mapping[str, Preset]) -> str | None:
    if name in _STRING_FIELDS and not isinstance(value, str):
        return f"must be a string, got {_type_name(value)}"
    if name in ("id", "prompt") and not value.strip():
        return "must not be empty"
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
        if not _is_int(value):
            return f"must be an integer number of px, got {_type_name(value)}"
        if value <= 0 or value % CANVAS_MULTIPLE:
            return f"{value} is not a positive multiple of {CANVAS_MULTIPLE}"
    if name == "duration":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number of seconds, got {_type_name(value)}"
        if not math.isfinite(value) or value <= 0:
            return f"{value} must be a positive number of seconds"
    if name == "frames":
        if not _is_int(value):
            return f"must be an integer, got {_type_name(value)}"
        if value <= 0:
            return f"{value} must be positive"
    if name == "seed":
        if not _is_int(value):
            return f"must be an integer, got {_type_name(value)}"
        if not 0 <= value <= MAX_SEED:
            return f"{value} is outside 0 … 2**64-1"
    if name == "steps":
        if not _is_int(value):
            return f"must be an integer number of sigma points, got {_type_name(value)}"
        if value < 2:
            return f"{value} sigma points is too few (at least 2: N points run N-1 forwards)"
    if name == "mode" and value not in MODES:
        return f"{value!r} is not one of {', '.join(MODES)}"
    if name == "output":
        problem = output_path_problem(_strip_mp4(value))
        if problem:
            return problem
    return None


def _type_name(value: Any) -> str:
    return {bool: "a boolean", type(None): "null", list: "a list", dict: "a mapping", str: "a string",
            float: "a decimal number", int: "an integer"}.get(type(value), type(value).__name__)


def _strip_mp4(output: str) -> str:
    return output[:-4] if output.lower().endswith(".mp4") else output


def _first(layers: Iterable[_Layer], names: Iterable[str]) -> _Layer | None:
    names = tuple(names)
    return next((layer for layer in layers if any(n in layer.fields for n in names)), None)


def _resolve_all(job_layers: list[_Layer], default_layers: list[_Layer], limits: Limits,
                 presets: Mapping[str, Preset], errors: _Errors) -> list[Job]:
    defaults_ok = all(_check_layer(layer, presets, errors, is_job=False) for layer in default_layers)
    resolved: list[tuple[_Layer, dict[str, Any]]] = []
    for layer in job_layers:
        # Every job is checked even when the defaults are bad, so one run reports every problem.
        if not _check_layer(layer, presets, errors, is_job=True) or not defaults_ok:
            continue
        values = _resolve_job(layer, [layer, *default_layers], limits, presets, errors)
        if values is not None:
            resolved.append((layer, values))
    repeated_ids = _check_ids(job_layers, errors)
    names = _assign_outputs(resolved, repeated_ids, errors)
    if errors.found:
        return []
    return [Job(source=Source(layer.file, layer.line), output=name, **values)
            for (layer, values), name in zip(resolved, names)]


def _resolve_job(job: _Layer, layers: list[_Layer], limits: Limits, presets: Mapping[str, Preset],
                 errors: _Errors) -> dict[str, Any] | None:
    """Apply precedence to one checked job; returns Job keyword arguments (without output/source) or None."""
    requested: dict[str, Any] = {}
    canvas_layer = _first(layers, _CANVAS_FIELDS)
    preset = None
    if canvas_layer is None:
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
    try:
        if time_layer is not None:
            where = time_layer.where("duration" if "duration" in time_layer.fields else "frames")
            requested.update(duration=time_layer.get("duration"), frames=time_layer.get("frames"))
            frames = snap_frames(time_layer.get("frames"), time_layer.get("duration"), limits)
        elif preset is not None:
            where = f"{canvas_layer.where('preset')} (preset {preset.name})"
            requested.update(duration=preset.duration, frames=preset.frames)
            frames = preset.snapped_frames(limits)
        else:
            where = job.where()
            frames = snap_frames(limits.default_frames, None, limits)
    except ValueError as exc:
        errors.add(where, str(exc))
        return None

    mode_layer = _first(layers, ["mode"])
    mode = mode_layer.get("mode") if mode_layer else DEFAULT_MODE
    steps_layer = _first(layers, ["steps"])
    if mode == "fasth3":
        # The student only works on the schedule it was distilled for, which comes with the adapter: a steps
        # inherited from defaults does not apply, one on the job itself is a mistake.
        if "steps" in job.fields:
            errors.add(job.where("steps"), "mode fasth3 runs the FastH3 adapter's fixed distilled schedule; "
                                           "remove steps")
            return None
        steps = None
    else:
        steps = steps_layer.get("steps") if steps_layer else limits.default_steps
    seed_layer = _first(layers, ["seed"])
    return dict(id=job.get("id"), prompt=job.get("prompt"), width=width, height=height, frames=frames,
                seed=seed_layer.get("seed") if seed_layer else DEFAULT_SEED, steps=steps, mode=mode,
                requested=Requested(**requested))


def _check_ids(job_layers: list[_Layer], errors: _Errors) -> set[int]:
    """Report repeated ids; returns the `id()` of each repeating layer."""
    first_line: dict[str, _Where] = {}
    repeats = set()
    for layer in job_layers:
        job_id = layer.get("id")
        if not isinstance(job_id, str):
            continue
        if job_id in first_line:
            errors.add(layer.where("id"), f"duplicate id {job_id!r} (first at {first_line[job_id].file}:"
                                          f"{first_line[job_id].line})")
            repeats.add(id(layer))
        else:
            first_line[job_id] = layer.where()
    return repeats


def _assign_outputs(resolved: list[tuple[_Layer, dict[str, Any]]], repeated_ids: set[int],
                    errors: _Errors) -> list[str]:
    """Output names: explicit `output`, else the id, else a prompt slug made unique with -2, -3, …

    Names are compared case-insensitively (macOS and Windows file systems fold case); explicit names that clash
    are errors, automatic names step aside.
    """
    taken: dict[str, str] = {}
    names: list[str | None] = []
    for layer, values in resolved:
        name_field = "output" if "output" in layer.fields else "id" if "id" in layer.fields else None
        if name_field is None:
            names.append(None)
            continue
        name = _strip_mp4(layer.get(name_field))
        problem = output_path_problem(name)
        if problem:  # an output's own problems were reported by _check_layer; an id used as a name is checked here
            if name_field == "id":
                errors.add(layer.where("id"), f"cannot serve as the output name ({problem}); set output")
            names.append(None)
            continue
        key = name.casefold()
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
        while name.casefold() in taken:
            counter += 1
            name = prompt_slug(values["prompt"], values["seed"], counter=counter)
        taken[name.casefold()] = f"{layer.file}:{layer.line}"
        names[index] = name
    return names


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------------------------------
# Dry-run plan and shards
# ---------------------------------------------------------------------------------------------------------------------

def plan_lines(jobs: list[Job]) -> list[str]:
    """One line per job for `--dry-run` (output, canvas, frames and s, steps, packed rows, source) and a total."""
    lines = []
    for number, job in enumerate(jobs, start=1):
        label = job.output if job.id is None or job.id == job.output else f"{job.id} → {job.output}"
        steps = "adapter schedule" if job.steps is None else f"{job.steps} sigma points"
        lines.append(f"[{number}/{len(jobs)}] {label}: {job.canvas_note()}, {job.time_note()}, {job.mode} "
                     f"{steps}, seed {job.seed}, rows video {job.video_rows:,} + audio "
                     f"{job.audio_rows:,} ({job.source})")
    total = sum(job.seconds for job in jobs)
    lines.append(f"{len(jobs)} job(s), {total:.3f} s of video")
    return lines


def shard_jobs(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The jobs of shard `index` (0-based) of `count`: job i goes to shard i % count, so the shards of any count
    cover every job exactly once and a shard's jobs keep manifest order.

    Raises:
        ValueError: count < 1 or index outside 0 … count − 1.
    """
    _check_shard(index, count)
    return [job for position, job in enumerate(jobs) if position % count == index]


def _check_shard(index: int, count: int) -> None:
    if not _is_int(count) or count < 1:
        raise ValueError(f"shard count {count!r} must be a positive integer")
    if not _is_int(index) or not 0 <= index < count:
        raise ValueError(f"shard index {index!r} must be within 0 … {count - 1} (shards are numbered from 0)")


def parse_shard(text: str) -> tuple[int, int]:
    """Parse `--shard i/n` (0-based i): "0/4" … "3/4" → (i, n).

    Raises:
        ValueError: not of the form i/n, or i outside 0 … n − 1.
    """
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f'--shard {text!r} must look like "0/4" (0-based index / count)')
    index, count = int(match[1]), int(match[2])
    _check_shard(index, count)
    return index, count


def shard_from_slurm(env: Mapping[str, str]) -> tuple[int, int] | None:
    """The shard of a SLURM array task, or None outside an array job.

    index = (SLURM_ARRAY_TASK_ID − SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, count = SLURM_ARRAY_TASK_COUNT,
    so `--array=0-3`, `--array=1-4` and `--array=0-6:2` all give shards 0 … 3 of 4. MIN defaults to 0, STEP to 1.

    Raises:
        ValueError: a non-integer variable, a missing count, or an array that is not an evenly spaced range (e.g.
            `--array=1,4,9`): pass `--shard i/n` instead.
    """
    if not env.get("SLURM_ARRAY_TASK_ID"):
        return None
    values = {}
    for name, default in (("ID", None), ("COUNT", None), ("MIN", "0"), ("STEP", "1")):
        raw = env.get(f"SLURM_ARRAY_TASK_{name}", default)
        if raw is None:
            raise ValueError(f"SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_{name} is not; pass --shard i/n")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"SLURM_ARRAY_TASK_{name}={raw!r} is not an integer") from None
    offset, step, count = values["ID"] - values["MIN"], values["STEP"], values["COUNT"]
    if step < 1 or offset % step or not 0 <= offset // step < max(count, 1):
        raise ValueError(f"SLURM array task {values['ID']} (min {values['MIN']}, step {step}, count {count}) is not "
                         f"part of an evenly spaced range; pass --shard i/n")
    index = offset // step
    _check_shard(index, count)
    return index, count
