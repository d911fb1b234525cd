"""fl2va keyframe fields of a job (`first_frame`, `last_frame`): checked, hashed and measured before any weights load.

A manifest names keyframe image files; this module turns one such value into a `KeyframeRef`: the resolved path,
the sha256 of the file's bytes (the resume key: `Job.params()` carries it, so editing the picture re-renders the
job), the decoded size (the canvas rule's input when the job names no canvas) and what the decode had to do (RGB
conversion, alpha flattened onto white, EXIF rotation). The decode and its checks are `h3render.keyframes.
load_keyframe` (PNG / JPEG / WebP at least, a still image, aspect 1:4 ... 4:1); it is imported lazily so that reading
a t2va manifest never imports torch or Pillow.

The render re-reads the file and refuses it when its sha256 differs from the one recorded here (the picture changed
between validation and rendering).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

KEYFRAME_FIELDS = ("first_frame", "last_frame")  # packed order of the keyframes (diffusers `[image, last_image]`)
ANCHOR_OF_FIELD = {"first_frame": "first", "last_frame": "last"}


@dataclass(frozen=True)
class KeyframeRef:
    """One validated keyframe file of a job (no pixels: jobs are small, picklable values).

    Attributes:
        anchor: "first", "last" or a pixel frame index (0-based, of the whole clip: `keyframes:` / `--keyframe`).
        given: the path as written in the manifest / on the command line.
        path: the resolved absolute path (relative paths resolve against the manifest's folder, or the working
            folder for `h3render prompt`).
        sha256: hex digest of the file's bytes.
        width, height: the decoded picture in px, after EXIF orientation.
        format: Pillow's format name ("PNG", "JPEG", "WEBP", ...); mode: Pillow's mode before RGB conversion.
        alpha_flattened: the file had transparency, composited onto white.
        exif_transposed: an EXIF orientation tag rotated or flipped the picture.
    """

    anchor: str | int
    given: str
    path: str
    sha256: str
    width: int
    height: int
    format: str
    mode: str
    alpha_flattened: bool = False
    exif_transposed: bool = False

    def conversion_note(self) -> str | None:
        """What the decode did besides reading, for the log ("RGBA → RGB, alpha flattened onto white"), or None."""
        notes = []
        if self.mode != "RGB":
            notes.append(f"{self.mode} → RGB" + (", alpha flattened onto white" if self.alpha_flattened else ""))
        if self.exif_transposed:
            notes.append("EXIF orientation applied")
        return "; ".join(notes) or None

    @property
    def label(self) -> str:
        """"first frame", "last frame" or "frame 240", for messages."""
        return f"frame {self.anchor}" if isinstance(self.anchor, int) else f"{self.anchor} frame"

    def frame(self, frames: int) -> int:
        """The pixel frame index this keyframe is anchored at in a `frames`-frame clip (first 0, last F - 1)."""
        return 0 if self.anchor == "first" else frames - 1 if self.anchor == "last" else int(self.anchor)

    def describe(self) -> str:
        """`first frame shots/a.png 640x480`, plus the conversion note in parentheses when there is one."""
        note = self.conversion_note()
        return f"{self.label} {self.given} {self.width}x{self.height}" + (f" ({note})" if note else "")


def resolve_keyframe_path(value: str, base_dir: str | Path) -> Path:
    """`value` with `~` expanded, relative to `base_dir` unless absolute."""
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else Path(base_dir) / path


def parse_keyframe_spec(value) -> tuple[int, str]:
    """A `keyframes:` entry / `--keyframe` value `"INDEX:PATH"` (`"240:mid.png"`) as (frame index, path).

    Raises:
        ValueError: not a string of a non-negative decimal index, ":" and a non-empty path.
    """
    if isinstance(value, str) and ":" in value:
        index, path = value.split(":", 1)
        if index.strip().isascii() and index.strip().isdigit() and path.strip():
            return int(index), path
    raise ValueError(f"{value!r} must be \"FRAME:IMAGE\" (a 0-based frame index, ':' and an image path, e.g. "
                     f"\"240:mid.png\")")


def read_keyframe_ref(value: str, anchor: str | int, base_dir: str | Path) -> KeyframeRef:
    """Decode and validate one keyframe file (see `h3render.keyframes.load_keyframe`) into a `KeyframeRef`.

    Raises:
        ValueError: `"<path>: <problem>"`: missing, not a file, unreadable, not a decodable still image, or an
            aspect ratio outside 1:4 ... 4:1. The manifest reader prefixes `file:line: field:`.
    """
    from h3render.keyframes import load_keyframe

    path = resolve_keyframe_path(value, base_dir).absolute()
    keyframe = load_keyframe(path, anchor)
    width, height = keyframe.size
    return KeyframeRef(anchor=anchor, given=value, path=str(path), sha256=keyframe.sha256, width=width,
                       height=height, format=keyframe.format, mode=keyframe.source_mode,
                       alpha_flattened=keyframe.alpha_flattened, exif_transposed=keyframe.exif_transposed)
