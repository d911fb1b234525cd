"""End-to-end CLI tests on the tiny model: real MP4s opened with PyAV, determinism, and bad-argument handling.

Usage errors and most renders run in-process through click's CliRunner (`tests._cli.run_here`); one render runs
in a process of its own (`run_forked`), and the exit behaviour of the real command in a subprocess (`run_cli`).
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest

from h3render.spec import audio_samples as audio_samples_for
from tests._cli import click_error, invoke, one_error_line, run_cli, run_forked, run_here
from tests._mp4 import decode


@pytest.fixture(scope="module")
def official_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-official"
    r = run_here("make-checkpoint", str(out), "--config", "tiny", "--layout", "official")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def diffusers_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-diffusers"
    r = run_here("make-checkpoint", str(out), "--config", "tiny", "--layout", "diffusers")
    assert r.returncode == 0, r.stderr
    return out


def check_mp4(path: Path, frames: int, width: int, height: int) -> None:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert v.codec_context.name == "h264"
        assert v.codec_context.profile == "High"
        assert v.format.name == "yuv420p"
        assert (v.width, v.height) == (width, height)
        assert v.average_rate == 24
        assert a.codec_context.name == "aac"
        assert a.rate == 32000
        assert a.channels == 2
        video_s = float(v.duration * v.time_base)
        audio_s = float(a.duration * a.time_base)
    decoded, samples = decode(path)
    assert decoded.shape[0] == frames
    want = audio_samples_for(frames)
    assert abs(samples.shape[1] - want) <= 1024, (samples.shape, want)
    assert abs(video_s - frames / 24) < 0.032
    assert abs(audio_s - frames / 24) < 0.032


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_prompt_renders_playable_mp4_from_checkpoint(layout, official_ckpt, diffusers_ckpt, tmp_path):
    ckpt = official_ckpt if layout == "official" else diffusers_ckpt
    out = tmp_path / "clip.mp4"
    run = run_forked if layout == "official" else run_here  # one in a process of its own; the other in this one
    r = run("prompt", "A red fox runs through snow, wind howling", "-o", str(out), "--checkpoint", str(ckpt),
            "--width", "224", "--height", "128", "--frames", "22", "--steps", "3", "--seed", "5")
    assert r.returncode == 0, r.stderr
    check_mp4(out, frames=22, width=224, height=128)
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["job"] == {"prompt": "A red fox runs through snow, wind howling", "seed": 5, "width": 224,
                              "height": 128, "frames": 22, "steps": 3, "mode": "t2va"}
    assert sidecar["checkpoint"]["layout"] == layout
    assert len(sidecar["sigmas"]["video"]) == 3 and sidecar["sigmas"]["video_shift"] == 12.0
    stages = sidecar["timings"]["stages"]
    for stage in ("text_encode", "denoise", "vae_video", "vae_audio", "to_uint8_d2h", "encode_mux", "total"):
        assert stages[stage]["seconds"] > 0, stage
    assert len(stages["denoise"]["steps"]) == 2
    assert not list(tmp_path.glob("*.tmp*"))


def test_builtin_tiny_same_seed_identical_other_seed_differs(tmp_path):
    """"a" renders in a process of its own that has never rendered, "b" and "c" in this one: the same seed gives the
    same MP4 content whatever ran before it in the process."""
    outs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        out = tmp_path / f"{name}.mp4"
        args = ("prompt", "Rain on a tin roof", "-o", str(out), "--seed", str(seed), "--steps", "3")
        r = run_forked(*args) if name == "a" else run_here(*args)
        assert r.returncode == 0, r.stderr
        assert "random weights" in r.stderr
        outs[name] = decode(out)
    check_mp4(tmp_path / "a.mp4", frames=39, width=224, height=128)
    np.testing.assert_array_equal(outs["a"][0], outs["b"][0])
    np.testing.assert_array_equal(outs["a"][1], outs["b"][1])
    assert np.abs(outs["a"][0].astype(int) - outs["c"][0].astype(int)).mean() > 1.0
    assert np.abs(outs["a"][1] - outs["c"][1]).mean() > 1e-4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--width", "225", "--height", "128"], "multiple"),
        (["--width", "200", "--height", "128"], "multiple"),
        (["--frames", "0"], "frames"),
        (["--preset", "no-such-preset"], "preset"),
        (["--checkpoint", "/nonexistent/ckpt"], "does not exist"),
    ],
)
def test_bad_arguments_exit_2_one_line_no_output(args, needle, tmp_path):
    out = tmp_path / "x.mp4"
    line = one_error_line(invoke("prompt", "hello", "-o", str(out), *args))
    assert needle in line.lower()
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, option",
    [
        (["--x264-preset", "ultrafastt"], "--x264-preset"),  # was raw libav text after denoising, exit 1
        (["--crf", "52"], "--crf"),
        (["--crf", "-1"], "--crf"),
        (["--attention", "flash"], "--attention"),
        (["--vae-batch", "0"], "--vae-batch"),
    ],
)
def test_bad_option_values_are_refused_by_the_parser(args, option, tmp_path):
    line = click_error(invoke("prompt", "hello", "-o", str(tmp_path / "x.mp4"), *args))
    assert option in line
    assert not list(tmp_path.iterdir())


def test_x264_preset_and_attention_choices_come_from_spec():
    from h3render.models.attention import REGISTRY
    from h3render.spec import ATTENTION_BACKENDS, X264_PRESETS

    r = invoke("prompt", "--help")
    assert r.exit_code == 0
    help_text = " ".join(r.output.split())
    assert "|".join(X264_PRESETS) in help_text.replace(" ", "")
    assert "[" + "|".join(REGISTRY) + "]" in help_text.replace(" ", "") and tuple(REGISTRY) == ATTENTION_BACKENDS
    assert invoke("prompt", "hello", "-o", "x.mp4", "--x264-preset", "placebo", "--frames", "0").exit_code == 2


def test_adapter_with_mode_t2va_is_refused_and_alone_implies_fasth3(tmp_path):
    from h3render.checkpoint.releases import RELEASES
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    adapter = tmp_path / "a.safetensors"
    write_synthetic_adapter(adapter, RELEASES["tiny"].dit, 0)  # its header passes the one check; nothing loads
    line = one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "x.mp4"), "--adapter", str(adapter),
                                 "--mode", "t2va"))
    assert "--adapter" in line and "fasth3" in line
    # Without --mode the job becomes a fasth3 job: its schedule is the adapter's, so --steps is a usage error.
    r = invoke("prompt", "x", "-o", str(tmp_path / "x.mp4"), "--adapter", str(adapter), "--steps", "4")
    assert "steps" in one_error_line(r) and "fasth3" in r.stderr


def test_make_checkpoint_into_a_non_empty_folder_is_one_line(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    line = one_error_line(invoke("make-checkpoint", str(tmp_path)))
    assert "not empty" in line and str(tmp_path) in line
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_unwritable_output_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "file").write_text("")
    one_error_line(invoke("prompt", "hello", "-o", str(locked / "file" / "x.mp4")))


def test_presets_lists_canvas_frames_rows():
    r = invoke("presets", "--checkpoint", "small")  # the built-in small model keeps the released canvas rule
    assert r.exit_code == 0, r.output
    assert "1344x768" in r.stdout.replace("×", "x")
    assert "72,576" in r.stdout or "72576" in r.stdout or "landscape" in r.stdout


def test_presets_resolve_the_checkpoint_as_prompt_and_batch_do(tmp_path):
    """`presets` listed the released canvases without a checkpoint (prompt and batch use the built-in tiny model) and
    ignored H3RENDER_CHECKPOINT: its canvas for a preset must be the one `batch --dry-run` plans for that preset."""
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text('{"id": "a", "prompt": "x", "preset": "4x3"}\n')
    canvases = {}
    for checkpoint in (None, "small"):
        env = {} if checkpoint is None else {"H3RENDER_CHECKPOINT": checkpoint}
        listed, planned = invoke("presets", env=env), invoke("batch", str(manifest), "--dry-run", env=env)
        assert listed.exit_code == 0 and planned.exit_code == 0, (listed.output, planned.output)
        row = next(line for line in listed.stdout.splitlines() if line.split()[0] == "4x3")
        canvases[checkpoint] = row.split()[1]
        assert f"preset 4x3 → {canvases[checkpoint]}," in planned.stdout, (row, planned.stdout)
        # the tiny model says what it is: `presets` in its table's first line, a dry run in the notice after its checks
        said = "presets for the built-in tiny model (random weights)" in listed.stdout
        assert said == ("no checkpoint given" in planned.stderr) == (checkpoint is None), listed.stdout
        assert listed.stderr == ""
    assert canvases[None] != canvases["small"]  # tiny's canvas rule differs: the env variable was read
    line = one_error_line(invoke("presets", env={"H3RENDER_CHECKPOINT": str(tmp_path / "nope")}))
    assert "does not exist" in line and str(tmp_path / "nope") in line


def test_batch_seed_steps_preset_are_defaults_below_a_jobs_own_fields(tmp_path):
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text('{"defaults": {"seed": 1, "steps": 9, "aspect": "4:3"}}\n'
                        '{"id": "plain", "prompt": "a"}\n'
                        '{"id": "own", "prompt": "b", "seed": 7, "steps": 5, "width": 256, "height": 128}\n')
    r = invoke("batch", str(manifest), "--dry-run", "--seed", "42", "--steps", "3", "--preset", "square")
    assert r.exit_code == 0, r.output
    plain, own = (line for line in r.stdout.splitlines() if line.startswith("["))
    assert "seed 42" in plain and "3 sigma points" in plain and "preset square" in plain
    assert "seed 7" in own and "5 sigma points" in own and "256x128" in own.replace("×", "x")
    r = invoke("batch", str(manifest), "--dry-run")  # without them the manifest's defaults apply
    assert "seed 1" in r.stdout and "9 sigma points" in r.stdout and "preset square" not in r.stdout and "4:3" in r.stdout
    # bad values are manifest-style errors naming the command line
    line = one_error_line(invoke("batch", str(manifest), "--dry-run", "--preset", "nope"))
    assert "<command line>" in line and "preset" in line
    assert "steps" in one_error_line(invoke("batch", str(manifest), "--dry-run", "--steps", "1"))
    help_text = " ".join(invoke("batch", "--help").output.split())
    for option in ("--seed", "--steps", "--preset"):
        assert option in help_text
    assert "a job's own seed wins" in help_text


def test_fasth3_renders_with_synthetic_adapter_and_records_schedule(tmp_path):
    ckpt, adapter = tmp_path / "ckpt", tmp_path / "adapter.safetensors"
    r = run_here("make-checkpoint", str(ckpt), "--config", "tiny", "--adapter", str(adapter))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "fast.mp4"
    r = run_here("prompt", "A drummer in a garage, snare cracks", "-o", str(out), "--checkpoint", str(ckpt),
                 "--mode", "fasth3", "--adapter", str(adapter), "--frames", "22")
    assert r.returncode == 0, r.stderr
    check_mp4(out, frames=22, width=224, height=128)
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["job"]["mode"] == "fasth3" and side["sigmas"]["forwards"] == 4
    assert side["sigmas"]["source"] == "release default"
    assert side["sigmas"]["positions"] == [0.999, 0.749, 0.5, 0.25, 0.0]
    import hashlib

    assert side["extra"]["fasth3"]["sha256"] == hashlib.sha256(adapter.read_bytes()).hexdigest()
    # steps are fixed by the student: asking for them is a usage error
    r = invoke("prompt", "x", "-o", str(tmp_path / "no.mp4"), "--checkpoint", str(ckpt), "--mode", "fasth3",
               "--adapter", str(adapter), "--steps", "4")
    assert "steps" in one_error_line(r) and not (tmp_path / "no.mp4").exists()
    # fasth3 without an adapter is refused before anything loads
    assert "--adapter" in one_error_line(invoke("prompt", "x", "-o", str(tmp_path / "no.mp4"), "--mode", "fasth3"))


def test_fasth3_v2_checkpoint_runs_its_own_contract(official_ckpt, tmp_path):
    """A checkpoint carrying V2's fastvideo_inference.json runs 8 forwards with video shift 10, no adapter."""
    import shutil

    ckpt = tmp_path / "v2"
    shutil.copytree(official_ckpt, ckpt)
    contract = {"model_id": "FastVideo/FastVideo-FastH3-8-Step-V2", "schema_version": "fasth3-inference-contract-v1",
                "transformer_forwards": 8, "guidance_scale": 1.0, "task": "t2av",
                "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125],
                "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0}
    (ckpt / "fastvideo_inference.json").write_text(json.dumps(contract))
    out = tmp_path / "v2.mp4"
    r = run_here("prompt", "A choir in a stone church", "-o", str(out), "--checkpoint", str(ckpt), "--mode", "fasth3",
                 "--frames", "22")
    assert r.returncode == 0, r.stderr
    side = json.loads(out.with_suffix(".json").read_text())["sigmas"]
    assert side["forwards"] == 8 and side["video_shift"] == 10.0 and side["source"] == "FastH3 V2 contract"
    s = 0.999
    assert abs(side["video"][0] - 10 * s / (1 + 9 * s)) < 1e-6
    # the same checkpoint refuses base-model jobs (its weights are the distilled student), before loading (issue #29)
    r = run_here("prompt", "x", "-o", str(tmp_path / "base.mp4"), "--checkpoint", str(ckpt), "--frames", "22")
    assert r.returncode == 2 and "pass --mode fasth3" in r.stderr and not (tmp_path / "base.mp4").exists()


def test_single_file_transformer_replaces_the_checkpoint_dit(official_ckpt, tmp_path):
    """A ComfyUI-style single-file DiT (q/k/v stacked) with the same weights loads the same tensors and renders the
    same MP4 frames.

    On CUDA the attention backend is pinned: left to `auto`, each process measures cuDNN against SDPA anew, and under
    a loaded machine (pytest -n 8 on one H200) two processes picked different ones, which render different frames
    from equal weights (issue #29: 87.7 % of pixels off). The loaded tensors are compared on every device."""
    import torch

    from h3render.checkpoint.load import load_components

    single = tmp_path / "dit.safetensors"
    r = run_here("make-checkpoint", str(single), "--config", "tiny", "--layout", "single-file")
    assert r.returncode == 0, r.stderr
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_components(official_ckpt, device, dtype, parts=("dit",)).dit.state_dict()
        file = load_components(official_ckpt, device, dtype, parts=("dit",), transformer_file=single).dit.state_dict()
        assert ours.keys() == file.keys()
        for name, tensor in ours.items():
            assert tensor.dtype == file[name].dtype and torch.equal(tensor, file[name]), (dtype, name)
    pinned = ("--attention", "sdpa") if device == "cuda" else ()
    args = ("--checkpoint", str(official_ckpt), "--frames", "22", "--steps", "3", "--seed", "2", *pinned)
    a, b = tmp_path / "a.mp4", tmp_path / "b.mp4"
    r = run_here("prompt", "Wind over dunes", "-o", str(a), *args)
    assert r.returncode == 0, r.stderr
    r = run_here("prompt", "Wind over dunes", "-o", str(b), *args, "--transformer", str(single))
    assert r.returncode == 0, r.stderr
    ran = [json.loads(p.with_suffix(".json").read_text())["run"]["attention"] for p in (a, b)]
    assert ran[0] == ran[1]
    np.testing.assert_array_equal(decode(a)[0], decode(b)[0])
    # the sidecar names the file the DiT came from (a user found no trace of it)
    assert "transformer" not in json.loads(a.with_suffix(".json").read_text())["checkpoint"]
    recorded = json.loads(b.with_suffix(".json").read_text())["checkpoint"]["transformer"]
    assert recorded["path"] == str(single.resolve()) and recorded["bytes"] == single.stat().st_size
    r = invoke("prompt", "x", "-o", str(tmp_path / "c.mp4"), *args, "--transformer", str(tmp_path / "nope.st"))
    assert "--transformer" in one_error_line(r)
    # a single file given as --checkpoint: exit 2, pointing at --transformer (was exit 1 after the plan)
    r = invoke("prompt", "x", "-o", str(tmp_path / "d.mp4"), "--checkpoint", str(single))
    assert "--transformer" in one_error_line(r) and not (tmp_path / "d.mp4").exists()


def test_make_checkpoint_single_file_must_end_in_safetensors(tmp_path):
    """`--layout single-file` wrote `sf`, which `--transformer sf` could not load (a single file is told from a
    checkpoint folder by its suffix): refused before anything is written."""
    from h3render.make_checkpoint.writer import make_checkpoint

    out = tmp_path / "sf"
    line = one_error_line(invoke("make-checkpoint", str(out), "--config", "tiny", "--layout", "single-file"))
    assert str(out) in line and "must end in .safetensors" in line
    with pytest.raises(ValueError, match="must end in .safetensors"):
        make_checkpoint(out, "tiny", "single-file")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["no suffix", "folder", "missing", "bad header", "other DiT"])
def test_an_unusable_transformer_file_is_a_usage_error_before_the_plan(kind, official_ckpt, tmp_path):
    """A single-file DiT named `sf` passed the old is-a-file check, then `prompt` printed the canvas line and failed
    as loading began ("failed: CheckpointError: sf: no such checkpoint folder", exit 1); a bad header or another
    architecture failed there too. Now each is one line naming --transformer and the file, exit 2, on prompt and on
    batch --dry-run, before anything else is printed."""
    import dataclasses
    import shutil

    import torch
    from safetensors.torch import save_file

    from h3render.checkpoint.releases import RELEASES

    path = tmp_path / {"no suffix": "sf", "folder": "dit", "missing": "nope.safetensors"}.get(kind, "dit.safetensors")
    if kind == "no suffix":
        single = tmp_path / "made" / "dit.safetensors"
        assert run_here("make-checkpoint", str(single), "--layout", "single-file").returncode == 0
        shutil.copy(single, path)  # the weights are fine: only the name is not
    elif kind == "folder":
        path.mkdir()
    elif kind == "bad header":
        path.write_bytes(b"\xff" * 64)
    elif kind == "other DiT":  # a readable header whose config is the small DiT, not this checkpoint's tiny one
        save_file({"w": torch.zeros(1)}, str(path), {"config": json.dumps(dataclasses.asdict(RELEASES["small"].dit))})
    common = ("--checkpoint", str(official_ckpt), "--transformer", str(path))
    out = tmp_path / "t" / "t.mp4"
    r = invoke("prompt", "x", "-o", str(out), *common, "--frames", "22", "--width", "64", "--height", "64")
    line = one_error_line(r)
    assert line.startswith(f"h3render: error: --transformer {path}: "), line
    assert r.stderr.strip().splitlines() == [line] and not out.parent.exists()  # no canvas line, nothing written
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text('{"id": "a", "prompt": "x", "frames": 22}\n')
    assert f"--transformer {path}: " in one_error_line(invoke("batch", str(manifest), "--dry-run", *common))


def test_batch_renders_jobs_in_turn_and_the_overlap_flags_are_gone(tmp_path):
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(json.dumps({"id": name, "prompt": f"Surf at dawn, take {name}", "frames": 22,
                                            "steps": 2, "width": 128, "height": 64}) + "\n" for name in "ab"))
    out = tmp_path / "out"
    plan = invoke("batch", str(manifest), "--out-dir", str(out), "--dry-run").stdout.splitlines()
    import torch

    # what the run computes in: fp32 on a CPU, bf16 on the GPU (the default device there)
    assert plan[0] == f"run: checkpoint tiny, precision {'bf16' if torch.cuda.is_available() else 'fp32'}"
    assert plan[1].startswith(f"[1/2] a ({out / 'a.mp4'}, render: no MP4): ") and not out.exists()
    r = run_here("batch", str(manifest), "--out-dir", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    # the plan now says what a rerun would do: skip both, or render them again with --overwrite
    plan = invoke("batch", str(manifest), "--out-dir", str(out), "--dry-run").stdout.splitlines()
    assert [line.split(": ")[0].split(", ")[-1] for line in plan[1:3]] == ["skip"] * 2, plan
    plan = invoke("batch", str(manifest), "--out-dir", str(out), "--dry-run", "--crf", "23").stdout.splitlines()
    assert f"({out / 'a.mp4'}, skip: done, rendered earlier with crf 18 (now 23)): " in plan[1], plan
    plan = invoke("batch", str(manifest), "--out-dir", str(out), "--dry-run", "--overwrite").stdout.splitlines()
    assert f"({out / 'b.mp4'}, render: overwrite)" in plan[2]
    report = json.loads((out / "batch-report.json").read_text())
    assert [j["status"] for j in report["jobs"]] == ["succeeded"] * 2 and report["queue_seconds"] > 0
    assert "overlap" not in report and "overlap" not in json.loads((out / "a.json").read_text())["timings"]
    line = click_error(invoke("batch", str(manifest), "--out-dir", str(out), "--no-overlap"))
    assert "No such option" in line and "--no-overlap" in line


def test_transformer_without_a_checkpoint_folder_is_a_usage_error(tmp_path):
    """--transformer replaces a checkpoint folder's DiT; on the built-in model it was accepted and failed after
    loading had begun (exit 1): now exit 2 before anything loads, saying what to do."""
    single = tmp_path / "dit.safetensors"
    single.write_bytes(b"\0" * 16)
    r = invoke("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--transformer", str(single))
    assert r.exit_code == 2 and "needs --checkpoint DIR" in r.output and not (tmp_path / "a.mp4").exists()


def test_a_bad_option_value_is_one_line_and_exit_2(tmp_path):
    """click's own report of a bad value is its usage block plus the error (4 lines); the command prints one."""
    r = run_cli("prompt", "x", "-o", str(tmp_path / "a.mp4"), "--crf", "99")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "h3render: error: Invalid value for '--crf': 99: x264's CRF is 1..51 for these MP4s (High profile) (see "
        "'h3render prompt --help')"]


def test_sidecar_records_the_checkpoint_absolute_and_resume_from_another_folder_agrees(official_ckpt, tmp_path):
    # A relative --checkpoint was recorded as given, so the same checkpoint named from another working directory
    # read as "rendered earlier with checkpoint ../x (now x)" on resume.
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text(json.dumps({"id": "a", "prompt": "Rain on a tin roof", "frames": 22, "steps": 2,
                                    "width": 128, "height": 64}) + "\n")
    out = tmp_path / "out"
    here = official_ckpt.parent
    r = run_here("batch", str(manifest), "--out-dir", str(out), "--checkpoint", official_ckpt.name, "--quiet",
                 cwd=here)
    assert r.returncode == 0, r.stderr
    recorded = json.loads((out / "a.json").read_text())["checkpoint"]
    # the path resolved; the release is the registry entry whose limits applied, not the folder name again
    assert recorded["path"] == str(official_ckpt.resolve()) and recorded["release"] == "tiny"
    r = run_here("batch", str(manifest), "--out-dir", str(out), "--dry-run", "--checkpoint",
                 f"{here.name}/{official_ckpt.name}", cwd=here.parent)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].startswith(f"[1/1] a ({out / 'a.mp4'}, skip: done): "), r.stdout


# Hides triton from a fresh interpreter, as on a CPU-only install (torch's CPU build does not bring it; it is one of
# the test extras only), then runs `h3render ARGS`.
_WITHOUT_TRITON = """
import importlib.abc, sys
class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoTriton())
from h3render.cli import main
sys.argv = ["h3render", *sys.argv[1:]]
main()
"""


@pytest.mark.skipif(__import__("torch").version.cuda is not None,
                    reason="a CUDA build of torch needs triton itself (its CUDA start-up imports it); the case is "
                           "the CPU-only install")
def test_a_cpu_install_without_triton_renders_the_readme_clip(tmp_path):
    """The README's first command on a CPU-only install: a top-level `import triton` in a module the DiT imports
    (h3render/kernels/vsa/quant.py, session 12) made every command but `presets` a traceback there (a fresh-user
    trial)."""
    import subprocess
    import sys

    from tests._cli import _child_env

    out = tmp_path / "lighthouse.mp4"
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON, "prompt", "A lighthouse at dusk", "-o", str(out),
                        "--frames", "22", "--steps", "2"], capture_output=True, text=True, env=_child_env(None),
                       timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    check_mp4(out, frames=22, width=224, height=128)
