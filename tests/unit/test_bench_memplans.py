"""CPU smoke run of scripts/bench.py's memplans stage (scripts/bench_memplans.py, issue #27): one in-process
`bench.main()` through the flags the device call uses, at the tiny model's shapes: the uncapped resident run, a
streamed run whose latents must equal it, and a 2-prompt queue's text phase."""

from __future__ import annotations

import math

from tests._bench import run_bench


def test_memplans_stage_runs_on_cpu(tmp_path):
    argv = ["--stages", "memplans", "--memplan-model", "tiny", "--memplan-device", "cpu", "--memplan-canvas",
            "128x64x22", "--forwards", "1", "--memplans", "resident:bf16,streamed:bf16@1", "--memplan-queue", "2",
            "--vsa-sparsity", "0.5", "--memplan-dir", str(tmp_path), "--e2e-content", "noise,moving"]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "memplans"]
    assert not [r for r in rows if "error" in r], rows
    # each run renders once per content on its engine, each against the uncapped run of its content
    assert [r.get("content") for r in rows[:4]] == ["noise", "moving", "noise", "moving"]
    assert rows[1]["content_frames"] == rows[3]["content_frames"] == 22 and rows[3]["latents_equal_uncapped"]
    resident, streamed, queue = rows[0], rows[2], rows[4]
    assert resident["plan"] == "resident" and streamed["plan"] == "streamed" and streamed["cap_gb"] == 1.0
    assert streamed["latents_equal_uncapped"] is True and math.isfinite(streamed["vs_uncapped"])
    assert streamed["streamer"]["copies"] >= 2 and streamed["text_phase"]["prompts"] == 1
    assert streamed["streamer"]["copy_s_per_forward"] > 0 and streamed["streamer"]["h2d_gb_s"] > 0
    assert streamed["expected_gb"]["denoise"] >= 0 and streamed["memory"]["plan"] == "streamed"
    assert queue["text_phase"]["prompts"] == 2 and queue["text_phase"]["seconds_per_prompt"] > 0
    assert queue["text_phase"]["host_bytes"] > 0


def test_oom_sites_rank_live_blocks_by_their_innermost_frames_of_ours():
    """`--memplan-oom-sites`: the row of a run that ran out of memory lists where the live memory was allocated, so
    the streamed plan's excess over its model (issue #27) can be found from one device call."""
    import sys

    from tests._env import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from bench_memplans import live_sites
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}

    torch_frame = frame("/venv/site-packages/torch/nn/modules/module.py", 1, "_apply")
    stream = [frame("/repo/h3render/block_stream.py", 80, "_fetch"),
              frame("/repo/h3render/block_stream.py", 60, "fetch"), frame("/repo/h3render/engine.py", 9, "render")]
    vae = [torch_frame, frame("/repo/h3render/models/video_vae.py", 5, "decode"),
           frame("/repo/scripts/bench.py", 2, "main")]
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 3_000_000_000, "frames": stream},
                    {"state": "inactive", "size": 9_000_000_000, "frames": stream},  # free: not counted
                    {"state": "active_allocated", "size": 1_000_000_000, "frames": vae}]},
        {"blocks": [{"state": "active_allocated", "size": 2_500_000_000, "frames": vae},
                    {"state": "active_allocated", "size": 7, "frames": [torch_frame]}]},
    ]}
    assert live_sites(snapshot, 2) == [
        {"site": "video_vae.py:5 decode < bench.py:2 main", "gb": 3.5, "blocks": 2},
        {"site": "block_stream.py:80 _fetch < block_stream.py:60 fetch", "gb": 3.0, "blocks": 1}]
    assert live_sites(snapshot, 5)[-1] == {"site": "(no h3render frame)", "gb": 0.0, "blocks": 1}
