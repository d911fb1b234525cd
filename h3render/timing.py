"""Stage timing for one job and the software versions it ran on (the sidecar itself: `h3render.sidecar`).

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

import functools
import importlib.metadata
import io
import platform
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np
import torch

import h3render
from h3render.spec import FPS

__all__ = ["STAGES", "StageTimer", "device_name", "merge_intervals", "utc_now", "versions"]

STAGES = ("load", "text_encode", "denoise", "vae_video", "vae_audio", "to_uint8_d2h", "encode_mux", "total")
# Stages that are parts (or latencies) of another stage, so they never count as concurrency: the VAE forwards
# (`vae_decode`) and the conversion to uint8 (`to_uint8_d2h`) inside `vae_video`, and `mp4_close_after_decode`
# (last frame handed over -> MP4 in place), the end of `encode_mux` seen from the decoding thread.
SUBSTAGES = ("vae_decode", "to_uint8_d2h", "mp4_close_after_decode")

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
        self._since_take = 0  # peak since the last take_peak (a window of a windowed job)
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
                self._since_take = max(self._since_take, peak)
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

    def take_peak(self) -> int | None:
        """Peak allocated device memory since the last `take_peak` (or the timer's start), then start over: one
        window's peak in a windowed job (outside any stage; None off CUDA). The job's peak keeps counting."""
        if not self._cuda:
            return None
        peak = max(self._since_take, torch.cuda.max_memory_allocated(self.device))
        self._job_peak = max(self._job_peak, peak)
        self._since_take = 0
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

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


def _distribution(name: str) -> str | None:
    """The installed version of distribution `name` (its metadata: importing transformers takes seconds), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def checkout_commit() -> str | None:
    """The git commit h3render runs from (``git rev-parse HEAD``, with ``+dirty`` when tracked files differ from it),
    when the package is a checkout's own ``h3render/`` folder; None for an installed wheel, without git, or when the
    folder sits in some other repository (a venv inside a project's work tree). Once per process."""
    package = Path(h3render.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() / "h3render" != package:
        return None
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+dirty" if dirty else "")


_X264_SEI = re.compile(rb"x264 - (core \d+[^\0]*?) - H\.264")


@functools.lru_cache(maxsize=1)
def x264_version() -> str | None:
    """libx264's version as it writes it into the SEI of every stream it encodes ("core 165", or "core 164 r3108
    31e19f9" where the build states its revision), for the sidecar's `versions.x264`: PyAV states only FFmpeg's
    version, and the x264 inside a PyAV wheel is its own build. One 16x16 frame encoded in memory, once per process
    (about 10 ms); None when libx264 is missing or writes no such line."""
    try:
        import av

        container = av.open(io.BytesIO(), "w", format="h264")
        stream = container.add_stream("libx264", rate=FPS, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((24, 16), dtype=np.uint8), format="yuv420p")
        packets = stream.encode(frame) + stream.encode(None)
    except Exception:  # a version line is not worth failing a render for
        return None
    found = _X264_SEI.search(b"".join(bytes(p) for p in packets))
    return found.group(1).decode("ascii", "replace") if found else None


def versions() -> dict[str, Any]:
    """Software and hardware this job ran on: h3render (with ``h3render_commit``, the checkout's git commit, or
    None), Python, torch, transformers, CUDA runtime (None on a CPU build), cuDNN, NVIDIA driver (from
    ``nvidia-smi``; None without it), GPU names, PyAV, its FFmpeg and the libx264 that encodes (`x264_version`).
    """
    try:
        import av

        pyav, ffmpeg = av.__version__, av.ffmpeg_version_info
    except ImportError:
        pyav = ffmpeg = None
    cuda_ok = torch.cuda.is_available()
    return {
        "h3render": h3render.__version__,
        "h3render_commit": checkout_commit(),
        "transformers": _distribution("transformers"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda_ok else None,
        "driver": _nvidia_driver() if cuda_ok else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "pyav": pyav,
        "ffmpeg": ffmpeg,
        "x264": x264_version(),
    }
