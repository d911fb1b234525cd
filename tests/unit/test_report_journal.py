"""The report's journal (issue #28 item 8) and the report edges of item 9: the report is written whole only at the
start and the end, each job outcome is one appended line, a crash leaves report + journal that fold into the state
at the crash; dead queues' reports are marked ``killed``; the `done:` line never names a removed report; a job
another queue finished is success here too."""

from __future__ import annotations

import errno
import json
import os
import socket
from datetime import datetime

from h3render import locks, report as report_mod
from h3render.batch import run_batch
from h3render.outputs import lock_path
from h3render.report import read_report
from tests.unit.test_batch import FakeJob, FakeRenderer, Factory, make_jobs


def test_each_job_appends_a_line_and_the_report_itself_is_not_rewritten(tmp_path):
    seen = []

    class Looks(FakeRenderer):
        def render(self, job, mp4, sidecar):
            path = tmp_path / "batch-report.json"
            seen.append((os.stat(path).st_ino, read_report(path)))
            return super().render(job, mp4, sidecar)

    run_batch(make_jobs(3), Factory(Looks()), tmp_path, progress=False)
    assert len({ino for ino, _ in seen}) == 1  # one report file while the queue ran: no per-job rewrite
    states = [[j["status"] for j in data["jobs"]] for _, data in seen]
    assert states == [["pending"] * 3, ["succeeded", "pending", "pending"], ["succeeded", "succeeded", "pending"]]
    assert seen[2][1]["counts"]["succeeded"] == 2 and seen[2][1]["journal"] == "batch-report.json.jobs.jsonl"
    final = json.loads((tmp_path / "batch-report.json").read_text())
    assert final["state"] == "finished" and final["journal"] is None and final["counts"]["succeeded"] == 3
    assert not (tmp_path / "batch-report.json.jobs.jsonl").exists()


def test_a_crash_leaves_a_report_and_journal_that_fold_into_the_state_at_the_crash(tmp_path):
    class Dies(FakeRenderer):
        def render(self, job, mp4, sidecar):
            if job.id == "j2":  # SIGKILL-like: nothing after this line runs; keep what is on disk now
                raise SystemExit(copy_out())
            return super().render(job, mp4, sidecar)

    crash = tmp_path / "crash"

    def copy_out():
        crash.mkdir()
        for name in ("batch-report.json", "batch-report.json.jobs.jsonl"):
            (crash / name).write_bytes((tmp_path / name).read_bytes())
        with open(crash / "batch-report.json.jobs.jsonl", "a") as f:
            f.write('{"index": 2, "job": {"id": "j2", "outp')  # a torn last line
        return 9

    try:
        run_batch(make_jobs(4), Factory(Dies()), tmp_path, progress=False)
    except SystemExit:
        pass
    data = read_report(crash / "batch-report.json")
    assert data["state"] == "running" and data["exit_code"] is None
    assert [j["status"] for j in data["jobs"]] == ["succeeded", "succeeded", "pending", "pending"]
    assert data["counts"]["succeeded"] == 2 and data["queue_seconds"] is not None


def test_a_dead_queues_own_report_is_marked_killed_and_a_live_ones_is_left(tmp_path):
    def planted(name, jobs_line):
        path = tmp_path / name
        path.write_text(json.dumps({"format": 5, "state": "running", "journal": name + ".jobs.jsonl",
                                    "exit_code": None, "jobs": [{"id": "x", "output": "x.mp4", "status": "pending",
                                                                 "seconds": None, "error": None}], "counts": {}}))
        (tmp_path / (name + ".jobs.jsonl")).write_text(jobs_line)
        return path

    line = json.dumps({"index": 0, "job": {"id": "x", "output": "x.mp4", "status": "succeeded", "seconds": 1.0,
                                           "error": None}, "updated_at": "t", "load_seconds": 1.0,
                       "queue_seconds": 2.0}) + "\n"
    dead = planted("batch-report.node-1-123.json", line)
    live = planted("batch-report.node-2-456.json", line)
    held = locks.FileLock.try_acquire(live.with_name(live.name + ".lock"))
    try:
        run_batch(make_jobs(1), Factory(FakeRenderer()), tmp_path, progress=False)
    finally:
        held.release()
    data = json.loads(dead.read_text())
    assert data["state"] == "killed" and data["journal"] is None and data["jobs"][0]["status"] == "succeeded"
    assert not (tmp_path / (dead.name + ".jobs.jsonl")).exists()
    assert json.loads(live.read_text())["state"] == "running"


def test_a_second_queue_holds_the_lock_of_its_own_report(tmp_path):
    held = locks.FileLock.try_acquire(tmp_path / "batch-report.json.lock")
    own = tmp_path / f"batch-report.{socket.gethostname()}-{os.getpid()}.json"

    class Checks(FakeRenderer):
        def render(self, job, mp4, sidecar):
            self.free = locks.FileLock.try_acquire(own.with_name(own.name + ".lock")) is not None
            return super().render(job, mp4, sidecar)

    renderer = Checks()
    try:
        run_batch(make_jobs(1), Factory(renderer), tmp_path, progress=False)
    finally:
        held.release()
    assert renderer.free is False  # flock conflicts between two open files of one process too


def test_the_done_line_never_names_a_removed_report(tmp_path, monkeypatch, capsys):
    real = report_mod._write_json_atomic

    def final_fails(path, data):  # the disk fills after the start: the final write and its in-place fallback fail
        if data["state"] != "running":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_mod, "_write_json_atomic", final_fails)
    monkeypatch.setattr(report_mod, "_write_in_place", no_space)
    report = run_batch(make_jobs(1), Factory(FakeRenderer()), tmp_path, progress=False)
    assert report.exit_code == 1 and not (tmp_path / "batch-report.json").exists()
    done = [ln for ln in capsys.readouterr().err.splitlines() if "done:" in ln]
    assert done and done[0].endswith("; no report (see above)"), done


def test_a_job_another_queue_finishes_at_the_end_is_success_here(tmp_path):
    """Two identical queues: each reaches the other's job while it is being rendered; at the end each waits for the
    holder, finds the job finished and counts it skipped, so neither exits 1 (a duplicated array showed FAILED)."""
    jobs = make_jobs(2)
    (tmp_path / "sub").mkdir()
    held = locks.FileLock.try_acquire(lock_path(tmp_path / "sub/j0.mp4"))
    other = FakeRenderer()

    class Finishes(FakeRenderer):
        def render(self, job, mp4, sidecar):
            result = super().render(job, mp4, sidecar)
            import threading

            def finish_j0():  # the other queue ends j0 a moment after this queue reached its end
                import time

                time.sleep(0.3)
                other.render(jobs[0], tmp_path / "sub/j0.mp4", tmp_path / "sub/j0.json")
                held.release()

            threading.Thread(target=finish_j0).start()
            return result

    renderer = Finishes()
    report = run_batch(jobs, Factory(renderer), tmp_path, progress=False, elsewhere_wait_s=30)
    assert renderer.rendered == ["j1"] and other.rendered == ["j0"]
    assert [j.status for j in report.jobs] == ["skipped", "succeeded"] and report.exit_code == 0


def test_a_failed_first_write_is_retried_whole_before_any_journal_line(tmp_path, monkeypatch):
    """A dead queue's running report (naming its journal) stays in place when this queue's first write hits a full
    disk: a journal line now would be folded into that other run's report."""
    real, calls = report_mod._write_json_atomic, []

    def first_fails(path, data):
        calls.append(data["state"])
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    seen = []

    class Looks(FakeRenderer):
        def render(self, job, mp4, sidecar):
            seen.append((tmp_path / "batch-report.json.jobs.jsonl").exists())
            return super().render(job, mp4, sidecar)

    monkeypatch.setattr(report_mod, "_write_json_atomic", first_fails)
    report = run_batch(make_jobs(3), Factory(Looks()), tmp_path, progress=False)
    assert report.exit_code == 0 and calls[:2] == ["running", "running"]  # job 1's record rewrote it whole
    assert seen == [False, False, True]
    assert json.loads((tmp_path / "batch-report.json").read_text())["counts"]["succeeded"] == 3


def test_a_later_batch_keeps_the_earlier_report_under_its_start_time(tmp_path, capsys):
    """A second batch on the same out dir replaced batch-report.json: the first run's outcomes (and tracebacks)
    were gone. Now the earlier report moves to batch-report.<its started_at, UTC>.json, never over another."""
    run_batch(make_jobs(2), Factory(FakeRenderer(fail={"j1"})), tmp_path, progress=False)
    first = json.loads((tmp_path / "batch-report.json").read_text())
    jobs = [FakeJob("k", "other", 9, "k")]
    run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    stamp = datetime.fromisoformat(first["started_at"]).strftime("%Y%m%dT%H%M%SZ")
    kept = tmp_path / f"batch-report.{stamp}.json"
    assert json.loads(kept.read_text()) == first and first["jobs"][1]["traceback"]
    assert [j["id"] for j in read_report(tmp_path / "batch-report.json")["jobs"]] == ["k"]
    assert f"the earlier batch-report.json is kept as {kept.name}" in capsys.readouterr().err
    # A killed queue's report (running, with its journal) is folded and marked killed before it moves; a taken
    # dated name is never replaced.
    (tmp_path / "batch-report.json").write_text(json.dumps({**first, "state": "running",
                                                            "journal": "batch-report.json.jobs.jsonl"}))
    line = {"index": 1, "job": {**first["jobs"][1], "status": "succeeded"}, "updated_at": "t", "load_seconds": 1.0,
            "queue_seconds": 2.0}
    (tmp_path / "batch-report.json.jobs.jsonl").write_text(json.dumps(line) + "\n")
    run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    assert json.loads(kept.read_text()) == first  # untouched
    killed = json.loads((tmp_path / f"batch-report.{stamp}-2.json").read_text())
    assert killed["state"] == "killed" and [j["status"] for j in killed["jobs"]] == ["succeeded", "succeeded"]
    assert not (tmp_path / "batch-report.json.jobs.jsonl").exists()
    assert sorted(p.name for p in tmp_path.glob("batch-report*")) == sorted(
        ["batch-report.json", kept.name, f"batch-report.{stamp}-2.json"])


def test_without_hard_links_the_earlier_report_is_still_kept(tmp_path, monkeypatch):
    run_batch(make_jobs(1), Factory(FakeRenderer()), tmp_path, progress=False)
    first = json.loads((tmp_path / "batch-report.json").read_text())

    def no_links(*args):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(report_mod.os, "link", no_links)
    run_batch(make_jobs(1), Factory(FakeRenderer()), tmp_path, progress=False)
    stamp = datetime.fromisoformat(first["started_at"]).strftime("%Y%m%dT%H%M%SZ")
    assert json.loads((tmp_path / f"batch-report.{stamp}.json").read_text()) == first
