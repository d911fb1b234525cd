"""Nothing is ever written through a link planted at a name the queue writes (issue #28 item 2): `<job>.lock`,
`batch-report.json.lock` (both `h3render.locks`), `batch-report.json.tmp` and the report itself (`h3render.report`).
The queue-level probe: test_batch.py::test_symlinks_planted_at_lock_and_report_temp_names_are_never_written_through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from h3render import locks, report


def plant(link: Path, outside: Path) -> None:
    outside.write_text("precious\n")
    link.symlink_to(outside)


def test_a_symlink_at_a_lock_name_is_replaced_not_followed(tmp_path):
    outside, link = tmp_path / "outside.txt", tmp_path / "out" / "job.lock"
    link.parent.mkdir()
    plant(link, outside)
    lock = locks.FileLock.try_acquire(link)
    assert lock is not None and not link.is_symlink() and link.read_text().split()[1] == str(os.getpid())
    assert outside.read_text() == "precious\n"
    lock.release()


def test_a_hard_link_at_a_lock_name_is_refused_unwritten(tmp_path):
    outside, link = tmp_path / "outside.txt", tmp_path / "job.lock"
    outside.write_text("precious\n")
    os.link(outside, link)
    with pytest.raises(OSError, match="job.lock: cannot lock: the lock file is a hard link"):
        locks.FileLock.try_acquire(link)
    assert outside.read_text() == "precious\n"


def test_the_reports_temp_and_final_names_are_not_written_through_links(tmp_path):
    outside = tmp_path / "outside.txt"
    path = tmp_path / "batch-report.json"
    plant(path.with_name("batch-report.json.tmp"), outside)
    report._write_json_atomic(path, {"a": 1})
    assert outside.read_text() == "precious\n" and path.read_text() == '{\n  "a": 1\n}\n'
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(OSError):
        report._write_in_place(path, b"{}\n")
    assert outside.read_text() == "precious\n"
