"""The JSON sidecar beside each MP4: its document, its atomic write, and reading it back for resume.

One home for the sidecar's format (docs/sidecar.md; docs/schema/sidecar.schema.json checks it,
tests/e2e/test_sidecar_schema.py): `write_sidecar` builds and writes the document, `read_sidecar` parses one,
`media_record` / `media_mismatch` tie a sidecar to the exact MP4 it describes, and `rendered_with` compares an
earlier render's record with this run's settings (resume's "skipped: rendered earlier with ..." line).

Front-end layer: no torch. A tensor handed to `write_sidecar` is stored through its own ``.tolist()``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Union

# 2: top-level "run" (device, dtypes, attention, output, start time); timings.overlapped_s -> concurrent_s;
#    extra.writer in seconds (durations) instead of perf_counter instants
# 3: run.precision is the engine's --precision ("bf16" / "fp8") and run.precision_components what each component
#    computes in (`models.fp8.precision_report`); the per-component dtypes run.precision held moved to run.dtypes
# 4: run.argv; versions.transformers, versions.x264, versions.h3render_commit; extra.audio (the soundtrack's level);
#    extra.windows for a job rendered in several windows
# 5: run.precision and run.memory.precision say what ran ("fp32" too: a CPU run's default), not the --precision
#    setting, whose "bf16" means no FP8 (`spec.ran_precision`)
SIDECAR_SCHEMA = 5


def rendered_with(sidecar: Mapping[str, Any], checkpoint: Mapping[str, Any], encoder: Mapping[str, Any]) -> str | None:
    """For resume's "skipped" line: how an existing sidecar's render differs from this run's settings.

    Args:
        sidecar: the parsed sidecar of a job resume skips.
        checkpoint: this run's ``{"path", "config_hash"}``, with ``--transformer`` ``"transformer"`` (its path), and
            optionally ``"precision"`` (``--precision``).
        encoder: this run's ``{"crf", "x264_preset"}``.
    Returns:
        e.g. ``"rendered earlier with checkpoint /m/a (now /m/b), crf 18 (now 23)"``, or None when nothing recorded
        differs (a schema-1 sidecar has no encoder settings: only its checkpoint is compared; schema 1 and 2 knew
        only bf16 precision).
    """
    was = sidecar.get("checkpoint") or {}
    then_encoder = (sidecar.get("run") or {}).get("encoder") or {}
    then_run = sidecar.get("run") or {}
    then_precision = then_run.get("precision")
    then_precision = then_precision if isinstance(then_precision, str) else "bf16"  # schema 2: a dtype mapping
    if then_precision == "bf16" and then_run.get("dtype") == "float32":
        then_precision = "fp32"  # schema 3 and 4 recorded the setting, whose bf16 meant no FP8, for an fp32 run
    pairs = [("checkpoint", was.get("path"), checkpoint.get("path")),
             ("checkpoint config", was.get("config_hash"), checkpoint.get("config_hash")),
             ("--transformer", (was.get("transformer") or {}).get("path"), checkpoint.get("transformer")),
             ("crf", then_encoder.get("crf", encoder.get("crf")), encoder.get("crf")),
             ("x264 preset", then_encoder.get("x264_preset", encoder.get("x264_preset")), encoder.get("x264_preset")),
             ("precision", then_precision, checkpoint.get("precision", then_precision))]
    changes = [f"{name} {then if then is not None else 'none'} (now {now if now is not None else 'none'})"
               for name, then, now in pairs if then != now]
    if changes and changes[0].startswith("checkpoint ") and len(changes) > 1 and changes[1].startswith(
            "checkpoint config"):
        del changes[1]  # another path: its config hash differs too, which says nothing more
    return f"rendered earlier with {', '.join(changes)}" if changes else None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "detach"):  # a torch tensor, on any device (this module never imports torch)
        return value.detach().cpu().tolist()
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    raise TypeError(f"sidecar: cannot store {type(value).__name__} as JSON")


def write_sidecar(
    path: Union[str, os.PathLike],
    *,
    job_params: Mapping[str, Any],
    checkpoint: Mapping[str, Any],
    sigmas: Mapping[str, Any],
    timings: Mapping[str, Any],
    versions: Mapping[str, Any],
    run: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    media: Union[str, os.PathLike, None] = None,
) -> Path:
    """Write the job's JSON sidecar atomically (``<name>.tmp`` in the same folder, fsync, rename).

    Args:
        path: target file, e.g. ``clip.json`` beside ``clip.mp4``.
        job_params: the resolved job (prompt, seed, canvas, frames, steps, ...).
        checkpoint: which weights (layout, path, revision/hashes, adapters fused).
        sigmas: schedules actually used, e.g. ``{"video": [...], "audio": [...]}`` (tensors accepted).
        timings: a ready dict (`timing.StageTimer.summary()`), or any object with such a ``summary()``.
        versions: `timing.versions()`.
        run: what ran and where to (device, dtypes, attention backends, output path, start time; docs/sidecar.md),
            stored under ``"run"`` (omitted when None).
        extra: anything else, stored under ``"extra"``.
        media: the finished MP4 this sidecar describes, already in place: its `media_record` (size, mtime,
            sha256) is stored under ``"mp4"``, so that resume can tell a truncated or replaced MP4 from this one.
    Returns:
        ``Path(path)``.
    Raises:
        ValueError: a value JSON cannot hold (NaN/inf included: the sidecar is strict JSON).
        OSError: the sidecar (or the MP4, for its hash) could not be written or read; the message names the file.
    """
    path = Path(path)
    doc = {
        "schema": SIDECAR_SCHEMA,
        "job": dict(job_params),
        "checkpoint": dict(checkpoint),
        "sigmas": dict(sigmas),
        "timings": timings.summary() if hasattr(timings, "summary") else dict(timings),
        "versions": dict(versions),
        "extra": dict(extra or {}),
    }
    if media is not None:
        doc["mp4"] = media_record(media)
    if run is not None:
        doc["run"] = dict(run)
    try:
        text = json.dumps(doc, indent=2, default=_jsonable, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: sidecar not JSON-serializable: {exc}") from exc
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a write() error carries no file name (ENOSPC at the sidecar said only "No space")
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"{path}: could not write the sidecar: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


_HASH_CHUNK = 1 << 20


def media_record(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """``{"name", "bytes", "mtime_ns", "sha256"}`` of a finished file (read once, 1 MiB at a time: ~20 ms for a
    20 MB clip, on the writer's thread beside the next job).

    Raises:
        OSError: the file cannot be read (the message names it).
    """
    path = Path(path)
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
    except OSError as exc:
        raise OSError(exc.errno, f"{path}: cannot read it to record its hash: {exc.strerror or exc}") from exc
    return {"name": path.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def media_mismatch(path: Union[str, os.PathLike], record: Any) -> str | None:
    """Why the file at `path` is not the one `record` (`media_record`) describes ("MP4 size differs", "MP4
    content differs", "MP4 unreadable", "MP4 record unreadable"), or None when it is. The size is checked
    first; the hash only when the mtime differs from the recorded one (a copy without times, a replaced file), so a
    resume over a thousand untouched clips reads none of them."""
    if not (isinstance(record, dict) and isinstance(record.get("bytes"), int)
            and isinstance(record.get("sha256"), str)):
        return "MP4 record unreadable"
    try:
        st = os.stat(path)
    except OSError:
        return "MP4 unreadable"
    if st.st_size != record["bytes"]:
        return "MP4 size differs from its sidecar"
    if st.st_mtime_ns == record.get("mtime_ns"):
        return None
    try:
        now = media_record(path)["sha256"]
    except OSError:
        return "MP4 unreadable"
    return None if now == record["sha256"] else "MP4 content differs from its sidecar"


class SidecarUnreadable(ValueError):
    """A sidecar file that is missing, not JSON, or not a JSON object."""


def read_sidecar(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The parsed sidecar at `path`.

    Raises:
        SidecarUnreadable: the file cannot be read, is not JSON, or its top level is not an object (the message
            names the file).
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SidecarUnreadable(f"{path}: sidecar unreadable: {exc}") from None
    if not isinstance(doc, dict):
        raise SidecarUnreadable(f"{path}: sidecar is not a JSON object")
    return doc
