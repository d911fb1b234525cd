"""`h3render.settings.RunSettings`: resolved once (command line > manifest defaults > default, field by field),
checked once (each refusal, one line), recorded once (the resume key as `h3render batch` built it before), and
torch-free at import; `h3render.exits`: every error class gives its exit code."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3render import exits
from h3render.settings import (RunSettings, SettingsError, check_transformer, precision_problem, prompt_mode,
                               resolve_checkpoint)
from tests._env import REPO, repo_pythonpath

# click's option names, every engine option left out (None) but the three with defaults of their own
NOTHING = {"checkpoint": None, "transformer": None, "mode": None, "adapter": None, "adapter_variant": None,
           "fasth3_positions": None, "device": None, "dtype": None, "precision": None, "gpus": None, "crf": 18,
           "x264_preset": "veryfast", "attention": None, "save_latents": False, "vae_batch": 8}
INFO = SimpleNamespace(recorded_path="/models/h3", config_hash="c0ffee", layout="official", path="/models/h3")


def manifest(**fields) -> SimpleNamespace:
    """A `manifest.Manifest`'s run-wide fields (what `read_manifest` returns from a manifest's defaults)."""
    values = {"path": Path("/jobs/m.yaml"), "adapter": None, "precision": "bf16", "adapter_variant": None,
              "fasth3_positions": None}
    return SimpleNamespace(**{**values, **fields})


def resolve(cli=None, m=None, info=INFO) -> RunSettings:
    return RunSettings.resolve({**NOTHING, **(cli or {})}, checkpoint="/models/h3", info=info, manifest=m)


# -- resolution ---------------------------------------------------------------------------------------------------

def test_defaults_when_nothing_is_given():
    run = resolve()
    assert (run.checkpoint, run.checkpoint_path, run.config_hash) == ("/models/h3", "/models/h3", "c0ffee")
    assert (run.transformer, run.adapter, run.adapter_variant, run.fasth3_positions) == (None,) * 4
    assert run.precision == "bf16" and run.precision_from is None
    assert run.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert run.dtype == ("bf16" if run.device == "cuda" else "fp32")
    assert (run.gpus, run.attention, run.crf, run.x264_preset, run.vae_batch) == (None, None, 18, "veryfast", 8)
    assert (run.compile_vae, run.graph_audio, run.save_latents) == (True, True, False)


@pytest.mark.parametrize("name, from_manifest, from_cli", [
    ("adapter", Path("/jobs/student.safetensors"), "/cli/student.safetensors"),
    ("adapter_variant", "dense-datafree", "vsa-datafree"),
    ("fasth3_positions", "fastvideo-example", "release"),
    ("precision", "fp8", "bf16"),
])
def test_each_manifest_field_is_below_the_command_line_and_above_the_default(name, from_manifest, from_cli):
    default = getattr(resolve(), name)
    assert default != str(from_manifest)
    assert getattr(resolve(m=manifest(**{name: from_manifest})), name) == str(from_manifest)
    assert getattr(resolve({name: from_cli}, m=manifest(**{name: from_manifest})), name) == from_cli


@pytest.mark.parametrize("name, value", [("transformer", "/x/dit.safetensors"), ("device", "cpu"), ("gpus", 3),
                                         ("attention", "sdpa"), ("crf", 23), ("x264_preset", "slow"),
                                         ("vae_batch", 2), ("save_latents", True), ("dtype", "bf16")])
def test_each_command_line_only_field_overrides_its_default(name, value):
    # dtype's default follows the device (bf16 on CUDA): on a GPU machine the default device is cuda, so pin cpu
    # (the suite on the H200 failed here: its default already was bf16)
    base = {"device": "cpu"} if name == "dtype" else {}
    assert getattr(resolve(base), name) != value or name == "device"
    assert getattr(resolve({**base, name: value}, m=manifest()), name) == value


def test_fp8_implies_bf16_activations_and_names_the_manifest_that_set_it():
    run = resolve({"device": "cpu"}, m=manifest(precision="fp8"))
    assert run.dtype == "bf16" and run.precision_from == "/jobs/m.yaml"
    assert resolve({"device": "cpu", "precision": "fp8"}, m=manifest(precision="fp8")).precision_from is None
    assert resolve({"device": "cpu", "dtype": "fp32"}).dtype == "fp32"
    assert RunSettings(device="cuda").dtype == "bf16" and RunSettings().dtype == "fp32"


def test_checkpoint_is_the_option_then_the_environment_then_the_tiny_model(tmp_path):
    assert resolve_checkpoint(None, {}) == ("tiny", resolve_checkpoint(None, {})[1])
    assert "random weights" in resolve_checkpoint(None, {})[1]
    assert resolve_checkpoint(None, {"H3RENDER_CHECKPOINT": "small"}) == ("small", None)
    assert resolve_checkpoint(str(tmp_path), {"H3RENDER_CHECKPOINT": "small"}) == (str(tmp_path), None)
    with pytest.raises(SettingsError, match=f"^checkpoint {tmp_path / 'nope'} does not exist$"):
        resolve_checkpoint(str(tmp_path / "nope"), {})
    (tmp_path / "dit.safetensors").write_bytes(b"")
    with pytest.raises(SettingsError, match="is a single file: .* with --transformer$"):
        resolve_checkpoint(str(tmp_path / "dit.safetensors"), {})


def test_device_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SettingsError, match="^--device cuda: no CUDA device is available$"):
        resolve({"device": "cuda"})


# -- the one check ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, mode, message", [
    (dict(crf=52), None, "--crf 52: x264's CRF is 1..51 for these MP4s (High profile)"),
    # x264's High profile refuses lossless: CRF 0 was accepted, then every job failed after its whole denoise
    (dict(crf=0), None, "--crf 0 is lossless, which x264 cannot encode in the High profile the MP4s use; choose "
                        "1..51"),
    (dict(vae_batch=0), None, "--vae-batch 0: must be >= 1"),
    (dict(x264_preset="ultrafastt"), None, "--x264-preset 'ultrafastt' is not an x264 preset (did you mean ultrafast?)"),
    (dict(), "fasth3", "--mode fasth3 needs --adapter PATH (the FastH3 student adapter) or a FastH3 V2 checkpoint"),
    (dict(adapter="/no/such/adapter"), None, "--adapter /no/such/adapter: no such file or folder"),
    (dict(precision="fp8", dtype="fp32"), None, "--precision fp8 runs the activations in bf16 (its GEMMs write "
                                                "bf16), so it cannot go with --dtype fp32: drop --dtype or pass "
                                                "--dtype bf16"),
    (dict(precision="fp8", dtype="fp32", precision_from="/jobs/m.yaml"), None, "/jobs/m.yaml: precision: "
                                                                              "--precision fp8 runs"),
])
def test_each_refusal_is_one_line(settings, mode, message):
    with pytest.raises(SettingsError) as info:
        RunSettings(**settings).check(mode=mode, world=1)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_transformer_on_the_builtin_model_and_an_unreadable_one_are_refused(tmp_path):
    builtin = SimpleNamespace(layout="builtin", path="tiny")
    with pytest.raises(SettingsError, match=r"^--transformer t.safetensors replaces a checkpoint folder's DiT: it "
                                            r"needs --checkpoint DIR .* the built-in tiny model takes none$"):
        RunSettings(transformer="t.safetensors").check(builtin)
    check_transformer(None, builtin)  # nothing to check
    from h3render.settings import checkpoint_info

    folder = tmp_path / "ckpt"
    from h3render.make_checkpoint.writer import make_checkpoint

    make_checkpoint(folder, config="tiny", layout="official")
    with pytest.raises(SettingsError, match=f"^--transformer {tmp_path / 'nope.safetensors'}"):
        check_transformer(str(tmp_path / "nope.safetensors"), checkpoint_info(str(folder)))


def test_fp8_on_each_gpu_of_the_run(monkeypatch):
    capability = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability[device.index])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"GPU{device.index}")
    run = RunSettings(device="cuda", precision="fp8")
    assert run.check(world=1) == []  # cuda:0 is a Hopper
    with pytest.raises(SettingsError, match=r"^--precision fp8 needs FP8 GEMMs .*cuda:1 \(GPU1\) has 8.0: use "):
        run.check(world=2)
    assert run.check() == []  # --dry-run: against the dtype only
    assert precision_problem("bf16", "fp32", run.devices(2)) is None


def test_attention_is_refused_on_cuda_when_missing_and_a_warning_on_the_cpu(monkeypatch):
    import h3render.models.attention as attention

    monkeypatch.setattr(attention, "available_backends", lambda: ["sdpa"])
    with pytest.raises(SettingsError, match=r"^--attention fa3: not available on this machine \(available: sdpa\)$"):
        RunSettings(device="cuda", attention="fa3").check()
    assert RunSettings(device="cuda", attention="sdpa").check() == []
    [warning] = RunSettings(device="cpu", attention="fa3").check()
    assert warning.startswith("h3render: warning: --attention fa3 applies on CUDA only; on cpu attention runs")


def test_prompt_mode_adapter_implies_fasth3_and_refuses_t2va():
    assert prompt_mode(None, None) == (None, None) and prompt_mode("t2va", None) == ("t2va", None)
    mode, note = prompt_mode(None, "a.safetensors")
    assert mode == "fasth3" and "--mode fasth3" in note
    assert prompt_mode("fasth3", "a.safetensors") == ("fasth3", None)
    with pytest.raises(SettingsError, match="^--adapter fuses the FastH3 student"):
        prompt_mode("t2va", "a.safetensors")


# -- the record -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transformer", [None, "dit.safetensors"])
def test_record_is_the_resume_key_batch_built_before(transformer):
    """The dict `cli._batch` built as `current` at 41fb064, written out from that code, for the same inputs: the
    sidecars of older versions keep resuming against it (timing.rendered_with, docs/schema/sidecar.json)."""
    opts = {**NOTHING, "transformer": transformer, "precision": None, "crf": 23, "x264_preset": "slow"}
    m = manifest(precision="fp8")
    run = RunSettings.resolve(opts, checkpoint="rel/h3", info=INFO, manifest=m)
    opts["precision"] = m.precision  # what _batch did
    current = {"checkpoint": {"path": INFO.recorded_path, "config_hash": INFO.config_hash,
                              "transformer": opts["transformer"] and str(Path(opts["transformer"]).resolve()),
                              "precision": opts["precision"]},
               "encoder": {"crf": opts["crf"], "x264_preset": opts["x264_preset"]}}
    assert run.record() == current
    assert run.summary() == {"checkpoint": "rel/h3", "precision": "fp8", "adapter": None}
    # UI fields are not settings: they change neither the record nor equality
    from dataclasses import replace

    assert replace(run, progress=False, step_bar_position=0) == run


def test_record_of_a_recorded_sidecar_reads_as_unchanged():
    from h3render.sidecar import rendered_with

    run = resolve({"crf": 20, "device": "cpu"})  # a CPU run (the GPU suite's default device is cuda, dtype bf16)
    assert run.dtype == "fp32" and run.record()["checkpoint"]["precision"] == "fp32"  # this CPU run's: what runs
    sidecar = {"schema": 5, "checkpoint": {"path": "/models/h3", "config_hash": "c0ffee"},
               "run": {"precision": "fp32", "dtype": "float32", "encoder": {"crf": 20, "x264_preset": "veryfast"}}}
    assert rendered_with(sidecar, **run.record()) is None
    assert rendered_with(sidecar, **resolve({"crf": 18, "device": "cpu"}).record()) == (
        "rendered earlier with crf 20 (now 18)")
    # schema 4 recorded the setting, "bf16", for the same fp32 run: it reads as unchanged too, not "bf16 (now fp32)"
    schema4 = {**sidecar, "schema": 4, "run": {**sidecar["run"], "precision": "bf16"}}
    assert rendered_with(schema4, **run.record()) is None
    assert rendered_with(schema4, **resolve({"crf": 20, "device": "cpu", "dtype": "bf16"}).record()) == (
        "rendered earlier with precision fp32 (now bf16)")


# -- import cost and exit codes ---------------------------------------------------------------------------------

def test_settings_exits_and_cli_import_no_torch():
    code = ("import sys, h3render.settings, h3render.exits, h3render.cli_options, h3render.cli; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={"PYTHONPATH": repo_pythonpath(), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "False", (r.stdout, r.stderr)


def test_every_error_class_has_its_exit_code():
    from h3render.engine import RenderError
    from h3render.manifest import ManifestError
    from h3render.outputs import BatchUsageError
    from h3render.signals import Interrupted

    assert [exits.EXIT_OK, exits.EXIT_FAILED, exits.EXIT_USAGE, exits.EXIT_REQUEUE, exits.EXIT_INTERRUPTED] == [
        0, 1, 2, 75, 130]
    for usage in (SettingsError("x"), ManifestError(["m:1: f: bad"]), BatchUsageError("--out-dir x")):
        assert exits.error_exit_code(usage) == 2, usage
    assert exits.error_exit_code(Interrupted("", signal.SIGUSR1)) == 75
    assert exits.error_exit_code(Interrupted("", signal.SIGTERM)) == 130
    assert exits.error_exit_code(KeyboardInterrupt()) == 130
    assert exits.error_exit_code(RenderError("nan")) == exits.error_exit_code(ValueError("x")) == 1
    assert [exits.signal_exit_code(s) for s in (signal.SIGUSR2, signal.SIGHUP, None)] == [75, 130, 130]
