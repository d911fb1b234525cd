"""One job's filesystem fault fails that job only, naming the path; report write faults (a full disk) are retried
and never leave a report saying "running"; MP4/sidecar consistency: resume re-renders an MP4 that is not the one
its sidecar records, and a crash between the MP4 and the sidecar rename resumes correctly."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from h3render import locks, report as report_mod
from h3render.batch import run_batch
from h3render.outputs import BatchUsageError
from h3render.sidecar import media_record
from tests.unit.test_batch import (FakeJob, FakeRenderer, Factory, files_under, kept_reports, make_jobs,
                                   read_report)
from tests.e2e.test_batch_concurrency import renders, start_queue
from tests._cli import invoke, one_error_line


def statuses(report) -> list[str]:
    return [j.status for j in report.jobs]


# ------------------------------------------------------------------------------------------------ per-job folders

def test_a_file_where_a_jobs_folder_should_be_fails_that_job_only(tmp_path):
    (tmp_path / "shots").write_text("not a folder")
    jobs = [FakeJob("a", "p", 0, "a"), FakeJob("b", "q", 1, "shots/b"), FakeJob("c", "r", 2, "c")]
    report = run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    assert statuses(report) == ["succeeded", "failed", "succeeded"] and report.exit_code == 1
    assert report.jobs[1].error == (f"JobPathError: cannot create the job's folder {tmp_path / 'shots'}: "
                                    f"{tmp_path / 'shots'} is a file, not a folder")
    data = read_report(tmp_path)
    assert data["state"] == "finished" and data["counts"]["succeeded"] == 2


def test_an_unwritable_job_folder_fails_that_job_only(tmp_path, monkeypatch):
    # Root ignores mode bits (CI runs as root): inject the EACCES a read-only folder gives at the first file.
    real_open = locks.os.open

    def open_(path, *args, **kw):
        if Path(path).parent.name == "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(locks.os, "open", open_)
    jobs = [FakeJob("a", "p", 0, "ro/a"), FakeJob("b", "q", 1, "ok/b")]
    report = run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    assert statuses(report) == ["failed", "succeeded"]
    assert str(tmp_path / "ro/a.lock") in report.jobs[0].error and "Permission denied" in report.jobs[0].error


def test_a_job_folder_fault_is_recorded_with_its_traceback_and_cause(tmp_path, monkeypatch):
    """A job whose folder cannot be made is recorded as any failed job is: its error and a traceback that keeps the
    system call's own error as the cause (the JobPathError used to drop it: `from None`)."""
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kw):
        if self.name == "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *args, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    jobs = [FakeJob("a", "p", 0, "ro/a"), FakeJob("b", "q", 1, "b")]
    report = run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    assert statuses(report) == ["failed", "succeeded"]
    recorded = read_report(tmp_path)["jobs"][0]
    assert recorded["error"] == f"JobPathError: cannot create the job's folder {tmp_path / 'ro'}: Permission denied"
    tb = recorded["traceback"]
    assert f"PermissionError: [Errno 13] Permission denied: '{tmp_path / 'ro'}'" in tb, tb
    assert "direct cause" in tb and tb.rstrip().splitlines()[-1].startswith("h3render.outputs.JobPathError: "), tb


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores the folder's mode bits; the injected case covers it")
def test_a_read_only_job_folder_fails_that_job_only(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        jobs = [FakeJob("a", "p", 0, "ro/a"), FakeJob("b", "q", 1, "b")]
        report = run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert statuses(report) == ["failed", "succeeded"] and str(tmp_path / "ro") in report.jobs[0].error


def test_a_symlinked_folder_leading_out_of_the_out_dir_is_refused(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "link").symlink_to(elsewhere)
    (out / "inner").mkdir()
    (out / "alias").symlink_to(out / "inner")  # a symlink that stays inside is fine
    jobs = [FakeJob("a", "p", 0, "link/a"), FakeJob("b", "q", 1, "alias/b")]
    report = run_batch(jobs, Factory(FakeRenderer()), out, progress=False)
    assert statuses(report) == ["failed", "succeeded"]
    assert f"{out / 'link'}: the job's folder leads out of the out dir" in report.jobs[0].error
    assert str(elsewhere) in report.jobs[0].error and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("case", ["file/sub", "broken symlink", "symlink loop"])
def test_a_bad_out_dir_is_a_usage_error_naming_it(tmp_path, case):
    if case == "file/sub":
        (tmp_path / "file").write_text("")
        out, needle = tmp_path / "file" / "sub", f"{tmp_path / 'file'} is a file, not a folder"
    elif case == "broken symlink":
        (tmp_path / "out").symlink_to(tmp_path / "gone")
        out, needle = tmp_path / "out", f"{tmp_path / 'out'} is a broken symlink (to {tmp_path / 'gone'})"
    else:
        (tmp_path / "out").symlink_to(tmp_path / "out")
        out, needle = tmp_path / "out", f"{tmp_path / 'out'} is a symlink loop"
    with pytest.raises(BatchUsageError, match="--out-dir") as info:
        run_batch(make_jobs(1), Factory(FakeRenderer()), out, progress=False)
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------------ report writes

def test_a_report_write_fault_is_retried_at_the_next_job(tmp_path, monkeypatch, capsys):
    real, calls, journals = report_mod._append, [], []

    def flaky(path, data):  # the per-job record is the journal's appended line (issue #28 item 8)
        calls.append(data)
        if len(calls) in (1, 2):  # the first two job outcomes hit a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)
        journals.append(path.read_text())

    monkeypatch.setattr(report_mod, "_append", flaky)
    report = run_batch(make_jobs(4), Factory(FakeRenderer()), tmp_path, progress=False)
    assert statuses(report) == ["succeeded"] * 4 and report.exit_code == 0  # the final report is true
    assert [json.loads(line)["index"] for line in journals[0].splitlines()] == [0, 1, 2]  # none lost
    data = read_report(tmp_path)
    assert data["state"] == "finished" and data["report_error"] is None and data["counts"]["succeeded"] == 4
    err = capsys.readouterr().err
    assert err.count(f"could not write the report {tmp_path / 'batch-report.json.jobs.jsonl'}: No space left") == 1


def test_a_failed_final_report_write_says_so_and_never_leaves_running(tmp_path, monkeypatch, capsys):
    real = report_mod._write_json_atomic
    state = {"full": False}

    def full(path, data):
        if state["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    class FillsTheDisk(FakeRenderer):
        def render(self, job, mp4, sidecar):
            state["full"] = True
            return super().render(job, mp4, sidecar)

    monkeypatch.setattr(report_mod, "_write_json_atomic", full)
    report = run_batch(make_jobs(2), Factory(FillsTheDisk()), tmp_path, progress=False)
    assert report.exit_code == 1 and statuses(report) == ["succeeded"] * 2
    data = read_report(tmp_path)  # rewritten in place over the old report's blocks
    assert data["state"] == "finished" and data["exit_code"] == 1
    assert data["report_error"] == f"{tmp_path / 'batch-report.json'}: No space left on device"

    def no_space(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_mod, "_write_in_place", no_space)
    state["full"] = False
    report = run_batch(make_jobs(3), Factory(FillsTheDisk()), tmp_path, progress=False)
    assert report.exit_code == 1 and not (tmp_path / "batch-report.json").exists()
    assert "removed it rather than leave one saying the queue is running" in capsys.readouterr().err


@pytest.fixture
def tiny_tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a 64 KiB tmpfs needs root and mount(8); the injected faults above cover the logic")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_tmpfs_fails_jobs_by_name_and_leaves_no_running_report(tiny_tmpfs):
    out = tiny_tmpfs / "out"
    run_batch(make_jobs(1), Factory(FakeRenderer()), out, progress=False)
    filler = tiny_tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    finally:
        os.close(fd)
    report = run_batch(make_jobs(3), Factory(FakeRenderer()), out, progress=False)
    assert report.exit_code == 1 and statuses(report)[0] == "skipped"
    assert all(s == "failed" and "No space left" in j.error for s, j in zip(statuses(report)[1:], report.jobs[1:]))
    data = json.loads(report.path.read_text()) if report.path.exists() else None
    assert data is None or (data["state"] == "finished" and data["exit_code"] == 1)
    with pytest.raises(OSError, match=str(out / "side.json")):  # the sidecar writer names its file
        from h3render.sidecar import write_sidecar

        write_sidecar(out / "side.json", job_params={"prompt": "x" * 100_000}, checkpoint={}, sigmas={},
                      timings={}, versions={})
    filler.unlink()
    report = run_batch(make_jobs(3), Factory(FakeRenderer()), out, progress=False)
    assert report.exit_code == 0 and read_report(out)["state"] == "finished"


# ------------------------------------------------------------------------------------------------ MP4 vs sidecar

class RecordRenderer(FakeRenderer):
    """Writes the sidecar's MP4 record, as render.py does through write_sidecar(media=...)."""

    def render(self, job, mp4, sidecar):
        self.rendered.append(job.id)
        tmp = mp4.with_name(mp4.stem + ".tmp.mp4")
        tmp.write_bytes(b"\x00\x00\x00\x18ftypisom" + job.prompt.encode() * 50)
        os.replace(tmp, mp4)
        sidecar.write_text(json.dumps({"job": job.params(), "mp4": media_record(mp4)}))
        return {}


def test_resume_rerenders_truncated_empty_and_replaced_mp4s(tmp_path):
    jobs = make_jobs(5)
    run_batch(jobs, Factory(RecordRenderer()), tmp_path, progress=False)
    sub = tmp_path / "sub"
    data = (sub / "j0.mp4").read_bytes()
    (sub / "j0.mp4").write_bytes(data[:-7])  # truncated
    (sub / "j1.mp4").write_bytes(b"")  # 0 bytes
    (sub / "j2.mp4").write_bytes(bytes(reversed((sub / "j2.mp4").read_bytes())))  # same size, other content
    os.utime(sub / "j3.mp4", ns=(1, 1))  # copied without its times: hashed, found equal, skipped
    renderer = RecordRenderer()
    report = run_batch(jobs, Factory(renderer), tmp_path, progress=False)
    assert renderer.rendered == ["j0", "j1", "j2"]
    assert statuses(report) == ["succeeded"] * 3 + ["skipped"] * 2


def test_a_sidecar_without_an_mp4_record_still_catches_an_empty_mp4(tmp_path):
    jobs = make_jobs(2)
    run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)  # sidecars without "mp4" (older runs)
    (tmp_path / "sub/j1.mp4").write_bytes(b"")
    renderer = FakeRenderer()
    run_batch(jobs, Factory(renderer), tmp_path, progress=False)
    assert renderer.rendered == ["j1"]


def test_a_crash_between_the_mp4_and_the_sidecar_rename_resumes(tmp_path):
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    first = start_queue(out, ctl, 2, "--record", "--tag", "first")
    assert first.wait(120) == 0, first.stderr.read()
    old_sidecar = (out / "j0.json").read_text()
    crash = start_queue(out, ctl, 2, "--record", "--overwrite", "--tag", "second", "--crash-between", "j0")
    assert crash.wait(120) == 9
    # The crash point: the new MP4 in place beside the old sidecar, whose job parameters still match.
    assert (out / "j0.mp4").read_text().endswith("second") and (out / "j0.json").read_text() == old_sidecar
    resume = start_queue(out, ctl, 2, "--record", "--tag", "third")
    _, err = resume.communicate(timeout=120)
    assert resume.returncode == 0, err
    assert "(rendered because: MP4 size differs from its sidecar)" in err or "content differs" in err
    assert [job for _, job in renders(ctl)] == ["j0", "j1", "j0", "j0"]  # j1 skipped: its pair is intact
    side = json.loads((out / "j0.json").read_text())
    assert side["mp4"]["sha256"] == media_record(out / "j0.mp4")["sha256"]
    assert files_under(out) - kept_reports(out) == {"batch-report.json", "j0.mp4", "j0.json", "j1.mp4", "j1.json"}


def test_a_killed_overwrite_leaves_a_temp_that_the_next_run_sweeps_while_skipping(tmp_path):
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    ctl.mkdir()
    assert start_queue(out, ctl, 2, "--record").wait(120) == 0
    crash = start_queue(out, ctl, 2, "--record", "--overwrite", "--tag", "x", "--crash-before", "j1")
    assert crash.wait(120) == 9 and (out / "j1.tmp.mp4").exists()
    resume = start_queue(out, ctl, 2, "--record")
    _, err = resume.communicate(timeout=120)
    assert resume.returncode == 0 and "2 already rendered (skipped), 0 to render" in err, err
    assert files_under(out) - kept_reports(out) == {"batch-report.json", "j0.mp4", "j0.json", "j1.mp4", "j1.json"}


def test_the_cli_gives_exit_2_and_one_line_for_a_bad_out_dir(tmp_path):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "prompt": "x", "frames": 22, "steps": 2}) + "\n")
    (tmp_path / "file").write_text("")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out, needle in ((tmp_path / "file/sub", "is a file, not a folder"), (tmp_path / "broken", "broken symlink"),
                        (tmp_path / "loop", "symlink loop")):
        assert needle in one_error_line(invoke("batch", str(manifest), "--out-dir", str(out)))
        # --dry-run validates: it planned every job into a file as if it were a folder (exit 0; a third trial)
        assert needle in one_error_line(invoke("batch", str(manifest), "--out-dir", str(out), "--dry-run"))
