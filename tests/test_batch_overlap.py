"""The overlapped batch queue (`run_batch(..., overlap=True)`) with a fake two-phase renderer: job N's finish runs on
the worker thread beside job N+1's begin; failures in either phase stay with their job; interrupts stop the in-flight
finish cleanly; an out-of-memory error beside the other phase is retried alone. The fake synchronizes its phases
with events, so each test forces the interleaving it checks instead of relying on timing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from h3render.batch import run_batch
from tests.test_batch import FakeRenderer, files_under, make_jobs, read_report

WAIT_S = 5.0  # upper bound for any event a test waits on (the tests take well under a second when correct)


class PhasedRenderer:
    """`begin`/`finish` like `pipeline.Renderer`, writing the MP4 and sidecar through temp names and renames.

    Records `calls` (job id, phase, shared) and its own wall intervals `spans[(id, phase)]`. `events[(id, phase)]`
    is set when that phase starts; a hook may wait on them to force an interleaving.

    Args:
        begin_hook / finish_hook: `hook(job_id, renderer)` called inside the phase (after its start is recorded).
        fail_begin / fail_finish: job ids whose phase raises ValueError (a finish after renaming its MP4 into place
            and writing its temp sidecar: the worst moment).
        oom_when_shared: (job id, phase) pairs that raise MemoryError while `shared` is true.
        chunks: a finish calls `cancel()` between this many chunks, `chunk_s` apart.
    """

    def __init__(self, begin_hook=None, finish_hook=None, fail_begin=(), fail_finish=(), oom_when_shared=(),
                 chunks=3, chunk_s=0.0):
        self.begin_hook, self.finish_hook = begin_hook, finish_hook
        self.fail_begin, self.fail_finish = set(fail_begin), set(fail_finish)
        self.oom_when_shared = set(oom_when_shared)
        self.chunks, self.chunk_s = chunks, chunk_s
        self.calls: list[tuple[str, str, bool]] = []
        self.spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self.events: dict[tuple[str, str], threading.Event] = {}
        self.lock = threading.Lock()

    def event(self, job_id: str, phase: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault((job_id, phase), threading.Event())

    def _enter(self, job_id: str, phase: str, shared: bool) -> float:
        with self.lock:
            self.calls.append((job_id, phase, shared))
        self.event(job_id, phase).set()
        return time.perf_counter()

    def _leave(self, job_id: str, phase: str, t0: float) -> None:
        with self.lock:
            self.spans.setdefault((job_id, phase), []).append((t0, time.perf_counter()))

    def render(self, job, mp4, sidecar):  # not used by the overlapped queue
        return self.finish(self.begin(job, mp4, sidecar))

    def begin(self, job, mp4: Path, sidecar: Path, *, shared: bool = False):
        t0 = self._enter(job.id, "begin", shared)
        try:
            if self.begin_hook is not None:
                self.begin_hook(job.id, self)
            if shared and (job.id, "begin") in self.oom_when_shared:
                raise MemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
            if job.id in self.fail_begin:
                raise ValueError("denoising produced non-finite latents (NaN/Inf); no video written")
            return SimpleNamespace(job=job, mp4=mp4, sidecar=sidecar)
        finally:
            self._leave(job.id, "begin", t0)

    def finish(self, pending, *, shared=False, side_stream=False, cancel=None, overlap=None):
        job, mp4, sidecar = pending.job, pending.mp4, pending.sidecar
        t0 = self._enter(job.id, "finish", shared)
        try:
            tmp_mp4, tmp_json = mp4.with_name(mp4.stem + ".tmp.mp4"), sidecar.with_name(sidecar.name + ".tmp")
            if shared and (job.id, "finish") in self.oom_when_shared:
                raise MemoryError("CUDA out of memory. Tried to allocate 30.00 GiB")
            tmp_mp4.write_bytes(b"\x00\x00\x00\x18ftypisom")
            if self.finish_hook is not None:
                self.finish_hook(job.id, self)
            for _ in range(self.chunks):
                if cancel is not None:
                    cancel()
                time.sleep(self.chunk_s)
                with open(tmp_mp4, "ab") as f:
                    f.write(job.prompt.encode())
            os.replace(tmp_mp4, mp4)
            doc = {"job": job.params(), "timings": {"overlap": overlap() if overlap is not None else None}}
            tmp_json.write_text(json.dumps(doc))
            if job.id in self.fail_finish:
                raise ValueError("the video VAE produced non-finite pixels at frame 0")
            os.replace(tmp_json, sidecar)
            return doc
        finally:
            self._leave(job.id, "finish", t0)


def run(jobs, renderer, out, **kw):
    return run_batch(jobs, lambda: renderer, out, progress=False, overlap=True, **kw)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def wait_for(renderer: PhasedRenderer, job_id: str, phase: str) -> None:
    assert renderer.event(job_id, phase).wait(WAIT_S), f"{job_id} {phase} never started (no overlap?)"


def sidecar(out: Path, name: str) -> dict:
    return json.loads((out / f"sub/{name}.json").read_text())


def test_finish_runs_beside_the_next_begin(tmp_path):
    """Each finish waits (inside) until the next job's begin has started: possible only if they overlap."""
    seen_next_begin = {}

    def finish_hook(job_id, r):
        following = {"j0": "j1", "j1": "j2"}.get(job_id)
        if following is not None:
            seen_next_begin[job_id] = r.event(following, "begin").wait(WAIT_S)
            time.sleep(0.05)  # still decoding while the next begin runs

    def begin_hook(job_id, r):
        time.sleep(0.2)

    r = PhasedRenderer(begin_hook=begin_hook, finish_hook=finish_hook)
    jobs = make_jobs(3)
    report = run(jobs, r, tmp_path)
    assert report.exit_code == 0 and [j.status for j in report.jobs] == ["succeeded"] * 3
    assert seen_next_begin == {"j0": True, "j1": True}
    # begin j1/j2 shared the device with a finish; j2's finish (last job) ran alone
    assert [c for c in r.calls if c[1] == "begin"] == [("j0", "begin", False), ("j1", "begin", True),
                                                      ("j2", "begin", True)]
    assert [c for c in r.calls if c[1] == "finish"] == [("j0", "finish", True), ("j1", "finish", True),
                                                       ("j2", "finish", False)]
    # The renderer's own clock: finish j0 intersects begin j1, finish j1 intersects begin j2.
    f0_b1 = intersection(r.spans[("j0", "finish")], r.spans[("j1", "begin")])
    f1_b2 = intersection(r.spans[("j1", "finish")], r.spans[("j2", "begin")])
    assert f0_b1 > 0.04 and f1_b2 > 0.04  # at least the 0.05 s each finish decodes after the next begin started
    # At most one finish in flight: finish j1 starts after finish j0 ended.
    assert r.spans[("j1", "finish")][0][0] >= r.spans[("j0", "finish")][0][1]

    # The sidecar of j1 names both neighbours, with the intersections the renderer saw (within scheduling slack).
    ov = sidecar(tmp_path, "j1")["timings"]["overlap"]
    assert ov["finish"] == "overlapped" and ov["skipped"] is None
    with_ = {(w["job"], w["phase"], w["while"]): w["seconds"] for w in ov["with"]}
    assert set(with_) == {("j0", "finish", "begin"), ("j2", "begin", "finish")}
    assert abs(with_[("j0", "finish", "begin")] - f0_b1) < 0.05
    assert abs(with_[("j2", "begin", "finish")] - f1_b2) < 0.05
    assert ov["overlapped_s"] == pytest.approx(sum(with_.values()), abs=1e-5)
    assert sidecar(tmp_path, "j2")["timings"]["overlap"]["finish"] == "alone"

    data = read_report(tmp_path)
    assert data["format"] == 2 and data["overlap"]["enabled"] is True
    assert data["overlap"]["overlapped_finishes"] == 2 and data["overlap"]["skipped"] == 0
    lines = [j["overlap"] for j in data["jobs"]]
    assert [o["with"] for o in lines] == ["j1", "j2", None]
    assert abs(lines[0]["overlapped_s"] - f0_b1) < 0.05
    # Not double counted: the jobs' own phase seconds minus the reported overlap is the time the renderer was busy
    # (the union of its phase intervals, by its own clock); the queue's wall time covers that once.
    busy = sum(j["seconds"] for j in data["jobs"])
    union = sum(e - s for s, e in merge([iv for spans in r.spans.values() for iv in spans]))
    assert busy - data["overlap"]["overlapped_s"] == pytest.approx(union, abs=0.05)
    assert busy - union > 0.08  # the two overlaps, each > 0.04 s, were really subtracted
    assert data["queue_seconds"] >= union


def test_failure_in_a_finish_fails_only_that_job(tmp_path):
    r = PhasedRenderer(fail_finish={"j0"})
    report = run(make_jobs(3), r, tmp_path)
    assert [j.status for j in report.jobs] == ["failed", "succeeded", "succeeded"]
    assert report.exit_code == 1
    assert report.jobs[0].error == "ValueError: the video VAE produced non-finite pixels at frame 0"
    assert ("j0", "finish", True) in r.calls  # it failed while overlapped
    # j0 had renamed its MP4 and written its temp sidecar: both gone.
    assert files_under(tmp_path) == {"batch-report.json"} | {f"sub/j{i}.{e}" for i in (1, 2) for e in ("mp4", "json")}
    assert read_report(tmp_path)["jobs"][0]["status"] == "failed"


def test_failure_in_a_begin_leaves_the_finish_beside_it_alone(tmp_path):
    """j1's begin fails while j0's finish is in flight (forced: the finish waits for that failure)."""
    begin_failed = threading.Event()

    def begin_hook(job_id, r):
        if job_id == "j1":
            wait_for(r, "j0", "finish")

    def finish_hook(job_id, r):
        if job_id == "j0":
            assert begin_failed.wait(WAIT_S)

    class Renderer(PhasedRenderer):
        def begin(self, job, mp4, sidecar, *, shared=False):
            try:
                return super().begin(job, mp4, sidecar, shared=shared)
            except ValueError:
                begin_failed.set()
                raise

    r = Renderer(begin_hook=begin_hook, finish_hook=finish_hook, fail_begin={"j1"})
    report = run(make_jobs(3), r, tmp_path)
    assert [j.status for j in report.jobs] == ["succeeded", "failed", "succeeded"]
    assert report.jobs[1].error.startswith("ValueError: denoising produced non-finite latents")
    assert intersection(r.spans[("j0", "finish")], r.spans[("j1", "begin")]) > 0
    assert not any(p.startswith("sub/j1.") for p in files_under(tmp_path))
    assert (tmp_path / "sub/j0.mp4").is_file() and (tmp_path / "sub/j2.json").is_file()


def test_fail_fast_leaves_the_job_beside_the_failed_finish_pending(tmp_path):
    r = PhasedRenderer(fail_finish={"j0"})
    report = run(make_jobs(4), r, tmp_path, fail_fast=True)
    assert [j.status for j in report.jobs] == ["failed", "pending", "pending", "pending"]
    assert report.exit_code == 1
    assert ("j2", "begin", True) not in r.calls and files_under(tmp_path) == {"batch-report.json"}


def test_interrupt_while_a_finish_is_in_flight_abandons_it_cleanly(tmp_path):
    """SIGINT arrives while j1's begin runs and j0's finish is mid-decode: j0 stops at its next chunk, its temp MP4
    goes; nothing partial anywhere; exit 130; a rerun renders everything."""

    def begin_hook(job_id, r):
        if job_id == "j1":
            wait_for(r, "j0", "finish")
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler raises here
                time.sleep(0.001)
            raise AssertionError("the interrupt was lost")

    r = PhasedRenderer(begin_hook=begin_hook, chunks=500, chunk_s=0.01)  # a 5 s finish unless cancelled
    t0 = time.perf_counter()
    report = run(make_jobs(3), r, tmp_path)
    assert time.perf_counter() - t0 < 3.0  # the finish was cancelled, not waited out
    assert report.exit_code == 130
    data = read_report(tmp_path)
    assert data["state"] == "interrupted" and data["exit_code"] == 130
    assert [j["status"] for j in data["jobs"]] == ["interrupted", "interrupted", "pending"]
    assert data["jobs"][0]["error"] == "Interrupted: SIGINT received; the job's decode was abandoned"
    assert data["jobs"][1]["error"] == "Interrupted: SIGINT received"
    assert files_under(tmp_path) == {"batch-report.json"}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    report = run(make_jobs(3), PhasedRenderer(), tmp_path)
    assert [j.status for j in report.jobs] == ["succeeded"] * 3


def test_interrupt_after_the_finish_completed_keeps_its_job(tmp_path):
    """The finish ignores the stop request (it had no chunk left): its job is reported succeeded, files kept."""

    def begin_hook(job_id, r):
        if job_id == "j1":
            wait_for(r, "j0", "finish")
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                time.sleep(0.001)

    def finish_hook(job_id, r):
        if job_id == "j0":
            time.sleep(0.3)  # the interrupt arrives meanwhile; no cancel() call follows (chunks=0)

    r = PhasedRenderer(begin_hook=begin_hook, finish_hook=finish_hook, chunks=0)
    report = run(make_jobs(3), r, tmp_path)
    assert report.exit_code == 130
    assert [j.status for j in report.jobs] == ["succeeded", "interrupted", "pending"]
    assert report.jobs[1].error == "Interrupted: SIGTERM received"
    assert files_under(tmp_path) == {"batch-report.json", "sub/j0.mp4", "sub/j0.json"}
    # resume: only j1 and j2 are rendered
    r2 = PhasedRenderer()
    run(make_jobs(3), r2, tmp_path)
    assert [c[0] for c in r2.calls if c[1] == "begin"] == ["j1", "j2"]


def test_report_is_rewritten_when_a_finish_ends_during_the_next_begin(tmp_path):
    """j0's outcome reaches batch-report.json while j1's begin still runs (a SIGKILL then would not lose it)."""
    seen = {}

    def begin_hook(job_id, r):
        if job_id == "j1":
            deadline = time.perf_counter() + WAIT_S
            while time.perf_counter() < deadline:
                status = read_report(tmp_path)["jobs"][0]["status"]
                if status != "pending":
                    break
                time.sleep(0.01)
            seen["j0"] = status

    run(make_jobs(2), PhasedRenderer(begin_hook=begin_hook), tmp_path)
    assert seen == {"j0": "succeeded"}


@pytest.mark.parametrize("phase", ["finish", "begin"])
def test_out_of_memory_beside_the_other_phase_is_retried_alone(tmp_path, phase):
    who = "j0" if phase == "finish" else "j1"
    r = PhasedRenderer(oom_when_shared={(who, phase)})
    report = run(make_jobs(3), r, tmp_path)
    assert [j.status for j in report.jobs] == ["succeeded"] * 3 and report.exit_code == 0
    assert (who, phase, True) in r.calls and (who, phase, False) in r.calls  # failed shared, then ran alone
    data = read_report(tmp_path)
    assert "out of memory" in data["overlap"]["disabled_after"]
    lines = [j["overlap"] for j in data["jobs"]]
    assert lines[0]["retried_alone_after" if phase == "finish" else "finish"] == (
        "MemoryError: CUDA out of memory. Tried to allocate 30.00 GiB" if phase == "finish" else "overlapped")
    # after the out-of-memory error no finish overlaps any more
    assert [c for c in r.calls if c[1] == "finish"][-2:] == [("j1", "finish", False), ("j2", "finish", False)]
    assert "out of memory" in lines[1]["skipped"]
    if phase == "begin":  # j1's begin was the phase re-run alone
        assert lines[0]["retried_alone_after"] is None
        oom = "MemoryError: CUDA out of memory. Tried to allocate 9.00 GiB"
        assert lines[1]["retried_alone_after"] == oom
        assert sidecar(tmp_path, "j1")["timings"]["overlap"]["retried_alone_after"] == oom
        assert report.jobs[1].overlap["skipped"].startswith("out of memory in job 2's begin")


def test_plan_overlap_refusal_runs_the_pair_one_after_the_other(tmp_path):
    refusal = SimpleNamespace(ok=False, reason="1.0 GB free < 8.0 GB needed (overlap_min_free_gb)",
                              to_dict=lambda: {"ok": False, "free_gb": 1.0, "need_gb": 8.0})
    r = PhasedRenderer()
    r.plan_overlap = lambda pending, next_job: refusal
    run(make_jobs(3), r, tmp_path)
    assert all(not shared for _, _, shared in r.calls)
    assert intersection(r.spans[("j0", "finish")], r.spans[("j1", "begin")]) == 0
    data = read_report(tmp_path)
    assert data["overlap"]["skipped"] == 2 and data["overlap"]["overlapped_finishes"] == 0
    assert [j["overlap"]["skipped"] for j in data["jobs"]] == [refusal.reason, refusal.reason, None]
    ov = sidecar(tmp_path, "j0")["timings"]["overlap"]
    assert ov["finish"] == "alone" and ov["with"] == [] and ov["memory"]["need_gb"] == 8.0


def test_renderer_without_phases_runs_sequentially_and_says_why(tmp_path):
    renderer = FakeRenderer()
    report = run(make_jobs(2), renderer, tmp_path)
    assert report.exit_code == 0 and renderer.rendered == ["j0", "j1"]
    data = read_report(tmp_path)
    assert data["overlap"] == {"enabled": False, "reason": "the renderer has no begin/finish phases"}
    assert "overlap" not in data["jobs"][0] and data["queue_seconds"] >= 0

    class Leader(FakeRenderer):
        overlap_unsupported = "several ranks: jobs run one after another"

    run(make_jobs(2), Leader(), tmp_path / "leader")
    assert read_report(tmp_path / "leader")["overlap"]["reason"] == "several ranks: jobs run one after another"


class Payload:
    """Stands in for a job's device tensors."""


def test_failed_finish_memory_is_released_before_the_next_begin(tmp_path):
    """j0's finish fails holding its payload in a reference cycle (only a garbage collection frees it); the queue
    collects at the next idle point, so it is gone when j2's begin starts. Successful jobs skip the collection."""
    import gc
    import sys
    import weakref

    refs, freed_at_begin = {}, {}

    class Leaky(PhasedRenderer):
        def begin(self, job, mp4, sidecar, *, shared=False):
            if "j0" in refs:
                freed_at_begin[job.id] = refs["j0"]() is None
            return super().begin(job, mp4, sidecar, shared=shared)

        def finish(self, pending, **kw):
            if pending.job.id == "j0":
                payload = Payload()
                refs["j0"] = weakref.ref(payload)
                payload.frame = sys._getframe()  # payload -> frame -> locals -> payload: a cycle
                raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")  # alone: not retried
            return super().finish(pending, **kw)

    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(phase) if phase == "start" else None)
    gc.disable()  # only the queue's own collection may free the cycle
    try:
        r = Leaky()
        r.plan_overlap = lambda pending, next_job: SimpleNamespace(ok=False, reason="test: alone",
                                                                  to_dict=lambda: {})
        report = run(make_jobs(3), r, tmp_path)
    finally:
        gc.enable()
        gc.callbacks.pop()
    assert [j.status for j in report.jobs] == ["failed", "succeeded", "succeeded"]
    assert freed_at_begin == {"j1": True, "j2": True}
    assert len(collections) == 1  # after the failure only
