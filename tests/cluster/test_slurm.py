"""scripts/h3render.sbatch on a real one-node SLURM cluster (Debian's Slurm 22.05 + munge, started here by
scripts/slurm_local.sh): a 2-task array renders a 4-job manifest with the built-in tiny model, and every job is
rendered by exactly one task; scancel in the middle of a job ends the task with 130 and no partial files. Needs
root (CI runs it as root); installs the packages if missing. Never skips: if SLURM cannot start, the test fails
and prints the daemons' logs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tests._env import repo_pythonpath
from h3render.report import read_report

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
SBATCH_SCRIPT = REPO / "scripts" / "h3render.sbatch"
# Options after MANIFEST OUT_DIR: the built-in tiny model, on CPU (CI has no GPU).
H3RENDER_OPTIONS = ["--checkpoint", "tiny", "--quiet"]

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logs(cluster_dir: Path) -> str:
    return subprocess.run([str(SLURM_LOCAL), "logs", str(cluster_dir)], capture_output=True, text=True).stdout


def _submit_env(slurm_conf: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SLURM_CONF": str(slurm_conf),
        # The tasks inherit this (--export=ALL): the venv's python and h3render first, this checkout importable.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": repo_pythonpath(),
        "OMP_NUM_THREADS": "1",  # two tasks share CI's two cores
    }


def _wait_for(predicate, seconds: float, what: str, slurm_conf: Path) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {seconds} s\n{_logs(slurm_conf.parent)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm_conf():
    """Start munged, slurmctld and slurmd in a temp dir; yield the SLURM_CONF path; stop them afterwards."""
    if os.geteuid() != 0:
        pytest.fail("test_slurm needs root: it installs slurm-wlm + munge and runs a one-node cluster as root")
    install = subprocess.run([str(SLURM_LOCAL), "install"], capture_output=True, text=True, timeout=600)
    if install.returncode:
        pytest.fail(f"installing slurm failed:\n{install.stdout}\n{install.stderr}")
    # Not under pytest's tmp_path: munged wants every parent of its socket searchable by all.
    cluster_dir = Path(tempfile.mkdtemp(prefix="h3render-slurm-"))
    env = {**os.environ, "SLURMCTLD_PORT": str(_free_port()), "SLURMD_PORT": str(_free_port())}
    try:
        start = subprocess.run([str(SLURM_LOCAL), "start", str(cluster_dir)], env=env, capture_output=True,
                               text=True, timeout=180)
        if start.returncode:
            pytest.fail(f"SLURM did not start:\n{start.stdout}\n{start.stderr}\n{_logs(cluster_dir)}")
        yield cluster_dir / "slurm.conf"
    finally:
        subprocess.run([str(SLURM_LOCAL), "stop", str(cluster_dir)], capture_output=True, timeout=120)
        shutil.rmtree(cluster_dir, ignore_errors=True)


def test_array_job_renders_every_job_exactly_once(slurm_conf, tmp_path):
    manifest = tmp_path / "queue.jsonl"
    # The smallest clips the tiny model takes (22 frames, 128 x 128, 3 sigma points): the test is about the queue.
    manifest.write_text("".join(json.dumps({"id": f"clip-{i}", "prompt": f"A paper boat drifts down gutter {i}, "
                                            f"rain drumming on tin.", "seed": i, "frames": 22, "width": 128,
                                            "height": 128, "steps": 3}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    env = _submit_env(slurm_conf)
    cmd = ["sbatch", "--parsable", "--array=0-1", "--export=ALL", f"--chdir={tmp_path}",
           f"--output={tmp_path}/task-%A_%a.out", str(SBATCH_SCRIPT), str(manifest), str(out), *H3RENDER_OPTIONS]
    submit = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    # Not `sbatch --wait`: it polls at 2, 10 and 42 s (its sleep grows x4 while under MinJobAge / 3), so this
    # 12-s array returned after 42 s. squeue lists a job until every task has ended.
    _wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True,
                                         text=True).stdout.strip(), 600, "the array job's end", slurm_conf)
    task_logs = "\n".join(f"===== {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("task-*.out")))
    print(task_logs)
    tasks = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    states = sorted(field for line in tasks.splitlines() for field in line.split()
                    if field.startswith(("JobState=", "ExitCode=")))
    assert states == ["ExitCode=0:0"] * 2 + ["JobState=COMPLETED"] * 2, f"{tasks}\n{task_logs}"
    assert len(list(tmp_path.glob("task-*.out"))) == 2, task_logs

    # Each MP4 exists exactly once, complete (with its sidecar), and nothing temporary is left behind.
    assert sorted(p.name for p in out.rglob("*.mp4")) == [f"clip-{i}.mp4" for i in range(4)]
    assert sorted(p.name for p in out.rglob("*.json") if not p.name.startswith("batch-report")) == \
        [f"clip-{i}.json" for i in range(4)]
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]

    # Each job was rendered by exactly one task: the shard reports split the manifest i % 2.
    rendered: dict[str, list[int]] = {}
    for index in (0, 1):
        report = json.loads((out / f"batch-report.shard-{index}-of-2.json").read_text())
        assert report["shard"] == {"index": index, "count": 2} and report["exit_code"] == 0
        for job in report["jobs"]:
            assert job["status"] == "succeeded", job
            rendered.setdefault(job["id"], []).append(index)
    assert rendered == {"clip-0": [0], "clip-1": [1], "clip-2": [0], "clip-3": [1]}
    assert not (out / "batch-report.json").exists()


def test_scancel_interrupts_the_running_job_cleanly(slurm_conf, tmp_path):
    """scancel sends SIGTERM: the running job's files go, the report says interrupted, the task exits 130."""
    small = {"frames": 22, "width": 128, "height": 128, "steps": 3}
    big = {"frames": 107, "width": 384, "height": 384, "steps": 100}  # minutes on CPU: still running at scancel
    manifest = tmp_path / "queue.jsonl"
    manifest.write_text("".join(json.dumps({"id": name, "prompt": f"Lighthouse beam over a dark sea, take {name}.",
                                            "seed": 7, **size}) + "\n"
                                for name, size in (("c0", small), ("c1", big), ("c2", small))))
    out = tmp_path / "out"
    env = _submit_env(slurm_conf)
    submit = subprocess.run(["sbatch", "--parsable", "--export=ALL", f"--chdir={tmp_path}",
                             f"--output={tmp_path}/cancelled-%j.out", str(SBATCH_SCRIPT), str(manifest), str(out),
                             *H3RENDER_OPTIONS], env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]

    def c0_done() -> bool:
        try:
            return read_report(out / "batch-report.json")["jobs"][0]["status"] == "succeeded"  # journal folded in
        except (OSError, ValueError, KeyError, IndexError):
            return False

    _wait_for(c0_done, 180, "the first job", slurm_conf)
    time.sleep(0.5)  # c1 is under way
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=30)
    _wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True,
                                         text=True).stdout.strip(), 60, "the cancelled job to end", slurm_conf)
    log = next(tmp_path.glob("cancelled-*.out")).read_text()
    print(log)
    show = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    assert "ExitCode=130:0" in show, f"{show}\n{log}"

    report = json.loads((out / "batch-report.json").read_text())
    assert report["state"] == "interrupted" and report["exit_code"] == 130, log
    assert [(job["id"], job["status"]) for job in report["jobs"]] == \
        [("c0", "succeeded"), ("c1", "interrupted"), ("c2", "pending")], log
    assert report["jobs"][1]["error"] == "Interrupted: SIGTERM received"
    # Nothing partial: only c0's files, no temp file.
    assert sorted(p.name for p in out.iterdir()) == ["batch-report.json", "c0.json", "c0.mp4"]


@pytest.mark.parametrize("args, env, expected", [
    (["m.jsonl", "out dir", "--checkpoint", "tiny"], {}, "<batch><m.jsonl><--out-dir><out dir><--checkpoint><tiny>"),
    ([], {"MANIFEST": "q.yaml", "OUT_DIR": "/o"}, "<batch><q.yaml><--out-dir></o>"),
])
def test_sbatch_script_passes_manifest_out_dir_and_options(args, env, expected, tmp_path):
    # Run outside SLURM with H3RENDER=printf: prints each argument a task would exec with, in <>.
    run_env = {k: v for k, v in os.environ.items() if k not in ("MANIFEST", "OUT_DIR")}
    result = subprocess.run(["bash", str(SBATCH_SCRIPT), *args], env={**run_env, **env, "H3RENDER": "printf <%s>"},
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


def test_sbatch_script_without_manifest_exits_2(tmp_path):
    run_env = {k: v for k, v in os.environ.items() if k not in ("MANIFEST", "OUT_DIR")}
    result = subprocess.run(["bash", str(SBATCH_SCRIPT)], env={**run_env, "H3RENDER": "echo"},
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and "give MANIFEST and OUT_DIR" in result.stderr
