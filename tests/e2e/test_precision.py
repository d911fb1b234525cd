"""`--precision fp8` end to end on the tiny built-in model (CPU, where torch._scaled_mm runs too): the CLI and a
batch manifest render FP8, the sidecar says so per component, the bf16 default is unchanged, and the refusals come
before any weights load (a job changing the engine's precision, fp8 with --dtype fp32, a GPU older than sm_89).
A mixed queue (t2va jobs beside a FastH3 adapter) runs its t2va jobs on a bf16 DiT and its fasth3 jobs on the fused,
then quantized, DiT.

Renders run in this process (click's CliRunner, the Engine API); bounds are about twice the values measured on CPU
(torch 2.13, the seeds below), each measured value in a comment.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from h3render.spec import PRECISIONS
from h3render.checkpoint.releases import RELEASES
from h3render.engine import Engine
from h3render.jobs import Job
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.models.fp8 import Fp8Linear
from h3render.parallel.groups import ParallelContext
from h3render.settings import RunSettings, precision_problem
from tests._mp4 import frames_of
from tests._numerics import rel_err
from tests.e2e.test_cli import check_mp4, invoke, one_error_line

SMALL = ("--width", "128", "--height", "64", "--frames", "22", "--steps", "3", "--seed", "5")
PROMPT = "Gulls over a harbour"
CTX = ParallelContext(0, 1, 0, torch.device("cpu"))
FP8_PREFIX = "fp8_e4m3"


def sidecar(mp4: Path) -> dict:
    return json.loads(mp4.with_suffix(".json").read_text())


def latents(mp4: Path) -> dict[str, torch.Tensor]:
    return torch.load(mp4.with_name(mp4.stem + ".latents.pt"))


@pytest.fixture(scope="module")
def renders(tmp_path_factory):
    """The same job rendered by `h3render prompt` with --precision fp8 (no --dtype: fp8 implies bf16 on CPU too)
    and with the default precision at --dtype bf16: {"fp8": mp4, "bf16": mp4}, latents saved beside each."""
    folder = tmp_path_factory.mktemp("precision")
    out = {"fp8": folder / "fp8.mp4", "bf16": folder / "bf16.mp4"}
    for name, extra in (("fp8", ("--precision", "fp8")), ("bf16", ("--dtype", "bf16"))):
        r = invoke("prompt", PROMPT, "-o", str(out[name]), *SMALL, "--device", "cpu", "--save-latents", *extra)
        assert r.exit_code == 0, r.output
        assert "warning" not in r.stderr, r.stderr
    return out


def test_fp8_prompt_renders_a_playable_mp4_whose_sidecar_says_fp8(renders):
    from tests.e2e.test_sidecar_schema import validate

    check_mp4(renders["fp8"], frames=22, width=128, height=64)
    side = sidecar(renders["fp8"])
    validate(side, "sidecar")
    run = side["run"]
    assert run["precision"] == "fp8" and run["dtype"] == "bfloat16"  # fp8 implied bf16 activations on CPU
    parts = run["precision_components"]
    # DIT_TINY: 2 blocks x (qkv, out, fc1, fc2); the tiny conditioner: 2 read layers x 7 linears
    assert parts["dit_blocks"].startswith(f"{FP8_PREFIX} (") and "; 8 linears)" in parts["dit_blocks"]
    assert parts["text_encoder"].startswith(f"{FP8_PREFIX} weights") and "350 linears" in parts["text_encoder"]  # 7 per layer, 50 read
    assert parts["dit_other"].startswith("bf16") and parts["audio_vae"] == "fp32"
    # VIDEO_VAE_TINY: 2 decoder blocks x (fused q/k/v, out, SwiGLU in, SwiGLU out)
    assert parts["video_vae"].startswith(f"{FP8_PREFIX} decoder blocks (") and "; 8 linears)" in parts["video_vae"]


def test_bf16_is_the_default_and_its_sidecar_says_so(renders):
    run = sidecar(renders["bf16"])["run"]
    assert run["precision"] == "bf16" and run["dtype"] == "bfloat16"
    assert run["precision_components"]["dit_blocks"] == "bf16"
    assert run["precision_components"]["text_encoder"] == "bf16"
    assert run["precision_components"]["video_vae"].startswith("bf16")  # no FP8 decoder blocks
    assert PRECISIONS[0] == "bf16"
    from h3render.manifest import DEFAULT_PRECISION

    assert DEFAULT_PRECISION == PRECISIONS[0]


def test_fp8_render_differs_from_bf16_but_stays_close(renders):
    fp8, bf16 = latents(renders["fp8"]), latents(renders["bf16"])
    for part, bound in (("video", 0.013), ("audio", 0.012)):
        err = rel_err(fp8[part], bf16[part])
        # 2 forwards, FP8 DiT blocks + FP8 text-encoder weights: measured 0.0064 (video), 0.0058 (audio)
        assert 0 < err <= bound, (part, err)
    a, b = frames_of(renders["fp8"]).astype(np.float64), frames_of(renders["bf16"]).astype(np.float64)
    diff = float(np.abs(a - b).mean())
    # mean |frame difference| in 8-bit code values: measured 5.78 with the FP8 video decoder (4.38 with a bf16 one;
    # the random tiny VAE amplifies latent differences; the frames themselves spread 34 code values about their mean)
    assert 0 < diff <= 12.0, diff


def _manifest(folder: Path, job_precision: str | None = None, defaults: str = "fp8") -> Path:
    lines = ["defaults:", f"  precision: {defaults}", "jobs:", "  - id: fp8", f"    prompt: {PROMPT}",
             "    width: 128", "    height: 64", "    frames: 22", "    steps: 3", "    seed: 5"]
    if job_precision is not None:
        lines.append(f"    precision: {job_precision}")
    path = folder / "m.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_manifest_defaults_precision_fp8_renders_fp8(renders, tmp_path):
    out = tmp_path / "out"
    # a job repeating the run's precision is fine
    r = invoke("batch", str(_manifest(tmp_path, job_precision="fp8")), "--out-dir", str(out), "--device", "cpu",
               "--quiet", "--save-latents")
    assert r.exit_code == 0, r.output
    side = sidecar(out / "fp8.mp4")
    assert side["run"]["precision"] == "fp8"
    assert side["run"]["precision_components"]["dit_blocks"].startswith(FP8_PREFIX)
    got, want = latents(out / "fp8.mp4"), latents(renders["fp8"])
    for part in ("video", "audio"):
        assert torch.equal(got[part], want[part]), part  # the same engine setting as `prompt --precision fp8`


def _refuse_load(monkeypatch) -> None:
    """Fail the test if any weights start to load."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the usage error")

    monkeypatch.setattr(Engine, "load", refuse)


@pytest.fixture
def no_load(monkeypatch):
    _refuse_load(monkeypatch)


def test_manifest_defaults_reach_the_engine(tmp_path, monkeypatch):
    """defaults: precision, adapter (a bundle folder too), adapter_variant, fasth3_positions -> the RunSettings
    Engine.load gets; each command-line option wins over its field; on a job the FastH3 ones are refused."""
    # a real bundle: the one check places the adapter before loading (an empty folder is refused there)
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_bundle

    write_synthetic_bundle(tmp_path / "bundle", RELEASES["tiny"].dit, seed=1)
    seen = []

    def fake_load(run, ctx, **kw):
        seen.append(run)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(Engine, "load", fake_load)
    manifest = tmp_path / "m.jsonl"
    defaults = {"precision": "fp8", "adapter": "bundle", "adapter_variant": "vsa-datafree",
                "fasth3_positions": "fastvideo-example"}
    manifest.write_text(json.dumps({"defaults": defaults}) + "\n" + json.dumps(
        {"prompt": "x", "mode": "fasth3", "width": 128, "height": 64, "frames": 22}) + "\n")
    for extra, positions in (((), "fastvideo-example"), (("--fasth3-positions", "release"), "release")):
        invoke("batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--quiet", *extra)
        run = seen.pop()
        assert run.torch_dtype == torch.bfloat16 and run.precision == "fp8" and run.adapter == str(tmp_path / "bundle")
        assert run.adapter_variant == "vsa-datafree" and run.fasth3_positions == positions
    on_job = tmp_path / "j.jsonl"
    on_job.write_text(json.dumps({"defaults": {"fasth3_positions": "nope"}}) + "\n" + json.dumps(
        {"prompt": "x", "adapter_variant": "v"}) + "\n")
    r = invoke("batch", str(on_job), "--out-dir", str(tmp_path / "out"))
    assert r.exit_code == 2 and not seen
    errors = [line for line in r.stderr.splitlines() if line.startswith("h3render: error")]
    assert errors == [f"h3render: error: {on_job}:1: fasth3_positions: 'nope' is not one of release, "
                      f"fastvideo-example",
                      f"h3render: error: {on_job}:2: adapter_variant: may only be set in the manifest's defaults"]


def test_a_job_changing_the_engine_precision_is_refused_before_load(tmp_path, no_load):
    manifest, out = _manifest(tmp_path, job_precision="bf16"), tmp_path / "out"
    error = one_error_line(invoke("batch", str(manifest), "--out-dir", str(out), "--device", "cpu"))
    assert error == (f"h3render: error: {manifest}:11: precision: 'bf16' differs from this run's precision 'fp8' "
                     f"(from the defaults at {manifest}:2): precision is one engine setting for the whole run (the "
                     "weights load once); remove it from this job, or render the job in a batch of its own")
    # --precision on the command line wins over the defaults, and the job's own fp8 now conflicts with it
    manifest = _manifest(tmp_path, job_precision="fp8", defaults="bf16")
    error = one_error_line(invoke("batch", str(manifest), "--out-dir", str(out), "--precision", "bf16"))
    assert f"{manifest}:11: precision: 'fp8' differs from this run's precision 'bf16' (from --precision)" in error
    error = one_error_line(invoke("batch", str(_manifest(tmp_path, defaults="fp16")), "--out-dir", str(out)))
    assert error.endswith(f"{manifest}:2: precision: 'fp16' is not one of bf16, fp8")
    assert not out.exists()


def test_fp8_with_dtype_fp32_is_a_usage_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="cannot go with --dtype fp32"):
        Engine.load(RunSettings(dtype="fp32", precision="fp8"), CTX)  # the API: the same rule, before loading
    _refuse_load(monkeypatch)
    out = tmp_path / "x.mp4"
    error = one_error_line(invoke("prompt", PROMPT, "-o", str(out), *SMALL, "--device", "cpu", "--precision", "fp8",
                                  "--dtype", "fp32"))
    assert "--precision fp8" in error and "--dtype fp32" in error and "bf16" in error
    assert not out.exists()
    # fp8 from a manifest's defaults: the same refusal names the manifest, and the out dir is not created
    # (it was left behind empty, found by a fresh-user trial), --dry-run included
    manifest, out_dir = _manifest(tmp_path), tmp_path / "renders"
    for extra in ((), ("--dry-run",)):
        error = one_error_line(invoke("batch", str(manifest), "--out-dir", str(out_dir), "--dtype", "fp32", *extra))
        assert error.startswith(f"h3render: error: {manifest}: precision: --precision fp8 runs") and "fp32" in error
    assert not out_dir.exists()


def test_fp8_on_a_gpu_older_than_sm89_is_a_usage_error(tmp_path, monkeypatch, no_load):
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    error = one_error_line(invoke("prompt", PROMPT, "-o", str(tmp_path / "x.mp4"), *SMALL, "--device", "cuda",
                                  "--precision", "fp8"))
    assert "--precision fp8" in error and ">= 8.9" in error and "NVIDIA A100-SXM4-80GB) has 8.0" in error, error
    gpu = [torch.device("cuda", 0)]
    assert precision_problem("bf16", "bf16", gpu) is None  # bf16 asks nothing of the GPU
    for ok in ((8, 9), (9, 0), (10, 0)):  # Ada, Hopper, Blackwell
        capability["value"] = ok
        assert precision_problem("fp8", "bf16", gpu) is None, ok
    capability["value"] = (8, 6)
    assert "has 8.6" in precision_problem("fp8", "bf16", gpu)


def test_resume_names_a_precision_change():
    from h3render.sidecar import rendered_with

    side = {"checkpoint": {"path": "tiny", "config_hash": "h"}, "run": {"precision": "bf16"}}
    note = rendered_with(side, {"path": "tiny", "config_hash": "h", "precision": "fp8"}, {})
    assert note == "rendered earlier with precision bf16 (now fp8)"
    schema2 = {"checkpoint": {"path": "tiny", "config_hash": "h"}, "run": {"precision": {"dit": "bfloat16"}}}
    assert rendered_with(schema2, {"path": "tiny", "config_hash": "h", "precision": "bf16"}, {}) is None


# -- a mixed queue -----------------------------------------------------------------------------------------------

BASE = Job(id="a", prompt=PROMPT, width=128, height=64, frames=22, seed=5, steps=3, mode="t2va", output="a")
FAST = replace(BASE, id="b", prompt="A kettle whistles", seed=6, steps=None, mode="fasth3", output="b")
SETTINGS = RunSettings(dtype="bf16", precision="fp8", progress=False, save_latents=True)


def _fp8_weights(engine) -> dict[str, torch.Tensor]:
    return {name: m.dequantized_weight() for name, m in engine.c.dit.blocks.named_modules()
            if isinstance(m, Fp8Linear)}


def test_mixed_queue_runs_base_jobs_bf16_then_the_fused_student_fp8(tmp_path, capsys):
    adapter = str(write_synthetic_adapter(tmp_path / "adapter.safetensors", RELEASES["tiny"].dit, seed=2))
    mixed = Engine.load(replace(SETTINGS, adapter=adapter), CTX, base_jobs_first=True)
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "--precision fp8 with a mixed queue" in warning[0] and "bf16" in warning[0]
    base_weights = {f"{name}.weight": m.weight.detach().float().clone()
                    for name, m in mixed.c.dit.blocks.named_modules() if isinstance(m, torch.nn.Linear)}
    mixed.prepare([BASE, FAST])
    base_side = mixed.render(BASE, tmp_path / "a.mp4", tmp_path / "a.json")
    fast_side = mixed.render(FAST, tmp_path / "b.mp4", tmp_path / "b.json")
    # the base job ran a bf16 DiT and an FP8 text encoder; the fasth3 job the quantized student
    assert base_side["run"]["precision"] == fast_side["run"]["precision"] == "fp8"
    assert base_side["run"]["precision_components"]["dit_blocks"] == "bf16"
    assert base_side["run"]["precision_components"]["text_encoder"].startswith(FP8_PREFIX)
    assert fast_side["run"]["precision_components"]["dit_blocks"].startswith(FP8_PREFIX)
    # int8 QK^T in VSA only where it pays (fp8 on sm_90+: `models.attention.vsa_qk_int8_pays`); not on the CPU
    assert mixed.c.dit.vsa_qk_int8 is False
    assert "int8" not in fast_side["run"]["precision_components"]["dit_blocks"]
    assert json.loads((tmp_path / "a.json").read_text())["run"] == base_side["run"]  # as written on the writer thread
    quantized = _fp8_weights(mixed)
    assert len(quantized) == 4 * RELEASES["tiny"].dit.num_layers

    fused = Engine.load(replace(SETTINGS, adapter=adapter), CTX)  # fused at load
    want = _fp8_weights(fused)
    assert sorted(want) == sorted(quantized)
    deltas = []
    for name, w in quantized.items():
        # Fused in place into bf16 parameters, or while streaming into bf16 ones: the same rounding, then the same
        # quantization, so the same FP8 codes and scales.
        assert torch.equal(w, want[name]), name
        deltas.append(rel_err(base_weights[f"{name}.weight"], want[name]))
    assert min(deltas) > 0.015, deltas  # ...and they are the student's, not the base's: measured >= 0.0315
    (tmp_path / "fused").mkdir()
    fused.render(FAST, tmp_path / "fused" / "b.mp4", tmp_path / "fused" / "b.json")
    got, ref = latents(tmp_path / "b.mp4"), latents(tmp_path / "fused" / "b.mp4")
    for part in ("video", "audio"):
        assert torch.equal(got[part], ref[part]), part  # same weights, same FP8 GEMMs: the same latents
