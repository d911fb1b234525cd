"""Stage timing for one job, software versions, and the JSON sidecar written beside each MP4.

Times are wall-clock ``time.perf_counter`` seconds. On CUDA a stage synchronizes the device at its edges,
so a stage's time includes the kernels it queued (without that, asynchronous launches would bill their
work to whichever stage syncs next). Each stage keeps its wall intervals ``[start, end]``; totals come from
the intervals, so stages that run at the same time (VAE decode on the GPU while the encoder thread muxes)
are reported as they happened and the job total is the union of intervals, never a double-counted sum.

Stage names used by the pipeline: load, text_encode, denoise (with per-step entries), vae_video, vae_audio,
to_uint8_d2h, encode_mux, total. Every field of the sidecar is described in docs/sidecar.md, and
docs/schema/sidecar.schema.json checks it (tests/e2e/test_sidecar_schema.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Union

import torch

import h3render

__all__ = ["SIDECAR_SCHEMA", "STAGES", "StageTimer", "device_name", "media_mismatch", "media_record", "merge_intervals",
           "rendered_with", "utc_now", "versions", "write_sidecar"]

STAGES = ("load", "text_encode", "denoise", "vae_video", "vae_audio", "to_uint8_d2h", "encode_mux", "total")
# Stages that are parts (or latencies) of another stage, so they never count as concurrency: the VAE forwards
# (`vae_decode`) and the conversion to uint8 (`to_uint8_d2h`) inside `vae_video`, and `mp4_close_after_decode`
# (last frame handed over -> MP4 in place), the end of `encode_mux` seen from the decoding thread.
SUBSTAGES = ("vae_decode", "to_uint8_d2h", "mp4_close_after_decode")
# 2: top-level "run" (device, dtypes, attention, output, start time); timings.overlapped_s -> concurrent_s;
#    extra.writer in seconds (durations) instead of perf_counter instants
# 3: run.precision is the engine's --precision ("bf16" / "fp8") and run.precision_components what each component
#    computes in (`models.fp8.precision_report`); the per-component dtypes run.precision held moved to run.dtypes
SIDECAR_SCHEMA = 3

Interval = tuple[float, float]


def merge_intervals(intervals: list[Interval]) -> list[Interval]:
    """Union of closed intervals, sorted and non-overlapping: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in merge_intervals(intervals))


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    a, b = merge_intervals(a), merge_intervals(b)
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class StageTimer:
    """Per-job stage timer. Make a new one per job: construction resets the device's peak-memory counter.

    Args:
        device: where the job runs; a CUDA device makes stage edges synchronize it and enables peak memory (the
            device's peak-memory counter is reset at construction and at each outermost stage, so that
            ``stage_peak_bytes`` is per stage).

    Usage::

        timer = StageTimer(device)
        with timer.stage("denoise"):
            for i in range(steps):
                with timer.step("denoise"):
                    ...
        timer.add_interval("encode_mux", writer.marks["start"], writer.marks["end"])  # from another thread
        with timer.warmup("compile"):  # kept apart from the stage totals
            ...
        timer.summary()

    Recording is thread-safe. Use ``stage``/``step`` on the thread that drives the device and
    ``add_interval`` for work measured elsewhere (the encoder thread's ``Mp4Writer.marks``); per-stage peak
    memory assumes one thread runs outermost stages at a time.
    """

    def __init__(self, device: Union[torch.device, str, None] = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._lock = threading.Lock()
        self.intervals: dict[str, list[Interval]] = {}
        self.steps: dict[str, list[float]] = {}
        self.warmups: dict[str, float] = {}
        self.stage_peak_bytes: dict[str, int] = {}
        self._local = threading.local()  # stage nesting depth, per thread
        self._job_peak = 0
        self._frozen_peak: int | None = None
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def cuda(self) -> bool:
        """Whether this timer synchronizes a CUDA device and records peak memory."""
        return self._cuda

    @staticmethod
    def now() -> float:
        """The clock every interval is on (``time.perf_counter``, seconds)."""
        return time.perf_counter()

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def add_interval(self, name: str, start: float, end: float) -> None:
        """Record that stage ``name`` ran over ``[start, end]`` (``perf_counter`` seconds), e.g. measured on
        the encoder thread. Raises ValueError if end < start."""
        if end < start:
            raise ValueError(f"stage {name!r}: interval ends before it starts ({start} > {end})")
        with self._lock:
            self.intervals.setdefault(name, []).append((start, end))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage, synchronizing the CUDA device at both edges. Outermost stages also record their peak allocated device memory (bytes) in ``stage_peak_bytes``;
        a stage may be entered several times."""
        depth = getattr(self._local, "depth", 0)
        outer = depth == 0
        self._sync()
        if self._cuda and outer:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._local.depth = depth + 1
        start = self.now()
        try:
            yield
        finally:
            self._sync()
            end = self.now()
            self._local.depth = depth
            self.add_interval(name, start, end)
            if self._cuda and outer:
                peak = torch.cuda.max_memory_allocated(self.device)
                self._job_peak = max(self._job_peak, peak)
                self.stage_peak_bytes[name] = max(self.stage_peak_bytes.get(name, 0), peak)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time one step inside stage ``name`` (e.g. one denoising forward); appended to ``steps[name]``.
        Synchronizes at both edges on CUDA."""
        self._sync()
        start = self.now()
        try:
            yield
        finally:
            self._sync()
            elapsed = self.now() - start
            with self._lock:
                self.steps.setdefault(name, []).append(elapsed)

    @contextmanager
    def warmup(self, name: str) -> Iterator[None]:
        """Time warm-up or compilation work apart from the stage totals (summed per name)."""
        self._sync()
        start = self.now()
        try:
            yield
        finally:
            self._sync()
            with self._lock:
                self.warmups[name] = self.warmups.get(name, 0.0) + self.now() - start

    def total(self, name: str) -> float:
        """Seconds stage ``name`` was running: the length of the union of its intervals (0 if never run)."""
        return _length(self.intervals.get(name, []))

    def overlap(self, *names: str) -> float:
        """Seconds during which all the named stages were running at once."""
        if not names:
            raise ValueError("overlap: name at least one stage")
        common = merge_intervals(self.intervals.get(names[0], []))
        for name in names[1:]:
            common = _intersect(common, self.intervals.get(name, []))
        return _length(common)

    def freeze_peak(self) -> None:
        """Fix the job's peak memory now: the job's device work is over (its MP4 tail runs on the host while the next
        job, with its own timer, already uses the device and the device-wide counter)."""
        self._frozen_peak = self.peak_memory_bytes()

    def peak_memory_bytes(self) -> int | None:
        """Peak allocated device memory over the job so far (None off CUDA)."""
        if not self._cuda:
            return None
        if self._frozen_peak is not None:
            return self._frozen_peak
        return max(self._job_peak, torch.cuda.max_memory_allocated(self.device))

    def summary(self) -> dict[str, Any]:
        """JSON-ready report.

        ``stages[name]``: ``seconds`` (union of its intervals), ``intervals`` (relative to the first recorded
        start), and ``steps`` where per-step entries exist. ``wall_s``: union of every interval except an
        explicit ``total`` (or that stage's length if recorded). ``concurrent_s``: sum of the stage seconds
        minus their union, over the stages other than ``total`` and `SUBSTAGES`: the stage time hidden by this
        job's stages running at the same time (the encoder thread's ``encode_mux`` beside ``vae_video``).
        """
        with self._lock:
            intervals = {k: list(v) for k, v in self.intervals.items()}
            steps = {k: list(v) for k, v in self.steps.items()}
            warmups = dict(self.warmups)
        every = [iv for k, v in intervals.items() if k != "total" for iv in v]
        origin = min((s for s, _ in every + intervals.get("total", [])), default=0.0)
        stages: dict[str, Any] = {}
        for name, ivs in intervals.items():
            entry: dict[str, Any] = {
                "seconds": _length(ivs),
                "intervals": [[s - origin, e - origin] for s, e in sorted(ivs)],
            }
            if name in steps:
                entry["steps"] = steps[name]
            stages[name] = entry
        for name, st in steps.items():
            stages.setdefault(name, {"seconds": sum(st), "intervals": [], "steps": st})
        top = {k: v for k, v in intervals.items() if k != "total" and k not in SUBSTAGES}
        stage_sum = sum(_length(v) for v in top.values())
        top_union = _length([iv for v in top.values() for iv in v])
        wall = _length(intervals["total"]) if "total" in intervals else _length(every)
        return {
            "stages": stages,
            "wall_s": wall,
            "concurrent_s": max(0.0, stage_sum - top_union),
            "warmup_s": warmups,
            "peak_memory_bytes": self.peak_memory_bytes(),
            "stage_peak_memory_bytes": dict(self.stage_peak_bytes),
        }


def _nvidia_driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()
    return first[0].strip() if first else None


def utc_now() -> str:
    """Now as ISO 8601 UTC with milliseconds, e.g. ``2026-12-01T09:30:12.345+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def device_name(device: Union[torch.device, str]) -> str:
    """What a device is, for the sidecar: the GPU's name (``torch.cuda.get_device_name``) or the CPU's model name
    (``/proc/cpuinfo``, else ``platform.processor()``, else the machine type)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def versions() -> dict[str, Any]:
    """Software and hardware this job ran on: h3render, Python, torch, CUDA runtime (None on a CPU build),
    cuDNN, NVIDIA driver (from ``nvidia-smi``; None without it), GPU names, PyAV and its FFmpeg."""
    try:
        import av

        pyav, ffmpeg = av.__version__, av.ffmpeg_version_info
    except ImportError:
        pyav = ffmpeg = None
    cuda_ok = torch.cuda.is_available()
    return {
        "h3render": h3render.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda_ok else None,
        "driver": _nvidia_driver() if cuda_ok else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "pyav": pyav,
        "ffmpeg": ffmpeg,
    }


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
    then_precision = (sidecar.get("run") or {}).get("precision")
    then_precision = then_precision if isinstance(then_precision, str) else "bf16"  # schema 2: a dtype mapping
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
    if isinstance(value, torch.Tensor):
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
    timings: Union[StageTimer, Mapping[str, Any]],
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
        timings: a :class:`StageTimer` (its ``summary()`` is stored) or a ready dict.
        versions: :func:`versions` output.
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
        "timings": timings.summary() if isinstance(timings, StageTimer) else dict(timings),
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
