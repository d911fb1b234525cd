"""Usage errors that need no weights answer at once (issue #29, round 2): option values, missing files, the
checkpoint's configs, a job's fields and keyframes, manifest errors. They came out only after the checks had imported
torch, `checkpoint.load` and transformers' Qwen3-VL (~6 s of a fresh process on an idle core); now before any of
those, and without the tiny-model notice in front of them. (`prompt --quiet` printing warnings only is checked on
a render that warns: tests/e2e/test_sidecar_schema.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests._env import REPO, repo_pythonpath

# One fresh interpreter runs every case in turn (a process each would cost a second apiece), then says which heavy
# modules the cases imported between them.
_PROBE = r"""
import contextlib, io, json, sys
from h3render.cli import main
results = []
for args in json.loads(sys.argv[1]):
    sys.argv, err = ["h3render", *args], io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exc:
            results.append([exc.code, err.getvalue()])
heavy = sorted(m for m in ("torch", "transformers", "h3render.checkpoint.load") if m in sys.modules)
print(json.dumps({"results": results, "heavy": heavy}))
"""


def test_usage_errors_come_before_torch_is_imported(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "widht": 128}\n')
    mp4 = str(tmp_path / "a.mp4")
    cases = {
        "--crf": (["prompt", "x", "-o", mp4, "--crf", "99"], "x264's CRF is 1..51"),
        "--preset": (["prompt", "x", "-o", mp4, "--preset", "nope"], "unknown preset 'nope'"),
        "--width": (["prompt", "x", "-o", mp4, "--width", "33", "--height", "64"], "33 is not a positive multiple"),
        "keyframe": (["prompt", "x", "-o", mp4, "--first-frame", str(tmp_path / "no.png")], "keyframe image not found"),
        "--adapter": (["prompt", "x", "-o", mp4, "--adapter", str(tmp_path / "no.safetensors")],
                      "no such file or folder"),
        "--transformer": (["prompt", "x", "-o", mp4, "--transformer", str(tmp_path / "no.safetensors")],
                          "the built-in tiny model takes none"),
        "--gpus": (["prompt", "x", "-o", mp4, "--gpus", "0"], "--gpus must be >= 1, got 0"),
        "--precision": (["prompt", "x", "-o", mp4, "--precision", "fp8", "--steps", "1"], "steps: 1 sigma point"),
        "--checkpoint": (["prompt", "x", "-o", mp4, "--checkpoint", str(tmp_path / "none")], "does not exist"),
        "manifest": (["batch", str(bad), "--out-dir", str(tmp_path / "out")], "widht: unknown field"),
        "manifest file": (["batch", str(tmp_path / "none.jsonl"), "--out-dir", str(tmp_path / "out")], "none.jsonl"),
        "make-checkpoint OUT": (["make-checkpoint", str(tmp_path)], "already exists and is a folder that is not empty"),
        "make-checkpoint single file": (["make-checkpoint", str(tmp_path / "dit.bin"), "--layout", "single-file"],
                                        "must end in .safetensors"),
        "make-checkpoint --adapter": (["make-checkpoint", str(tmp_path / "ckpt"), "--adapter", str(bad)],
                                      "already exists; name a new file"),
        # a trial: the adapter written over the single-file checkpoint it named; a folder nobody could load
        "make-checkpoint --adapter OUT": (["make-checkpoint", str(tmp_path / "d.safetensors"), "--layout",
                                          "single-file", "--adapter", str(tmp_path / "d.safetensors")],
                                         "is OUT itself"),
        "make-checkpoint --adapter-bundle in OUT": (["make-checkpoint", str(tmp_path / "c"), "--adapter-bundle",
                                                    str(tmp_path / "c" / "b")], "is inside OUT"),
        "make-checkpoint folder .safetensors": (["make-checkpoint", str(tmp_path / "c.safetensors")],
                                                "a checkpoint folder cannot end in .safetensors"),
        "--skip-existing --overwrite": (["batch", str(bad), "--skip-existing", "--overwrite"],
                                        "ask for opposite things"),  # a flag pair let the last one win
        "make-checkpoint onto a file": (["make-checkpoint", str(bad), "--layout", "single-file"],
                                        "must end in .safetensors"),
    }
    probe = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([args for args, _ in cases.values()])],
                           capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**{k: v for k, v in os.environ.items() if k != "H3RENDER_CHECKPOINT"},
                                "PYTHONPATH": repo_pythonpath()})
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.splitlines()[-1])
    for (name, (_, needle)), (code, stderr) in zip(cases.items(), out["results"]):
        lines = stderr.strip().splitlines()
        # one line: the error alone, no "renders noise" notice before it
        assert code == 2 and len(lines) == 1 and needle in lines[0], (name, code, stderr)
    assert out["heavy"] == [], out["heavy"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "a.mp4").exists()


def test_a_resumed_queue_with_nothing_left_loads_nothing(tmp_path):
    """A trial's nit: a resumed queue whose every job is rendered took 7 s to say so (the memory plan imported the
    checkpoint loader and transformers, then a rank started and imported the engine). Now it answers from the
    sidecars alone: the report says the job was skipped, and neither the engine nor the loader is imported."""
    from tests._cli import run_here

    (tmp_path / "q.jsonl").write_text('{"id": "a", "prompt": "a cat", "frames": 22, "width": 128, "height": 64, '
                                      '"steps": 2}\n')
    args = ("batch", "q.jsonl", "--out-dir", "out", "--device", "cpu")
    first = run_here(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    probe = _PROBE.replace("heavy = sorted(m for m in (\"torch\", \"transformers\", \"h3render.checkpoint.load\")",
                           "heavy = sorted(m for m in (\"h3render.engine\", \"h3render.checkpoint.load\")")
    done = subprocess.run([sys.executable, "-c", probe, json.dumps([list(args)])], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**{k: v for k, v in os.environ.items()
                                                             if k != "H3RENDER_CHECKPOINT"},
                                                          "PYTHONPATH": repo_pythonpath()})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    (code, stderr), = out["results"]
    assert code == 0 and "1 already rendered (skipped), 0 to render" in stderr, stderr
    assert "renders noise" not in stderr  # the tiny model's notice is for a queue that renders
    assert out["heavy"] == [], out["heavy"]
    report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
    assert [(j["id"], j["status"]) for j in report["jobs"]] == [("a", "skipped")]
