"""Multi-process rendering on CPU (gloo): Ulysses DiT + split VAE decode through the CLI must match 1 process."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from h3render.parallel.groups import largest_dividing_world, launcher_env
from h3render.parallel.ulysses import shard_rows
from h3render.parallel.vae import assign_items
from tests._mp4 import frames_of
from tests._spawn import free_port
from tests._cli import Forked, run_forked, run_here
from tests._numerics import rel_err

REPO = Path(__file__).resolve().parents[2]


def render(out: Path, nproc: int, *extra: str, launcher: str = "torchrun"):
    """`h3render prompt` on `nproc` CPU ranks. launcher "spawn": the command's own `--gpus N` (its ranks fork from
    it); "torchrun": `nproc` processes with the environment torchrun gives its ranks (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT), each `h3render prompt` itself; rank 0's result, once every rank exited 0. Each process forks
    from a server that has imported torch and transformers (`tests._cli.Forked`): an interpreter of its own costs
    ~6 s of CPU to import them, which was most of these tests' time on CI's two cores."""
    args = ["prompt", "A fox crosses a frozen river, ice creaking", "-o", str(out), "--steps", "3", "--seed", "7",
            "--save-latents", "--vae-batch", "1", "--device", "cpu", *extra]
    if nproc == 1:  # the 1-process reference renders in this process (no interpreter of its own to start)
        # with one intra-op thread, as each rank runs (OMP_NUM_THREADS=1): more threads sum in another order, and
        # the H.264 encode turns those last-bit differences into frames up to 52 codes apart (seen under plain
        # pytest, whose process keeps every core's thread; xdist workers run one).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run_here(*args)
        finally:
            torch.set_num_threads(threads)
    if launcher == "spawn":
        return run_forked(*args, "--gpus", str(nproc), env={"OMP_NUM_THREADS": "1"})
    port = str(free_port())
    ranks = [Forked(*args, env={"OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
                                "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank in range(nproc)]
    results = [rank.wait() for rank in ranks]
    assert [r.returncode for r in results[1:]] == [0] * (nproc - 1), [r.stderr[-2000:] for r in results[1:]]
    return results[0]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """`one_rank(*extra)`: the 1-process reference render for these extra arguments, made once per module (every
    multi-rank case compares against the same one)."""
    made: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        if extra not in made:
            out = tmp_path_factory.mktemp("one") / "one.mp4"
            r = render(out, 1, *extra)
            assert r.returncode == 0, r.stderr
            made[extra] = out
        return made[extra]

    return get


# 2 and 4 ranks run through the command's own launcher here (with 4, ranks 1 and 2 neither write nor decode the
# audio); torchrun's environment (3 ranks, 2 of them used) is test_split_decode_batches_across_windows below. The
# sharded forward at 4 ranks (2 heads each) and more is tests/cluster/test_ulysses.py's.
@pytest.mark.parametrize("nproc, launcher", [(2, "spawn"), (4, "spawn")])
def test_multi_rank_gloo_matches_one_process(nproc, launcher, one_rank, tmp_path):
    """Same seed on N ranks: latents within 1e-5 of 1 rank, decoded frames identical (with the same VAE batch
    grouping per item; different groupings differ by float rounding, up to 1 code value before encoding)."""
    single, multi = one_rank(), tmp_path / "many.mp4"
    rn = render(multi, nproc, launcher=launcher)
    assert rn.returncode == 0, rn.stderr
    a = torch.load(single.with_name("one.latents.pt"))
    b = torch.load(multi.with_name("many.latents.pt"))
    for key in ("video", "audio"):
        err = rel_err(b[key], a[key])
        print(f"{nproc} ranks: {key} latent rel. err {err:.2e}")
        assert err <= 1e-5
    np.testing.assert_array_equal(frames_of(single), frames_of(multi))
    import json

    side = json.loads(multi.with_suffix(".json").read_text())
    # The tiny model has 8 heads: 2 or 4 ranks take four or two heads each.
    assert side["extra"]["world_size"] == largest_dividing_world(nproc, 8) == nproc
    # Rank 0 writes the sidecar but the last rank decodes the audio: its seconds come with the waveform (the sidecar
    # of a 2-GPU render had no vae_audio stage).
    stages = side["timings"]["stages"]
    one = json.loads(single.with_suffix(".json").read_text())["timings"]["stages"]
    assert set(stages) == set(one) and "vae_audio" in stages
    assert all(stage["seconds"] > 0 for stage in stages.values()), stages
    # ... placed as ending when rank 0 had the waveform, which it waits for before its own video decode
    assert stages["vae_audio"]["intervals"][-1][1] <= stages["vae_video"]["intervals"][0][0], stages


def test_split_decode_batches_across_windows(one_rank, tmp_path):
    """3 ranks started as torchrun starts them: the tiny model's 8 heads do not divide by 3, so the run uses 2 of them,
    with a warning, and the third sits it out (`groups.restrict`; the spawn launcher starts 2 instead, `plan_world`).
    320x192: 2 windows x 6 tiles; with 4 items per decoder forward a rank's batch holds items of both windows
    (3 + 1, then 2), so windows are gathered mid-queue. Batch grouping differs from one
    rank's, which moves float rounding only: frames within 1 code value, latents within float rounding."""
    extra = ("--width", "320", "--height", "192", "--vae-batch", "4")
    single, multi = one_rank(*extra), tmp_path / "many.mp4"
    rn = render(multi, 3, *extra)
    assert rn.returncode == 0, rn.stderr
    a, b = frames_of(single).astype(int), frames_of(multi).astype(int)
    assert a.shape == b.shape == (39, 192, 320, 3)
    assert np.abs(a - b).max() <= 1
    latents = [torch.load(out.with_name(f"{out.stem}.latents.pt")) for out in (single, multi)]
    assert rel_err(latents[1]["video"], latents[0]["video"]) <= 1e-5
    assert "using 2 of 3 ranks" in rn.stderr
    import json

    world = json.loads(multi.with_suffix(".json").read_text())["extra"]["world_size"]
    assert world == largest_dividing_world(3, 8) == 2


def test_shards_cover_rows_with_least_padding():
    for seq_len in (9, 64, 73_642, 73_643):
        for world in (1, 2, 4, 7, 8):
            shards = [shard_rows(seq_len, r, world) for r in range(world)]
            assert shards[0].start == 0 and all(a.end == b.start for a, b in zip(shards, shards[1:]))
            assert shards[-1].end - seq_len < world  # at most world-1 pad rows
            assert len({s.rows for s in shards}) == 1


def test_largest_dividing_world_for_56_heads():
    assert [largest_dividing_world(n, 56) for n in range(1, 9)] == [1, 2, 2, 4, 4, 4, 7, 8]


def test_vae_items_round_robin():
    got = sorted(i for r in range(3) for i in assign_items(28, r, 3))
    assert got == list(range(28))
    assert {len(assign_items(28, r, 3)) for r in range(3)} == {9, 10}


def test_launcher_env_torchrun_and_srun():
    assert launcher_env({}) == (0, 1, 0)
    assert launcher_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == (3, 8, 3)
    assert launcher_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}) == (1, 2, 1)
    assert launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (0, 1, 0)
    with pytest.raises(ValueError, match="outside"):
        launcher_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_failure_on_rank0_mid_stream_fails_job_on_all_ranks_without_hang(tmp_path):
    """NaN pixels from the video VAE make rank 0's writer refuse the job while rank 1 is still decoding: rank 0
    keeps taking part in the window gathers and the audio hand-over, then the job fails on both ranks (no hang,
    no file under either name)."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    r = run_here("make-checkpoint", str(ckpt), "--config", "tiny")
    assert r.returncode == 0, r.stderr
    files = sorted((ckpt / "FL2VA" / "video_vae").glob("*.safetensors"))
    assert files
    poisoned = 0
    for f in files:
        tensors = load_file(str(f))
        for name in tensors:
            if name.startswith("decoder.proj_out"):
                tensors[name] = torch.full_like(tensors[name], float("nan"))
                poisoned += 1
        save_file(tensors, str(f), metadata={"format": "pt"})
    assert poisoned
    out = tmp_path / "nan.mp4"
    r = render(out, 2, "--checkpoint", str(ckpt), launcher="spawn")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "non-finite pixels" in r.stderr
    assert not out.exists() and not out.with_suffix(".json").exists()
    assert not list(tmp_path.glob("*.tmp*"))


def test_batch_on_two_cpu_ranks_renders_then_resumes(tmp_path, monkeypatch):
    """`h3render batch --device cpu --gpus 2`: rank 0 owns the queue, rank 1 follows each job; a second run finds
    every job rendered and skips them all without starting ranks (no weights load for a finished queue)."""
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("\n".join([
        '{"id": "a", "prompt": "Surf at dawn", "frames": 22, "steps": 2}',
        '{"id": "b", "prompt": "A train in the night", "frames": 22, "steps": 3, "seed": 3}',
    ]) + "\n")
    args = ["batch", str(manifest), "--out-dir", str(tmp_path / "out"), "--device", "cpu", "--gpus", "2", "--quiet"]
    r = run_forked(*args, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
    assert [j["status"] for j in report["jobs"]] == ["succeeded"] * 2
    for name in "ab":
        side = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert side["extra"]["world_size"] == 2
        assert frames_of(tmp_path / "out" / f"{name}.mp4").shape[0] == 22

    import h3render.parallel.launch as launch

    def no_ranks(*a, **k):
        raise AssertionError("a queue with every job rendered started ranks")

    monkeypatch.setattr(launch, "spawn", no_ranks)
    r = run_here(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "batch-report.json").read_text())
    assert [j["status"] for j in report["jobs"]] == ["skipped"] * 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_job_on_two_cpu_ranks_exits_130_without_a_hang(tmp_path, signum):
    """Ctrl-C (SIGINT to the process group) on `--gpus 2` mid-job hung until killed: rank 0 broadcast "stop" while
    rank 1 sat in one of the job's collectives; SIGTERM exited 1 with a traceback beside a report saying 130 (rank 1
    died of it, rank 0's stop failed). Rank 0 now leaves without the broadcast, and rank 1 says in one line that it
    stopped."""
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text('{"id": "a", "prompt": "Surf at dawn", "frames": 345, "steps": 50}\n')
    out = tmp_path / "out"
    # A session of its own, as a terminal's foreground job: the signal goes to the process group, ranks included.
    q = Forked("batch", str(manifest), "--out-dir", str(out), "--device", "cpu", "--gpus", "2",
               env={"OMP_NUM_THREADS": "1"}, new_session=True)
    deadline = time.monotonic() + 120
    while not (out / "a.lock").exists():  # the job is claimed: its render (and the ranks' collectives) starts
        assert q.poll() is None and time.monotonic() < deadline, q.wait().stderr[-3000:]
        time.sleep(0.1)
    time.sleep(1.5)
    os.killpg(q.pid, signum)
    try:
        r = q.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{signal.Signals(signum).name} on two ranks mid-job: no exit within 60 s")
    err = r.stderr
    assert r.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    import json

    report = json.loads((out / "batch-report.json").read_text())
    assert report["exit_code"] == 130 and report["signal"] == signal.Signals(signum).name
    assert [j["status"] for j in report["jobs"]] == ["interrupted"]
    assert not (out / "a.mp4").exists()
