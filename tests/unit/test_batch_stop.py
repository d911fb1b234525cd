"""What an interrupted queue leaves and says (a fresh-user trial: Ctrl-C printed one terse line and left the
interrupted job's new, empty folder behind): the folders the interrupted job made are removed while empty, never a
folder it did not make or one with anything in it, and the last lines say which job was stopped, what finished,
what did not start and the command that resumes. A failed job's and a failed or interrupted `prompt`'s new empty
folders go too (the trial's repeat: `prompt -o out/new/x.mp4` and a failed queue job left them)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from h3render.batch import run_batch
from h3render.cli import _resume_command, batch_command
from h3render.errors import RenderError
from h3render.outputs import make_folders, remove_empty_folders
from h3render.runner import _render_single
from tests.unit.test_batch import FakeRenderer, Factory, files_under, make_jobs


def _stop_lines(err: str) -> list[str]:
    lines = err.splitlines()
    return lines[next(i for i, line in enumerate(lines) if "batch: interrupted" in line):]


def test_the_interrupted_jobs_empty_folders_go_and_the_log_says_how_to_resume(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "pre").mkdir(parents=True)  # empty, but not the queue's: it stays
    j0, j1, j2 = make_jobs(3)
    jobs = [replace(j0, output="keep/j0"), replace(j1, output="pre/made/deeper/j1"), replace(j2, output="keep/new/j2")]
    report = run_batch(jobs, Factory(FakeRenderer(interrupt_at="j1")), out, progress=False,
                       resume="h3render batch m.jsonl --out-dir out")
    assert report.exit_code == 130
    assert files_under(out) == {"batch-report.json", "keep/j0.mp4", "keep/j0.json"}
    assert (out / "pre").is_dir() and not (out / "pre" / "made").exists()
    assert _stop_lines(capsys.readouterr().err) == [
        "h3render batch: interrupted (SIGINT) during job 2/3 j1 (pre/made/deeper/j1.mp4); its partial files were "
        "removed",
        f"h3render batch: 1 succeeded, 0 failed, 0 skipped (already rendered), 1 not started; exit 130; report "
        f"{out / 'batch-report.json'}",
        "h3render batch: to resume (jobs already rendered are skipped): h3render batch m.jsonl --out-dir out"]


def _cannot_load():
    raise RenderError("the checkpoint could not be read")


@pytest.mark.parametrize("case", ["render fails", "renderer cannot be created"])
def test_a_failed_jobs_empty_folders_go_too(tmp_path, case):
    out = tmp_path / "out"
    (out / "pre").mkdir(parents=True)  # empty, but not the queue's: it stays
    j0, j1 = make_jobs(2)
    jobs = [replace(j0, output="pre/made/deeper/j0"), replace(j1, output="new/j1")]
    factory = Factory(FakeRenderer(fail={"j0"})) if case == "render fails" else _cannot_load
    report = run_batch(jobs, factory, out, progress=False)
    assert [j.status for j in report.jobs] == ["failed", "succeeded" if case == "render fails" else "failed"]
    assert files_under(out) == {"batch-report.json"} | ({"new/j1.mp4", "new/j1.json"} if case == "render fails"
                                                        else set())
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_dir()) == (
        ["new", "pre"] if case == "render fails" else ["pre"])


class _Breaks:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def render(self, job, mp4, sidecar):
        mp4.with_name(mp4.stem + ".tmp.mp4").write_bytes(b"partial")
        raise self.exc


@pytest.mark.parametrize("exc, code", [(RenderError("denoising produced non-finite latents"), 1),
                                       (KeyboardInterrupt(), 130)])
def test_a_failed_or_interrupted_prompt_leaves_no_folder_it_made(tmp_path, exc, code):
    (tmp_path / "pre").mkdir()  # there before: it stays
    mp4 = tmp_path / "pre" / "new" / "deeper" / "x.mp4"
    assert _render_single(lambda: _Breaks(exc), None, mp4, mp4.with_suffix(".json")) == code
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["pre"]


def test_an_interrupted_overwrite_says_what_resuming_without_it_keeps(tmp_path, capsys):
    jobs = make_jobs(2)
    run_batch(jobs, Factory(FakeRenderer()), tmp_path, progress=False)
    capsys.readouterr()
    run_batch(jobs, Factory(FakeRenderer(interrupt_at="j0")), tmp_path, progress=False, overwrite=True)
    assert _stop_lines(capsys.readouterr().err)[1:] == [
        f"h3render batch: 0 succeeded, 0 failed, 0 skipped (already rendered), 1 not started; exit 130; report "
        f"{tmp_path / 'batch-report.json'}",
        "h3render batch: to resume: the same h3render batch command (without --overwrite: the jobs finished now are "
        "skipped, and so are those not reached whose earlier outputs are current; with it every job renders again)"]


def test_empty_folders_are_removed_only_where_this_call_made_them(tmp_path):
    (tmp_path / "a").mkdir()
    made = make_folders(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    (tmp_path / "a" / "b" / "other.json").write_text("{}")  # another job's file in a folder this call made
    remove_empty_folders(made)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/other.json"]
    assert make_folders(tmp_path / "a" / "b") == []  # there already: nothing of this call's to remove


def test_the_resume_command_is_the_command_line_without_overwrite():
    ctx = batch_command.make_context("batch", ["my jobs.jsonl", "--overwrite", "--out-dir", "o", "--lora", "a:0.5",
                                               "--seed", "3", "--quiet", "--lora", "b c.safetensors"])
    assert _resume_command(ctx) == ("h3render batch 'my jobs.jsonl' --out-dir o --quiet --seed 3 --lora a:0.5 "
                                    "--lora 'b c.safetensors'")
