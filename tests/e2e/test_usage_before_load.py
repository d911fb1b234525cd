"""Mistakes a new user makes that used to fail late (after the load, or after a whole denoise) or as an error:
each is now a one-line exit 2 before any weights load (issue #29); and bare `h3render` is the help, exit 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3render.checkpoint.releases import RELEASES
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_bundle
from h3render.make_checkpoint.writer import write_synthetic_full_student
from tests._cli import click_error, invoke, one_error_line, run_cli, run_here


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_synthetic_bundle(tmp_path_factory.mktemp("b") / "FastH3-LoRA", RELEASES["tiny"].dit, seed=11)


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    return write_synthetic_full_student(tmp_path_factory.mktemp("v") / "v2", "v2", seed=4)


def _no_load(monkeypatch):
    """Make any weight load fail the test: the refusals must come first."""
    from h3render.engine import Engine

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(Engine, "load", classmethod(refuse))


def test_crf_0_is_refused_by_the_parser_with_the_reason(tmp_path):
    # x264's High profile cannot encode lossless: CRF 0 was accepted and every job failed after its denoise.
    line = click_error(invoke("prompt", "hello", "-o", str(tmp_path / "x.mp4"), "--crf", "0"))
    assert "'--crf'" in line and "0 is lossless" in line and "1..51" in line, line
    r = run_cli("batch", str(tmp_path / "none.jsonl"), "--crf", "0", "--dry-run")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "h3render: error: Invalid value for '--crf': 0 is lossless, which x264 cannot encode in the High profile the "
        "MP4s use; choose 1..51 (18 is visually lossless) (see 'h3render batch --help')"], r.stderr
    assert not list(tmp_path.iterdir())


def test_the_writer_refuses_exactly_what_x264_refuses(tmp_path):
    """CRF 1 (the lowest lossy value) opens x264 with the High profile; CRF 0 is refused with the reason, not as
    libav's "avcodec_open2(...) returned 22"."""
    from h3render.colour import MediaError
    from h3render.media import Mp4Writer

    Mp4Writer(tmp_path / "a.mp4", 64, 64, 5, crf=1, audio=False).abort()
    with pytest.raises(MediaError, match=r"crf must be in 1\.\.51 \(High profile\), got 0"):
        Mp4Writer(tmp_path / "b.mp4", 64, 64, 5, crf=0, audio=False)
    assert not list(tmp_path.iterdir())


def test_bare_h3render_prints_the_help_on_stdout_and_exits_0():
    r = invoke()
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Usage: ") and "Commands:" in r.stdout and "prompt" in r.stdout
    assert r.stderr == ""
    sub = run_cli()
    assert sub.returncode == 0 and sub.stdout.startswith("Usage: h3render") and "error" not in sub.stderr


@pytest.mark.parametrize("extra, needle", [
    ([], "a FastH3 LoRA bundle names several variants; choose one with --adapter-variant"),
    (["--adapter-variant", "vsa-datafre"], "has no variant 'vsa-datafre' (did you mean vsa-datafree?)"),
])
def test_adapter_bundle_mistakes_are_usage_errors_before_loading(bundle, tmp_path, monkeypatch, extra, needle):
    """A bundle root without its variant, or a misspelled one, failed at load (exit 1; in a batch every job)."""
    _no_load(monkeypatch)
    r = invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--adapter", str(bundle), *extra)
    line = one_error_line(r)
    assert needle in line and "vsa-synthetic-step1300" in line, line
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "prompt": "p", "mode": "fasth3"}) + "\n")
    for dry in ([], ["--dry-run"]):
        r = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--adapter", str(bundle), *extra, *dry)
        assert needle in one_error_line(r)
    assert not (tmp_path / "out").exists() and not (tmp_path / "a.mp4").exists()


@pytest.mark.parametrize("made, needle", [
    ("garbage", "not a readable safetensors file"),
    ("small", "does not fit"),  # an adapter for another DiT architecture than the checkpoint's
])
def test_an_adapter_file_the_loader_refuses_is_a_usage_error_before_loading(tmp_path, monkeypatch, made, needle):
    """The adapter's header is read and matched to the DiT config in the one check (`students.read_student`),
    not at load, where each job of a batch failed with it."""
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    _no_load(monkeypatch)
    adapter = tmp_path / "adapter.safetensors"
    if made == "garbage":
        adapter.write_bytes(b"not a safetensors file at all")
    else:
        write_synthetic_adapter(adapter, RELEASES[made].dit, seed=1)
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--adapter", str(adapter)))
    assert str(adapter) in line and needle in line, line


@pytest.mark.parametrize("command, suffix, bad", [("prompt", "to_gate_compress.set_weight", float("nan")),
                                                   ("batch", "lora_B.weight", float("inf"))])
def test_a_non_finite_adapter_is_a_usage_error_before_loading(tmp_path, monkeypatch, command, suffix, bad):
    """NaN/Inf adapter values (a NaN VSA gate included) passed the one check and failed at fusion, exit 1 for every
    job of the run; now the check reads every value (in the pass that hashes the file for the sidecar): one line
    naming the adapter file and the tensor, exit 2, on `prompt` and on `batch --dry-run` (manifest defaults)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    _no_load(monkeypatch)
    adapter = write_synthetic_adapter(tmp_path / "adapter.safetensors", RELEASES["tiny"].dit, seed=1,
                                      with_set_weight=True)
    with safe_open(adapter, framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(k for k in tensors if k.endswith(suffix))[-1]
    tensors[key].view(-1)[5] = bad
    save_file(tensors, str(adapter), metadata=meta)
    if command == "prompt":
        result = invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--adapter", str(adapter))
    else:
        manifest = tmp_path / "m.yaml"
        manifest.write_text(f"defaults: {{adapter: {json.dumps(str(adapter))}, mode: fasth3}}\njobs:\n  - prompt: x\n")
        result = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--dry-run")
    line = one_error_line(result)
    assert f"{adapter}: tensor {key!r}" in line and ("NaN" if bad != bad else "inf") in line, line
    assert ("a VSA gate" in line) == suffix.startswith("to_gate"), line
    assert not list(tmp_path.glob("**/*.mp4"))


def test_adapter_variant_without_a_student_is_a_usage_error(tmp_path, monkeypatch):
    _no_load(monkeypatch)
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--adapter-variant", "vsa-datafree"))
    assert "--adapter-variant need a FastH3 student" in line, line


def test_a_full_fasth3_checkpoint_without_mode_fasth3_says_pass_it(v2, tmp_path, monkeypatch):
    """It loaded the student, then failed with "base-model (t2va) jobs must run before the student is fused"."""
    _no_load(monkeypatch)
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--checkpoint", str(v2)))
    assert line == (f"h3render: error: --checkpoint {v2} is a full FastH3 student "
                    "(FastVideo/FastVideo-FastH3-8-Step-V2), which renders --mode fasth3 only: pass --mode fasth3")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps({"id": i, "prompt": "p"}) for i in ("a", "b")) + "\n")
    for dry in ([], ["--dry-run"]):
        line = one_error_line(invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--checkpoint",
                                     str(v2), *dry))
        assert line.startswith(f"h3render: error: {manifest}:1: mode: job 'a' is t2va (2 of 2 jobs), but "
                               f"--checkpoint {v2} is a full FastH3 student") and "pass --mode fasth3" in line, line
    assert not (tmp_path / "out").exists()
    # with --mode fasth3 the plan goes through (the check passes; nothing loads on --dry-run)
    r = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--checkpoint", str(v2), "--mode",
               "fasth3", "--dry-run")
    assert r.exit_code == 0, r.output


def test_an_output_name_taken_by_a_folder_is_refused_before_the_render(tmp_path, monkeypatch):
    """A fresh user's trial: `-o bad/d.mp4` with a folder `bad/d.mp4` rendered the whole job, then failed the rename
    (exit 1, 'IsADirectoryError'); it is a one-line usage error before loading. In a batch that job fails alone,
    before its render, and the other job renders."""
    from h3render.engine import Engine

    (tmp_path / "bad" / "d.mp4").mkdir(parents=True)
    monkeypatch.setattr(Engine, "load", classmethod(lambda *a, **k: pytest.fail("weights loaded")))
    r = invoke("prompt", "x", "-o", str(tmp_path / "bad" / "d.mp4"))
    assert r.exit_code == 2 and "is a folder" in one_error_line(r)
    monkeypatch.undo()
    manifest = tmp_path / "m.jsonl"
    job = '"frames": 22, "steps": 2, "width": 128, "height": 64'
    manifest.write_text(f'{{"prompt": "a", "output": "d", {job}}}\n{{"prompt": "b", "output": "ok", {job}}}\n')
    (tmp_path / "out" / "d.json").mkdir(parents=True)
    # --device cpu: the point is the claim, which is the same on every device. On a GPU host the default device is
    # cuda, and this in-process render then shared the pytest-xdist worker's CUDA state (the process-wide
    # attention choice, measured under the load of 8 workers on one GPU; compiled VAE; captured audio graphs) with
    # whatever that worker ran before: the valid job failed once so, under -n 8 on an H200 only (docs/performance.md
    # §10.4). On failure the report says why (each job's error and traceback), which that run did not show.
    r = run_here("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--device", "cpu")
    report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
    assert r.returncode == 1 and report["counts"]["succeeded"] == 1 and report["counts"]["failed"] == 1, \
        (r.returncode, report["jobs"], r.stderr[-4000:])
    # the claim's message, not the rename's IsADirectoryError after a whole render
    assert "a folder stands at the job's output name" in report["jobs"][0]["error"]
    assert not (tmp_path / "out" / "d.mp4").exists()


def test_prompt_refuses_an_existing_output_unless_overwrite(tmp_path, monkeypatch):
    """A fresh user's trial: `prompt -o out.mp4` replaced an earlier out.mp4 and out.json without a word. Either file
    there is now a one-line exit 2 naming it, before any weights load; `--overwrite` (batch's flag) replaces both."""
    out, sidecar = tmp_path / "out.mp4", tmp_path / "out.json"
    out.write_bytes(b"an earlier render")
    sidecar.write_text("{}")
    _no_load(monkeypatch)
    line = one_error_line(invoke("prompt", "x", "-o", str(out)))
    assert line == (f"h3render: error: {out} and {sidecar} already exist; pass --overwrite to replace them (once the "
                    f"new render is complete), or choose another -o"), line
    out.unlink()  # the sidecar alone is somebody's file too; so is a dangling symlink at the MP4's name
    assert one_error_line(invoke("prompt", "x", "-o", str(out))).endswith(
        f"{sidecar} already exists; pass --overwrite to replace it (once the new render is complete), or choose "
        f"another -o")
    sidecar.unlink()
    out.symlink_to(tmp_path / "gone.mp4")
    assert f"{out} already exists" in one_error_line(invoke("prompt", "x", "-o", str(out)))
    assert sidecar.exists() is False and out.is_symlink()  # nothing written, nothing removed
    monkeypatch.undo()
    out.unlink()
    out.write_bytes(b"an earlier render")
    r = run_here("prompt", "x", "-o", str(out), "--overwrite", "--device", "cpu", "--frames", "22", "--steps", "2",
                 "--width", "128", "--height", "64", "--quiet")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[4:8] == b"ftyp" and json.loads(sidecar.read_text())["job"]["prompt"] == "x"


def test_a_missing_checkpoint_from_the_environment_says_where_it_came_from(tmp_path):
    """A fresh user's trial: `H3RENDER_CHECKPOINT=/nope h3render presets` said only 'checkpoint /nope does not
    exist', not where the path came from."""
    line = one_error_line(invoke("presets", env={"H3RENDER_CHECKPOINT": str(tmp_path / "nope")}))
    assert f"checkpoint {tmp_path / 'nope'} (from $H3RENDER_CHECKPOINT) does not exist" in line


def test_python_dash_m_h3render_is_the_command():
    """A trial: `python -m h3render` did not exist (no __main__), for an environment whose scripts are not on PATH."""
    import os
    import subprocess
    import sys

    from tests._env import REPO, repo_pythonpath

    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    r = subprocess.run([sys.executable, "-m", "h3render", "prompt", "x", "-o", "x.mkv"], capture_output=True,
                       text=True, cwd=REPO, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.splitlines() == ["h3render: error: output x.mkv must end in .mp4"], r.stderr


def test_a_folder_that_takes_no_file_is_refused_before_loading(tmp_path, monkeypatch):
    """A trial: `-o /proc/x.mp4` passed the mode-bit check (root) and failed after the whole render (exit 1). Now
    a file is created and removed there first; a folder that takes none is a one-line exit 2 before loading."""
    import errno
    import tempfile

    _no_load(monkeypatch)
    real = tempfile.mkstemp
    refused = tmp_path / "read-only-mount"
    refused.mkdir()

    def mkstemp(*args, dir=None, **kwargs):  # a read-only mount: the mode bits say yes, creating says no
        if dir is not None and Path(dir) == refused:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    line = one_error_line(invoke("prompt", "x", "-o", str(refused / "a.mp4")))
    assert line == (f"h3render: error: output folder {refused} takes no file (creating one there failed: Read-only "
                    f"file system)"), line
    line = one_error_line(invoke("batch", str(_manifest(tmp_path)), "--out-dir", str(refused / "sub")))
    assert line == f"h3render: error: output folder {refused / 'sub'} cannot be made in {refused}: Read-only file system"
    assert not list(refused.iterdir()) and not list(tmp_path.glob("*/.h3render-probe-*"))
    if Path("/proc/self").is_dir():  # the trial's own case, on Linux
        assert "output folder /proc takes no file (creating one there failed" in one_error_line(
            invoke("prompt", "x", "-o", "/proc/x.mp4"))


def _manifest(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "a", "frames": 22, "steps": 2}\n')
    return path


def test_a_lora_strength_that_is_no_number_says_so(tmp_path, monkeypatch):
    """A trial: `--lora f.safetensors:abc` said "no such LoRA file" though f.safetensors is there."""
    from h3render.make_checkpoint.synthetic_lora import write_synthetic_lora

    _no_load(monkeypatch)
    lora = write_synthetic_lora(tmp_path / "f.safetensors", RELEASES["tiny"].dit, "peft", seed=0)
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--lora", f"{lora}:abc"))
    assert line.endswith(f"error: --lora #1 ({lora}:abc): {lora}:abc: the strength after ':' ('abc') is not a number "
                         f"({lora} is the file)"), line
    # on `batch` the command line's LoRA reaches every job: its problem is one line, not one per job (a trial)
    manifest = tmp_path / "three.jsonl"
    manifest.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    line = one_error_line(invoke("batch", str(manifest), "--lora", f"{lora}:abc", "--dry-run"))
    assert line.startswith(f"h3render: error: --lora #1 ({lora}:abc): ") and line.endswith(
        "is not a number " f"({lora} is the file)"), line
    missing = tmp_path / "g.safetensors"
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--lora", f"{missing}:abc"))
    assert line.endswith(f"{missing}:abc: LoRA file not found"), line  # no file before the ':' either
    # and a LoRA that is used is said on stderr, not only in the sidecar (a trial)
    from h3render.checkpoint.info import read_checkpoint_info
    from h3render.manifest import job_from_fields
    from h3render.manifest_formats import ManifestError

    limits = read_checkpoint_info("tiny").limits()
    job = job_from_fields({"prompt": "x", "loras": [{"path": str(lora), "strength": 0.5}]}, limits)
    assert job.conditions_note() == f"LoRA {lora} at 0.5"
    with pytest.raises(ManifestError, match=r"is one, give its strength as \{path: .*, strength: 0\.5\}"):
        job_from_fields({"prompt": "x", "loras": [f"{lora}:0.5"]}, limits)  # --lora's form in a manifest
    # a ref2va job rendered without its LoRA and said it had one (a second trial): refused, before loading
    from PIL import Image

    Image.new("RGB", (128, 64)).save(tmp_path / "r.png")
    line = one_error_line(invoke("prompt", "<Picture 1> x", "--reference", str(tmp_path / "r.png"), "-o",
                                 str(tmp_path / "a.mp4"), "--lora", f"{lora}:0.7"))
    assert line.endswith("error: --reference: LoRAs apply to t2va and fl2va jobs; this ref2va job runs the Ref2VA DiT, "
                         "which takes none yet (drop --lora)"), line
    manifest = tmp_path / "ref.yaml"  # from the defaults: the job's own line is blamed, and told how to opt out
    manifest.write_text(f"defaults: {{loras: ['{lora}']}}\njobs:\n  - {{prompt: x, references: [r.png]}}\n")
    line = one_error_line(invoke("batch", str(manifest), "--dry-run"))
    assert f"{manifest}:3: references: " in line and f"(give it loras: [] over the defaults' ({manifest}:1" in line, \
        line


def test_loading_is_announced_and_timed_unless_quiet(tmp_path):
    """A trial: `batch` said nothing while the model loaded (8 s for the tiny one; minutes for real weights)."""
    manifest = _manifest(tmp_path)
    r = run_here("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    loading = lines.index("h3render: loading tiny on cpu, then warming up ...")
    assert lines[loading + 1].startswith("h3render: loaded and warmed up in ") and "job 1/1" in lines[loading + 2]
    r = run_here("batch", str(manifest), "--out-dir", str(tmp_path / "q"), "--device", "cpu", "--quiet")
    assert r.returncode == 0 and "h3render: loading" not in r.stderr, r.stderr
    assert "no checkpoint given" not in r.stderr  # nor the tiny model's notice, as `prompt --quiet` (a third trial)
    planned = invoke("batch", str(manifest), "--out-dir", str(tmp_path / "q"), "--dry-run", "--quiet")
    assert planned.exit_code == 0 and "no checkpoint given" not in planned.stderr, planned.stderr  # (a fourth)


def test_a_terminal_sees_a_status_line_during_the_checks_that_the_next_line_erases(monkeypatch):
    """On a terminal the ~5 s of checks after parsing (torch and transformers import) showed nothing: a status line
    now stands there until the next line replaces it, so an error found there is still one line; not a terminal
    (a log, a pipe): nothing."""
    import io

    from h3render import cli_say

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, want in ((Terminal(), "h3render: checking ...\r\033[Kh3render: error: x\n"),
                         (io.StringIO(), "h3render: error: x\n")):
        monkeypatch.setattr("sys.stderr", stream)
        cli_say.status("h3render: checking ...")
        cli_say.say("h3render: error: x")
        cli_say.end_status()  # nothing left to erase
        assert stream.getvalue() == want


def test_an_output_folder_that_cannot_be_made_names_the_folder_in_the_way(tmp_path, monkeypatch):
    """A trial: a missing output folder under a read-only one was "not writable" (it does not exist yet); the line
    now says it cannot be made and names the read-only folder above it."""
    import os

    _no_load(monkeypatch)
    locked = tmp_path / "ro"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == locked else real(p, mode, **k))
    line = one_error_line(invoke("prompt", "x", "-o", str(locked / "sub" / "a.mp4")))
    assert line == f"h3render: error: output folder {locked / 'sub'} cannot be made: {locked} is not writable", line
    line = one_error_line(invoke("prompt", "x", "-o", str(locked / "a.mp4")))
    assert line == f"h3render: error: output folder {locked} is not writable", line


def test_command_line_list_problems_name_the_option_as_typed(tmp_path, monkeypatch):
    """A trial: `prompt --lora PATH:0.8` with a missing file said `<command line>: loras[0].path: ...`, the
    manifest's vocabulary, which a `prompt` user never wrote. Each option value is named by the option, its
    1-based place among its kind and the text as typed; --reference and --keyframe alike."""
    _no_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    from PIL import Image

    Image.new("RGB", (128, 64)).save(tmp_path / "a.png")
    r = invoke("prompt", "x", "-o", "o.mp4", "--lora", "gone.safetensors:0.8", "--lora", "a.png:nan")
    assert r.exit_code == 2 and r.stderr.splitlines() == [
        "h3render: error: --lora #2 (a.png:nan): strength: must be a finite number, got nan",
        f"h3render: error: --lora #1 (gone.safetensors:0.8): {tmp_path}/gone.safetensors: LoRA file not found"], r.stderr
    line = one_error_line(invoke("prompt", "x", "-o", "o.mp4", "--reference", "a.png", "--reference", "b.png"))
    assert line == f"h3render: error: --reference #2 (b.png): {tmp_path}/b.png: reference file not found", line
    line = one_error_line(invoke("prompt", "x", "-o", "o.mp4", "--frames", "22", "--keyframe", "0:a.png",
                                 "--keyframe", "30:a.png"))
    assert line == "h3render: error: --keyframe #2 (30:a.png): frame 30 is past the clip's last frame 21 (22 frames)"
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"prompt": "a"}\n{"prompt": "b", "loras": []}\n')
    line = one_error_line(invoke("batch", str(manifest), "--lora", "gone.safetensors", "--dry-run"))
    assert line == f"h3render: error: --lora #1 (gone.safetensors): {tmp_path}/gone.safetensors: LoRA file not found"
