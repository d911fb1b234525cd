"""Two queues on one out dir: per-job locks, temps owned by the lock holder, one report per process, and a dead
holder's job picked up by a later run. The two-process tests pause one queue with SIGSTOP inside a job (a
deterministic interleaving) and run the other to its end beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from h3render import locks
from h3render.batch import run_batch
from h3render.outputs import lock_path
from tests.unit.test_batch import FakeRenderer, Factory, files_under, kept_reports, make_jobs, read_report
from tests._env import repo_pythonpath

REPO = Path(__file__).resolve().parents[2]


def start_queue(out: Path, ctl: Path, n: int, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    return subprocess.Popen([sys.executable, "-m", "tests._queue_proc", str(out), str(ctl), str(n), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"queue exited {proc.returncode} before {path.name}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {seconds} s")
        time.sleep(0.02)


def renders(ctl: Path) -> list[tuple[int, str]]:
    return [(int(pid), job) for pid, job in (ln.split() for ln in (ctl / "renders.log").read_text().splitlines())]


def test_two_queues_on_one_out_dir_render_each_job_once(tmp_path):
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    a = start_queue(out, ctl, 4, "--gate", "j0")
    wait_for(ctl / "started-j0", a)
    os.kill(a.pid, signal.SIGSTOP)  # A holds j0's lock with its temp MP4 half written
    try:
        b = start_queue(out, ctl, 4, "--elsewhere-wait", "0.5")  # A stays stopped: B's wait for j0 ends
        _, b_err = b.communicate(timeout=120)
        assert (out / "j0.tmp.mp4").read_text().startswith(f"mp4 prompt 0 by {a.pid}")  # B's sweep left it
        main = read_report(out)
        assert main["state"] == "running" and main["pid"] == a.pid  # A's report: B never wrote it
    finally:
        os.kill(a.pid, signal.SIGCONT)
    assert b.returncode == 1, b_err
    own = [p for p in out.glob("batch-report.*.json") if p.name.endswith(f"-{b.pid}.json")]
    assert len(own) == 1, sorted(p.name for p in out.iterdir())
    data_b = json.loads(own[0].read_text())
    assert [j["status"] for j in data_b["jobs"]] == ["elsewhere", "succeeded", "succeeded", "succeeded"]
    assert f"pid {a.pid}" in data_b["jobs"][0]["error"] and data_b["exit_code"] == 1
    assert "in progress elsewhere" in b_err and f"belongs to another queue (pid {a.pid}" in b_err
    (ctl / "go").touch()
    a_out, a_err = a.communicate(timeout=120)
    assert a.returncode == 0, a_err
    data_a = read_report(out)
    assert data_a["state"] == "finished" and data_a["pid"] == a.pid
    # j1..j3 were finished by B while A was stopped: A, reaching them under their locks, skips them.
    assert [j["status"] for j in data_a["jobs"]] == ["succeeded", "skipped", "skipped", "skipped"]
    assert "rendered meanwhile by another process" in a_err
    assert sorted(renders(ctl), key=lambda r: r[1]) == [(a.pid, "j0"), (b.pid, "j1"), (b.pid, "j2"), (b.pid, "j3")]
    assert (out / "j0.mp4").read_text().startswith(f"mp4 prompt 0 by {a.pid}")
    assert not [p for p in out.iterdir() if ".tmp" in p.name or p.suffix == ".lock"]


def test_a_dead_holders_job_is_picked_up_by_the_next_run(tmp_path):
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    a = start_queue(out, ctl, 2, "--gate", "j0")
    wait_for(ctl / "started-j0", a)
    a.kill()  # SIGKILL: no cleanup at all; the kernel drops its locks
    a.communicate(timeout=30)
    assert (out / "j0.tmp.mp4").exists() and (out / "j0.lock").exists()
    assert read_report(out)["state"] == "running"  # all a SIGKILL can leave; the report names the dead pid
    b = start_queue(out, ctl, 2)
    _, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    data = read_report(out)  # the report's lock was free again: B writes the main report
    assert data["pid"] == b.pid and [j["status"] for j in data["jobs"]] == ["succeeded", "succeeded"]
    assert renders(ctl) == [(a.pid, "j0"), (b.pid, "j0"), (b.pid, "j1")]
    assert (out / "j0.mp4").read_text().startswith(f"mp4 prompt 0 by {b.pid}")
    kept = kept_reports(out)  # A's report, kept under its start time and marked killed
    assert len(kept) == 1 and json.loads((out / kept.pop()).read_text())["state"] == "killed"
    assert files_under(out) - kept_reports(out) == {"batch-report.json", "j0.mp4", "j0.json", "j1.mp4", "j1.json"}


def test_a_job_locked_by_a_live_process_is_left_alone_and_retried_at_the_end(tmp_path):
    jobs = make_jobs(3)
    (tmp_path / "sub").mkdir()
    held = locks.FileLock.try_acquire(lock_path(tmp_path / "sub/j1.mp4"))  # flock is per open file: it conflicts
    temp = tmp_path / "sub/j1.tmp.mp4"
    temp.write_bytes(b"another process's frames")
    try:
        renderer = FakeRenderer()
        report = run_batch(jobs, Factory(renderer), tmp_path, progress=False, elsewhere_wait_s=0.3)
        assert renderer.rendered == ["j0", "j2"]
        assert [j.status for j in report.jobs] == ["succeeded", "elsewhere", "succeeded"] and report.exit_code == 1
        assert report.jobs[1].error == f"in progress elsewhere (pid {os.getpid()} on {os.uname().nodename})"
        assert temp.read_bytes() == b"another process's frames"  # never swept under a live holder
    finally:
        held.release()
    renderer = FakeRenderer()
    report = run_batch(jobs, Factory(renderer), tmp_path, progress=False)
    assert renderer.rendered == ["j1"] and report.exit_code == 0
    assert not temp.exists() and not (tmp_path / "sub/j1.lock").exists()


def test_the_end_of_queue_retry_takes_a_job_its_holder_released(tmp_path):
    jobs = make_jobs(3)
    (tmp_path / "sub").mkdir()
    held = locks.FileLock.try_acquire(lock_path(tmp_path / "sub/j0.mp4"))

    class Releasing(FakeRenderer):
        def render(self, job, mp4, sidecar):
            if job.id == "j2":
                held.release()  # the other process finished (here: gave up) while this queue ran j1, j2
            return super().render(job, mp4, sidecar)

    renderer = Releasing()
    report = run_batch(jobs, Factory(renderer), tmp_path, progress=False)
    assert renderer.rendered == ["j1", "j2", "j0"]
    assert [j.status for j in report.jobs] == ["succeeded"] * 3 and report.exit_code == 0


def test_a_second_queue_writes_its_own_report(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    held = locks.FileLock.try_acquire(tmp_path / "batch-report.json.lock")
    try:
        report = run_batch(make_jobs(1), Factory(FakeRenderer()), tmp_path, progress=False)
    finally:
        held.release()
    assert report.path.name == f"batch-report.{os.uname().nodename}-{os.getpid()}.json"
    assert not (tmp_path / "batch-report.json").exists()
    assert json.loads(report.path.read_text())["state"] == "finished"


def test_stale_temps_of_skipped_jobs_are_swept_only_when_their_owner_is_gone(tmp_path):
    jobs = make_jobs(3)
    run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    # A killed `--overwrite` of j0 and j1 left temps (and j0 an unheld lock file); j1's owner still lives.
    for name in ("j0.tmp.mp4", "j0.json.tmp", "j0.lock", "j1.tmp.mp4"):
        (tmp_path / "sub" / name).write_bytes(b"x")
    held = locks.FileLock.try_acquire(lock_path(tmp_path / "sub/j1.mp4"))
    try:
        report = run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    finally:
        held.release()
    assert [j.status for j in report.jobs] == ["skipped"] * 3
    left = sorted(p.name for p in (tmp_path / "sub").iterdir())
    assert left == ["j0.json", "j0.mp4", "j1.json", "j1.mp4", "j1.tmp.mp4", "j2.json", "j2.mp4"]


def test_lock_released_by_unlink_cannot_be_held_twice(tmp_path):
    path = tmp_path / "x.lock"
    first = locks.FileLock.try_acquire(path)
    fd = os.open(path, os.O_RDWR)  # a racer that opened the file before the holder released it
    first.release()
    second = locks.FileLock.try_acquire(path)  # a new file: the racer's inode is gone from the path
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the racer locks the unlinked inode...
        assert os.fstat(fd).st_ino != os.stat(path).st_ino  # ...which try_acquire would reject and retry
        assert locks.FileLock.try_acquire(path) is None
    finally:
        os.close(fd)
        second.release()


def test_two_identical_queues_both_exit_0_when_each_job_is_rendered_once(tmp_path):
    """Issue #28 item 9: B reaches j0 while A renders it; at its end B waits for A, finds j0 finished and counts it
    as skipped (exit 0, not 1: a duplicated SLURM array showed FAILED although every job was rendered once)."""
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    a = start_queue(out, ctl, 2, "--gate", "j0")
    wait_for(ctl / "started-j0", a)
    b = start_queue(out, ctl, 2)
    wait_for(out / "j1.json", b)  # B rendered j1 and now waits for j0's holder
    time.sleep(0.3)
    (ctl / "go").touch()
    _, b_err = b.communicate(timeout=120)
    _, a_err = a.communicate(timeout=120)
    assert b.returncode == 0 and a.returncode == 0, (a_err, b_err)
    assert sorted(renders(ctl), key=lambda r: r[1]) == [(a.pid, "j0"), (b.pid, "j1")]
    own = [p for p in out.glob("batch-report.*.json") if p.name.endswith(f"-{b.pid}.json")]
    assert [j["status"] for j in json.loads(own[0].read_text())["jobs"]] == ["skipped", "succeeded"]
    assert "waiting up to" in b_err and "rendered meanwhile by another process" in b_err


def test_two_overwrite_queues_render_each_job_once(tmp_path):
    """A trial: two `--overwrite` queues on one out dir rendered every job twice (each re-rendered what the other
    had just finished). A job another queue finishes after this one started counts as rendered meanwhile."""
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    out.mkdir()
    for name in ("j0", "j1"):  # an earlier run's outputs: --overwrite must still replace them
        (out / f"{name}.mp4").write_text("old")
        (out / f"{name}.json").write_text(json.dumps({"job": {"prompt": f"prompt {name[1]}", "seed": int(name[1])}}))
    time.sleep(0.05)  # the old files' timestamps come before either queue's start
    a = start_queue(out, ctl, 2, "--gate", "j0", "--overwrite")
    wait_for(ctl / "started-j0", a)
    b = start_queue(out, ctl, 2, "--overwrite")
    wait_for(ctl / "started-j1", b)  # B renders j1 (A holds j0), then waits for j0's holder
    time.sleep(0.3)
    (ctl / "go").touch()
    _, b_err = b.communicate(timeout=120)
    _, a_err = a.communicate(timeout=120)
    assert b.returncode == 0 and a.returncode == 0, (a_err, b_err)
    assert sorted(renders(ctl), key=lambda r: r[1]) == [(a.pid, "j0"), (b.pid, "j1")]  # each job once, none kept old
    assert (out / "j0.mp4").read_text().startswith(f"mp4 prompt 0 by {a.pid}")
    assert (out / "j1.mp4").read_text().startswith(f"mp4 prompt 1 by {b.pid}")
    assert "rendered meanwhile by another process" in a_err and "rendered meanwhile by another process" in b_err
