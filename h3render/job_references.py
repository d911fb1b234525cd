"""ref2va reference fields of a job (`--reference`, the manifest's `references:` list): checked, hashed, typed and
measured before any weights load.

A reference is a file, given as a path (its type inferred from the content: a still Pillow decodes is an image,
else PyAV's streams decide: a video stream makes a video, an audio stream alone an audio clip) or, in a manifest, as
a mapping `{path: ..., type: image | video | audio, audio: true | false}` (`type` overrides the inference; `audio:
false` drops a video's soundtrack). The order is kept: it labels the references in the prompt presentation and
lays them out on the shared rotary clock, so another order is another request.

The request rules are diffusers 0.42.1's `MiniMaxH3Ref2VASetupStep` (research/conditioning.md §2.1): at most 9
images, 3 videos, 3 audio clips, 12 in all; audio references alone are refused. The decode and its checks are
`h3render.references.probe_reference` (Pillow / PyAV), imported lazily so that reading a t2va manifest never
imports torch, Pillow or PyAV. Errors are `ValueError("<path>: <problem>")`; the manifest reader adds
`file:line: references[i]:`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from h3render.suggest import unknown_field

REFERENCE_TYPES = ("image", "video", "audio")
MAX_PER_TYPE = {"image": 9, "video": 3, "audio": 3}  # diffusers `MiniMaxH3Ref2VASetupStep` defaults
MAX_REFERENCES = 12
ENTRY_KEYS = ("path", "type", "audio")
# What h3render's ref2va renders today: image references, and audio clips at the audio VAE's 32 kHz. Video references
# need the conditioner's video presentation (transformers' Qwen3-VL video processor needs torchvision) and other
# rates diffusers' torchaudio resampling (no torchaudio build for this torch): issue #23's follow-up.
RENDERABLE_TYPES = ("image", "audio")
AUDIO_RATE = 32000


@dataclass(frozen=True)
class ReferenceRef:
    """One validated reference file of a job (no pixels or samples: jobs are small, picklable values).

    Attributes:
        type: "image", "video" or "audio".
        given: the path as written in the manifest / on the command line.
        path: the resolved absolute path (relative paths resolve against the manifest's folder, or the working
            folder for `h3render prompt`).
        sha256: hex digest of the file's bytes (the resume key).
        use_audio: whether the reference's sound conditions the render (an audio clip: always; a video: its
            soundtrack, unless `audio: false` / `--reference-no-audio`; an image: never).
        info: what the probe measured (`references.probe_reference`): image `width`, `height`, `format`, `mode`;
            video `width`, `height`, `fps`, `frames`, `duration_s`, `codec`, `has_audio`; audio / soundtrack
            `sample_rate`, `channels`, `audio_duration_s`, `audio_codec`; `container`.
        type_given: whether the type came from the manifest's `type` rather than the inference.
    """

    type: str
    given: str
    path: str
    sha256: str
    use_audio: bool
    info: Mapping[str, Any]
    type_given: bool = False

    def describe(self) -> str:
        """`image refs/a.png 640x400`, `video clip.mp4 1280x720 30 fps 5.00 s + sound`, `audio voice.wav 2.50 s`."""
        i = self.info
        if self.type == "image":
            return f"image {self.given} {i['width']}x{i['height']}"
        if self.type == "video":
            sound = " + sound" if self.use_audio else (" (sound not used)" if i.get("has_audio") else "")
            return f"video {self.given} {i['width']}x{i['height']} {i['fps']:g} fps {i['duration_s']:.2f} s{sound}"
        return f"audio {self.given} {i['audio_duration_s']:.2f} s"

    def params(self) -> dict[str, Any]:
        """What of this reference determines the render (`Job.params`): type, content hash, sound used."""
        return {"type": self.type, "sha256": self.sha256, "audio": self.use_audio}


def resolve_reference_path(value: str, base_dir: str | Path) -> Path:
    """`value` with `~` expanded, relative to `base_dir` unless absolute."""
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else Path(base_dir) / path


def entry_problems(entry: Any) -> list[tuple[str, str]]:
    """Every way one `references` entry is malformed on its own (before any file is read); [] when it is not. A
    problem is ``(at, message)``, `at` its place in the entry: ``""`` the entry, ``".type"`` one of its keys."""
    if isinstance(entry, str):
        return [] if entry.strip() else [("", "a reference path must not be empty")]
    if not isinstance(entry, Mapping):
        return [("", f"a reference is a path or a mapping {{path, type, audio}}, got {type(entry).__name__}")]
    problems = [(f".{key}", unknown_field(key, ENTRY_KEYS)) for key in sorted(map(str, set(entry) - set(ENTRY_KEYS)))]
    if not isinstance(entry.get("path"), str) or not entry["path"].strip():
        problems.append((".path", "a reference mapping needs a non-empty path"))
    if "type" in entry and entry["type"] not in REFERENCE_TYPES:
        problems.append((".type", f"{entry['type']!r} is not one of {', '.join(REFERENCE_TYPES)}"))
    if "audio" in entry and not isinstance(entry["audio"], bool):
        problems.append((".audio", f"must be true or false, got {entry['audio']!r}"))
    return problems


def read_reference(entry: str | Mapping[str, Any], base_dir: str | Path, no_audio: bool = False) -> ReferenceRef:
    """Probe one reference (`h3render.references.probe_reference`) into a `ReferenceRef`.

    Args:
        entry: a path, or a mapping `{path, type, audio}` (`entry_problems` found nothing).
        base_dir: what a relative path is relative to.
        no_audio: drop a video's soundtrack (`--reference-no-audio`) unless the entry says `audio: true`.

    Raises:
        ValueError: `"<path>: <problem>"`: missing, a folder, unreadable, not a decodable image / video / audio,
            a type that the content contradicts, an image outside 1:4 ... 4:1, a video too short for the
            conditioner, `audio: true` on a file without sound.
    """
    from h3render.references import probe_reference

    mapping = entry if isinstance(entry, Mapping) else {"path": entry}
    given = mapping["path"]
    path = resolve_reference_path(given, base_dir).absolute()
    kind, sha256, info = probe_reference(path, mapping.get("type"))
    if kind == "image":
        if mapping.get("audio"):
            raise ValueError(f"{path}: an image reference has no sound (audio: true)")
        use_audio = False
    elif kind == "audio":
        if mapping.get("audio") is False:
            raise ValueError(f"{path}: an audio reference is its sound (audio: false leaves nothing)")
        use_audio = True
    else:
        use_audio = bool(info.get("has_audio")) and mapping.get("audio", not no_audio)
        if mapping.get("audio") and not info.get("has_audio"):
            raise ValueError(f"{path}: audio: true, but the video has no audio stream")
    return ReferenceRef(type=kind, given=given, path=str(path), sha256=sha256, use_audio=use_audio, info=info,
                        type_given="type" in mapping)


def references_problem(refs: list[ReferenceRef]) -> str | None:
    """Why a job's references cannot go together (counts, audio alone), or None (diffusers'
    `MiniMaxH3Ref2VASetupStep` rules)."""
    counts = {t: sum(r.type == t for r in refs) for t in REFERENCE_TYPES}
    for kind, limit in MAX_PER_TYPE.items():
        if counts[kind] > limit:
            return f"{counts[kind]} {kind} references; MiniMax-H3 takes at most {limit}"
    if len(refs) > MAX_REFERENCES:
        return f"{len(refs)} references; MiniMax-H3 takes at most {MAX_REFERENCES} in all"
    if refs and counts["audio"] == len(refs):
        return "audio references alone are not supported: pair them with an image or video reference"
    return None


def unsupported_problems(refs: list[ReferenceRef]) -> list[tuple[str, str]]:
    """What h3render cannot render yet among valid references (`RENDERABLE_TYPES`): ``("[i]", message)`` for each
    such reference, `i` its place in the list; [] when it renders them all."""
    problems = []
    for i, ref in enumerate(refs):
        if ref.type not in RENDERABLE_TYPES:
            problems.append((f"[{i}]", f"{ref.given}: video references (the conditioner's video presentation) are "
                                       f"not in h3render yet; ref2va renders image references and 32 kHz audio clips "
                                       f"today"))
        elif ref.type == "audio" and ref.info.get("sample_rate") != AUDIO_RATE:
            problems.append((f"[{i}]", f"{ref.given}: audio at {ref.info.get('sample_rate')} Hz needs resampling to "
                                       f"{AUDIO_RATE} Hz, which h3render does not do yet (e.g. ffmpeg -i IN -ar "
                                       f"{AUDIO_RATE} OUT.wav)"))
    return problems
