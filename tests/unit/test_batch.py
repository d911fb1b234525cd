"""The batch queue with a fake renderer that writes small files through the real atomic pattern
(``<name>.tmp.mp4`` / ``<name>.tmp.json`` then rename): resume, failure isolation, fail-fast, interrupts, report."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from h3render import batch
from h3render.batch import run_batch


@dataclass(frozen=True)
class FakeJob:
    id: str | None
    prompt: str
    seed: int
    output: str

    def params(self) -> dict:
        return {"prompt": self.prompt, "seed": self.seed, "canvas": (64, 32)}


def make_jobs(n: int = 4) -> list[FakeJob]:
    return [FakeJob(id=f"j{i}", prompt=f"prompt {i}", seed=i, output=f"sub/j{i}") for i in range(n)]


class FakeRenderer:
    """Writes MP4 bytes then the sidecar, each via a temp name + rename, like pipeline.Renderer.

    ``fail`` ids raise ValueError after writing the temp MP4; ``interrupt_at`` raises KeyboardInterrupt after the
    final MP4 and the temp sidecar exist (the worst moment); ``sigterm_at`` sends this process SIGTERM mid-render.
    """

    def __init__(self, fail=(), interrupt_at=None, sigterm_at=None, sidecar_tmp=".tmp.json"):
        self.fail, self.interrupt_at, self.sigterm_at = set(fail), interrupt_at, sigterm_at
        self.sidecar_tmp = sidecar_tmp  # ".tmp.json" -> a.tmp.json; ".json.tmp" -> a.json.tmp (sidecar.py)
        self.rendered: list[str] = []

    def render(self, job, mp4: Path, sidecar: Path) -> dict:
        self.rendered.append(job.id)
        tmp_mp4, tmp_json = mp4.with_name(mp4.stem + ".tmp.mp4"), sidecar.with_name(sidecar.stem + self.sidecar_tmp)
        tmp_mp4.write_bytes(b"\x00\x00\x00\x18ftypisom" + job.prompt.encode())
        if job.id in self.fail:
            raise ValueError("non-finite values in the decoded video (NaN)")
        if job.id == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler raises at the next bytecode boundary
                pass
        os.replace(tmp_mp4, mp4)
        tmp_json.write_text(json.dumps({"job": job.params(), "timings": {"total": 0.01}}))
        if job.id == self.interrupt_at:
            raise KeyboardInterrupt
        os.replace(tmp_json, sidecar)
        return {"seconds": 0.01}


class Factory:
    def __init__(self, renderer):
        self.renderer, self.calls = renderer, 0

    def __call__(self):
        self.calls += 1
        return self.renderer


def run(jobs, renderer, out, **kw):
    factory = Factory(renderer)
    report = run_batch(jobs, factory, out, progress=False, **kw)
    return report, factory


def read_report(out: Path, name: str = "batch-report.json") -> dict:
    return json.loads((out / name).read_text())


def files_under(out: Path) -> set[str]:
    return {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}


def kept_reports(out: Path) -> set[str]:
    """The earlier queues' reports, kept under their start times (`report.keep_earlier_report`)."""
    dated = re.compile(r"batch-report\.\d{8}T\d{6}Z(-\d+)?\.json")
    return {p.name for p in out.glob("batch-report.*.json") if dated.fullmatch(p.name)}


def test_all_succeed_and_report_lists_every_job(tmp_path):
    jobs = make_jobs(3)
    report, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.calls == 1 and factory.renderer.rendered == ["j0", "j1", "j2"]
    assert report.exit_code == 0
    data = read_report(tmp_path)
    assert data["state"] == "finished" and data["exit_code"] == 0 and data["shard"] is None
    assert [j["id"] for j in data["jobs"]] == ["j0", "j1", "j2"]
    assert [j["output"] for j in data["jobs"]] == ["sub/j0.mp4", "sub/j1.mp4", "sub/j2.mp4"]
    assert all(j["status"] == "succeeded" and j["error"] is None and j["seconds"] >= 0 for j in data["jobs"])
    assert data["counts"] == {"succeeded": 3, "failed": 0, "skipped": 0, "pending": 0, "interrupted": 0,
                              "elsewhere": 0}
    assert files_under(tmp_path) == {"batch-report.json"} | {f"sub/j{i}.{e}" for i in range(3) for e in ("mp4", "json")}


def test_resume_renders_only_the_deleted_output(tmp_path):
    jobs = make_jobs(4)
    run(jobs, FakeRenderer(), tmp_path)
    (tmp_path / "sub/j2.mp4").unlink()
    report, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j2"]
    assert [j.status for j in report.jobs] == ["skipped", "skipped", "succeeded", "skipped"]
    assert report.exit_code == 0 and (tmp_path / "sub/j2.mp4").is_file()


def test_changed_seed_rerenders_only_that_job(tmp_path):
    jobs = make_jobs(4)
    run(jobs, FakeRenderer(), tmp_path)
    jobs[1] = replace(jobs[1], seed=99)
    report, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j1"]
    assert json.loads((tmp_path / "sub/j1.json").read_text())["job"]["seed"] == 99


def test_missing_or_unreadable_sidecar_rerenders(tmp_path):
    jobs = make_jobs(3)
    run(jobs, FakeRenderer(), tmp_path)
    (tmp_path / "sub/j0.json").unlink()
    (tmp_path / "sub/j1.json").write_text("{not json")
    _, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j0", "j1"]


def test_overwrite_renders_everything(tmp_path):
    jobs = make_jobs(3)
    run(jobs, FakeRenderer(), tmp_path)
    _, factory = run(jobs, FakeRenderer(), tmp_path, overwrite=True)
    assert factory.renderer.rendered == ["j0", "j1", "j2"]


def test_factory_not_called_when_everything_is_rendered(tmp_path):
    jobs = make_jobs(3)
    run(jobs, FakeRenderer(), tmp_path)

    def factory():
        raise AssertionError("the model must not load when every job is skipped")

    report = run_batch(jobs, factory, tmp_path, progress=False)
    assert [j.status for j in report.jobs] == ["skipped"] * 3 and report.exit_code == 0
    assert read_report(tmp_path)["counts"]["skipped"] == 3


def test_failing_job_is_isolated_and_exit_code_is_1(tmp_path, monkeypatch):
    released = []
    real_release = batch._release_memory
    monkeypatch.setattr(batch, "_release_memory", lambda: (released.append(1), real_release()))
    jobs = make_jobs(4)
    report, factory = run(jobs, FakeRenderer(fail={"j1"}), tmp_path)
    assert factory.calls == 1 and factory.renderer.rendered == ["j0", "j1", "j2", "j3"]
    assert [j.status for j in report.jobs] == ["succeeded", "failed", "succeeded", "succeeded"]
    assert report.exit_code == 1
    data = read_report(tmp_path)
    assert data["exit_code"] == 1
    assert data["jobs"][1]["error"] == "ValueError: non-finite values in the decoded video (NaN)"
    assert "Traceback" in data["jobs"][1]["traceback"]
    # Memory is handed back after the failed job only (its traceback's cycles hold its tensors); a successful job's
    # blocks stay cached for the next one (gc.collect costs 0.1-0.3 s with a model loaded).
    assert released == [1]
    # The failed job leaves nothing: neither its temp MP4 nor a final name.
    assert not any(p.startswith("sub/j1.") for p in files_under(tmp_path))
    # A second run retries only the failed job.
    _, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j1"]


class Payload:
    """Stands in for a job's device tensors."""


class LeakyRenderer(FakeRenderer):
    """A failing job whose payload sits in a reference cycle with its frame (as an exception kept in a local
    makes): only a garbage collection frees it. Records, at each next render, whether it was freed."""

    def __init__(self):
        super().__init__()
        self.ref, self.freed_before_next = None, []

    def render(self, job, mp4, sidecar):
        if self.ref is not None:
            self.freed_before_next.append(self.ref() is None)
        if job.id == "j0":
            payload = Payload()
            self.ref = weakref.ref(payload)
            frame = sys._getframe()  # noqa: F841  (frame -> locals -> frame: a cycle)
            raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().render(job, mp4, sidecar)


def test_failed_job_memory_is_released_before_the_next_job(tmp_path):
    renderer = LeakyRenderer()
    gc.disable()  # only the queue's own collection may free the cycle
    try:
        report, _ = run(make_jobs(2), renderer, tmp_path)
    finally:
        gc.enable()
    assert [j.status for j in report.jobs] == ["failed", "succeeded"]
    assert report.jobs[0].error == "MemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert renderer.freed_before_next == [True]


def test_fail_fast_stops_after_first_failure(tmp_path):
    jobs = make_jobs(4)
    report, factory = run(jobs, FakeRenderer(fail={"j1"}), tmp_path, fail_fast=True)
    assert factory.renderer.rendered == ["j0", "j1"]
    assert [j.status for j in report.jobs] == ["succeeded", "failed", "pending", "pending"]
    assert report.exit_code == 1 and read_report(tmp_path)["counts"]["pending"] == 2


@pytest.mark.parametrize("sidecar_tmp", [".tmp.json", ".json.tmp"])
def test_interrupt_writes_report_and_leaves_nothing_partial(tmp_path, sidecar_tmp):
    jobs = make_jobs(4)
    report, factory = run(jobs, FakeRenderer(interrupt_at="j1", sidecar_tmp=sidecar_tmp), tmp_path)
    assert factory.renderer.rendered == ["j0", "j1"]
    assert report.exit_code == 130
    data = read_report(tmp_path)
    assert data["state"] == "interrupted" and data["exit_code"] == 130
    assert [j["status"] for j in data["jobs"]] == ["succeeded", "interrupted", "pending", "pending"]
    # j1 had renamed its MP4 and written its temp sidecar when interrupted: both are gone, j0 is intact.
    assert files_under(tmp_path) == {"batch-report.json", "sub/j0.mp4", "sub/j0.json"}
    _, factory = run(jobs, FakeRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j1", "j2", "j3"]


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.unraisablehook
    jobs = make_jobs(3)
    report, _ = run(jobs, FakeRenderer(sigterm_at="j1"), tmp_path)
    assert report.exit_code == 130
    data = read_report(tmp_path)
    assert [j["status"] for j in data["jobs"]] == ["succeeded", "interrupted", "pending"]
    assert data["jobs"][1]["error"] == "Interrupted: SIGTERM received"
    assert files_under(tmp_path) == {"batch-report.json", "sub/j0.mp4", "sub/j0.json"}
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.unraisablehook) == before


class SignalInDel:
    """Sends SIGTERM from inside ``__del__``, where Python swallows the handler's exception."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs (and its exception is dropped) here
            pass


class SwallowingRenderer(FakeRenderer):
    def render(self, job, mp4, sidecar):
        if job.id == "j1":
            self.rendered.append(job.id)
            obj = SignalInDel()
            del obj  # Python ignores the Interrupted raised inside __del__
            for _ in range(200):  # a long job (2 s): only the re-sent signal can stop it now
                time.sleep(0.01)
            raise AssertionError("the interrupt was lost")
        return super().render(job, mp4, sidecar)


def test_signal_swallowed_in_del_is_sent_again(tmp_path):
    report, factory = run(make_jobs(3), SwallowingRenderer(), tmp_path)
    assert factory.renderer.rendered == ["j0", "j1"]
    assert [j.status for j in report.jobs] == ["succeeded", "interrupted", "pending"]
    # "interrupted", not "failed": a lost signal would have let the job end in its AssertionError (no clock needed)
    assert report.exit_code == 130 and report.jobs[1].error == "Interrupted: SIGTERM received"


def test_interrupt_while_loading_the_model(tmp_path):
    def factory():
        raise KeyboardInterrupt

    report = run_batch(make_jobs(2), factory, tmp_path, progress=False)
    assert report.exit_code == 130
    assert [j["status"] for j in read_report(tmp_path)["jobs"]] == ["interrupted", "pending"]


def test_factory_error_fails_every_job_to_render(tmp_path):
    jobs = make_jobs(3)
    run(jobs[:1], FakeRenderer(), tmp_path)

    def factory():
        raise FileNotFoundError("checkpoint folder /ckpt has no transformer/")

    report = run_batch(jobs, factory, tmp_path, progress=False)
    assert [j.status for j in report.jobs] == ["skipped", "failed", "failed"]
    assert report.jobs[1].error.startswith("renderer could not be created: FileNotFoundError: checkpoint folder")
    assert report.exit_code == 1


def test_shard_report_name_and_content(tmp_path):
    report, _ = run(make_jobs(2), FakeRenderer(), tmp_path, shard=(1, 3))
    assert report.path == tmp_path / "batch-report.shard-1-of-3.json"
    assert not (tmp_path / "batch-report.json").exists()
    assert read_report(tmp_path, "batch-report.shard-1-of-3.json")["shard"] == {"index": 1, "count": 3}


def test_empty_shard_exits_0_with_a_report(tmp_path):
    report = run_batch([], Factory(None), tmp_path, progress=False, shard=(3, 4))
    assert report.exit_code == 0 and read_report(tmp_path, "batch-report.shard-3-of-4.json")["jobs"] == []


def test_duplicate_outputs_rejected_before_anything_runs(tmp_path):
    jobs = [FakeJob("a", "p", 0, "same"), FakeJob("b", "q", 1, "same")]
    factory = Factory(FakeRenderer())
    with pytest.raises(ValueError, match="jobs 1 and 2 both write"):
        run_batch(jobs, factory, tmp_path, progress=False)
    assert factory.calls == 0 and not (tmp_path / "batch-report.json").exists()


def test_quiet_logs_one_line_per_job(tmp_path, capsys):
    run(make_jobs(3), FakeRenderer(fail={"j2"}), tmp_path, quiet=True)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " job " in f" {ln}"]
    assert len(lines) == 3
    assert "j0 (sub/j0.mp4) succeeded" in lines[0] and "(rendered because: no MP4)" in lines[0]
    assert "j2 (sub/j2.mp4) failed" in lines[2] and "ValueError: non-finite" in lines[2]
    assert "(ran because: no MP4)" in lines[2] and "rendered because" not in lines[2]  # it rendered nothing


def test_progress_bar_counts(tmp_path, capsys):
    run_batch(make_jobs(2), Factory(FakeRenderer(fail={"j1"})), tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "queue" in err and "done 1, failed 1, left 0" in err


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, capsys):
    run_batch(make_jobs(2), Factory(FakeRenderer()), tmp_path)  # progress=None: decided by stderr.isatty()
    err = capsys.readouterr().err
    assert "queue" not in err and err.count("succeeded in") == 2


class TailRenderer(FakeRenderer):
    """`render_async`: the MP4 and sidecar land on a background thread after `release` is set for that job, the way
    the MP4 writer's tail finishes after `render_async` returned. `tail_fail` ids fail inside the tail."""

    def __init__(self, tail_fail=()):
        super().__init__()
        self.tail_fail = set(tail_fail)
        self.events: list[str] = []
        self.release: dict = {}  # job id -> threading.Event

    def render_async(self, job, mp4: Path, sidecar: Path):
        import threading
        from concurrent.futures import Future

        self.events.append(f"start {job.id}")
        tmp_mp4 = mp4.with_name(mp4.stem + ".tmp.mp4")
        tmp_mp4.write_bytes(b"\x00\x00\x00\x18ftypisom" + job.prompt.encode())
        future: Future = Future()
        gate = self.release[job.id] = threading.Event()

        def tail():
            gate.wait(5)
            try:
                os.replace(tmp_mp4, mp4)
                if job.id in self.tail_fail:
                    raise OSError(28, "No space left on device", str(sidecar))
                sidecar.write_text(json.dumps({"job": job.params()}))
            except BaseException as exc:
                self.events.append(f"tail failed {job.id}")
                future.set_exception(exc)
                return
            self.events.append(f"tail done {job.id}")
            future.set_result({})

        threading.Thread(target=tail, daemon=True).start()
        if job.id != "j0":
            # job j(n-1)'s tail is released only once job j(n) has started: the queue must not wait for it first
            self.release[f"j{int(job.id[1:]) - 1}"].set()
        if job.id == "j2":  # the last job releases itself
            gate.set()
        return future


def test_next_job_starts_while_the_previous_tail_runs(tmp_path):
    renderer = TailRenderer()
    report, _ = run(make_jobs(3), renderer, tmp_path)
    assert renderer.events.index("start j1") < renderer.events.index("tail done j0")
    assert renderer.events.index("start j2") < renderer.events.index("tail done j1")
    assert [j.status for j in report.jobs] == ["succeeded"] * 3 and report.exit_code == 0
    data = json.loads((tmp_path / "batch-report.json").read_text())
    assert data["format"] == 5 and data["state"] == "finished" and "overlap" not in data
    # recorded for every job; rounded to the millisecond, a fake job's can be 0.0 (j2 releases itself at once)
    assert all(isinstance(j["seconds"], float) and j["seconds"] >= 0 for j in data["jobs"])
    for i in range(3):
        assert (tmp_path / f"sub/j{i}.mp4").is_file() and (tmp_path / f"sub/j{i}.json").is_file()


def test_a_failed_tail_fails_its_job_only_and_leaves_no_final_file(tmp_path):
    renderer = TailRenderer(tail_fail={"j1"})
    report, _ = run(make_jobs(3), renderer, tmp_path)
    assert [j.status for j in report.jobs] == ["succeeded", "failed", "succeeded"] and report.exit_code == 1
    assert "No space left on device" in report.jobs[1].error
    assert not (tmp_path / "sub/j1.mp4").exists() and not (tmp_path / "sub/j1.json").exists()
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["j0.json", "j0.mp4", "j2.json", "j2.mp4"]


class _SlowTailRenderer(FakeRenderer):
    """Each job's tail (the MP4 and sidecar landing) ends 0.3 s after `render_async` returned, on its own thread."""

    def render_async(self, job, mp4, sidecar):
        future = Future()

        def tail():
            time.sleep(0.3)
            future.set_result(self.render(job, mp4, sidecar))

        threading.Thread(target=tail, daemon=True).start()
        return future


def test_job_lines_come_out_in_render_order_while_tails_run(tmp_path, capsys):
    """Job 2 fails at once (a file where its folder goes) while job 1's tail still runs: its line used to come out
    first ("job 2/3 ... failed", then "job 1/3 ... succeeded"), and "left" counted down in completion order."""
    (tmp_path / "shots").write_text("not a folder")
    jobs = [FakeJob("a", "p", 0, "a"), FakeJob("b", "q", 1, "shots/b"), FakeJob("c", "r", 2, "c")]
    report, _ = run(jobs, _SlowTailRenderer(), tmp_path, quiet=True)
    assert [j.status for j in report.jobs] == ["succeeded", "failed", "succeeded"]
    lines = [line for line in capsys.readouterr().err.splitlines() if " job " in line and " in " in line]
    assert [line.split(" job ")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"], lines
    assert [line.rsplit("; left ", 1)[1] for line in lines] == ["2", "1", "0"], lines


def test_the_queue_line_counts_one_job_in_the_singular(tmp_path, capsys):
    run(make_jobs(1), FakeRenderer(), tmp_path, quiet=True)
    assert "1 job: 0 already rendered (skipped), 1 to render" in capsys.readouterr().err
    run(make_jobs(2), FakeRenderer(), tmp_path / "two", quiet=True)
    assert "2 jobs: 0 already rendered (skipped), 2 to render" in capsys.readouterr().err


class _SlowCallbackFuture(Future):
    """A future whose done-callbacks run 0.3 s after it is done, as a busy writer thread can make them."""

    def add_done_callback(self, fn):
        super().add_done_callback(lambda f: (time.sleep(0.3), fn(f)))


class _LateRecordRenderer(FakeRenderer):
    def render_async(self, job, mp4, sidecar):
        self.render(job, mp4, sidecar)
        future = _SlowCallbackFuture()
        # done shortly after the queue has registered its callback, on this "writer" thread
        threading.Thread(target=lambda: (time.sleep(0.05), future.set_result({})), daemon=True).start()
        return future


def test_the_final_report_waits_for_the_last_tail_to_be_recorded(tmp_path):
    """A future is done before its callbacks run: the final report was written without the last job's outcome
    (seconds None, seen once in CI) when the queue waited on the future instead of the recorded outcome."""
    report, _ = run(make_jobs(2), _LateRecordRenderer(), tmp_path)
    data = read_report(tmp_path)
    assert [j["status"] for j in data["jobs"]] == ["succeeded", "succeeded"]
    assert all(j["seconds"] is not None and j["seconds"] > 0.2 for j in data["jobs"])


def test_symlinks_planted_at_lock_and_report_temp_names_are_never_written_through(tmp_path):
    """Issue #28 item 2: links at <job>.lock, batch-report.json.lock and batch-report.json.tmp lead outside the out
    dir; the queue renders and reports as usual and the files they point at keep their bytes."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    targets = {}
    for name in ("sub/j0.lock", "batch-report.json.lock", "batch-report.json.tmp"):
        target = tmp_path / f"outside-{name.replace('/', '-')}"
        target.write_text("precious\n")
        (out / name).symlink_to(target)
        targets[name] = target
    report, _ = run(make_jobs(2), FakeRenderer(), out)
    assert report.exit_code == 0 and read_report(out)["counts"]["succeeded"] == 2
    assert {name: t.read_text() for name, t in targets.items()} == {name: "precious\n" for name in targets}


def test_an_output_path_over_path_max_fails_its_job_alone(tmp_path):
    """Issue #28 item 3: out dir + output over PATH_MAX made render_reason raise ENAMETOOLONG before any job (report
    `crashed`); now that job fails with the OS's reason and the valid job renders."""
    out = tmp_path / "out"
    long = FakeJob(id="long", prompt="p", seed=0, output="/".join(["d" * 200] * 21) + "/x")
    report, _ = run([long, *make_jobs(1)], FakeRenderer(), out)
    doc = read_report(out)
    assert report.exit_code == 1 and doc["counts"]["succeeded"] == 1 and doc["counts"]["failed"] == 1
    assert "too long" in doc["jobs"][0]["error"] and (out / "sub/j0.mp4").is_file()


def test_an_interrupt_between_the_lock_and_the_snapshot_removes_no_final_file(tmp_path):
    """A signal landing in `_Attempt.claim` after the lock but before `before` was taken: the cleanup raised
    KeyError (the queue then ended `crashed`, exit 1) instead of leaving the old pair alone."""
    from h3render.batch import _Attempt, _UNLOCKED
    from h3render.report import JobOutcome

    mp4, side = tmp_path / "a.mp4", tmp_path / "a.json"
    mp4.write_text("old mp4")
    side.write_text("{}")
    attempt = _Attempt(make_jobs(1)[0], mp4, side, JobOutcome(id="j0", output="a.mp4"))
    attempt.lock = _UNLOCKED
    attempt.cleanup()
    assert mp4.read_text() == "old mp4" and side.exists()
