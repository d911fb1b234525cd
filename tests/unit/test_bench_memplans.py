"""CPU smoke run of scripts/bench.py's memplans stage (scripts/bench_memplans.py, issue #27): one in-process
`bench.main()` through the flags the device call uses, at the tiny model's shapes: the uncapped resident run, a
streamed run whose latents must equal it, and a 2-prompt queue's text phase."""

from __future__ import annotations

import math

from tests._bench import run_bench


def test_memplans_stage_runs_on_cpu(tmp_path):
    argv = ["--stages", "memplans", "--memplan-model", "tiny", "--memplan-device", "cpu", "--memplan-canvas",
            "128x64x22", "--forwards", "1", "--memplans", "resident:bf16,streamed:bf16@1", "--memplan-queue", "2",
            "--vsa-sparsity", "0.5", "--memplan-dir", str(tmp_path)]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "memplans"]
    assert not [r for r in rows if "error" in r], rows
    resident, streamed, queue = rows[0], rows[1], rows[2]
    assert resident["plan"] == "resident" and streamed["plan"] == "streamed" and streamed["cap_gb"] == 1.0
    assert streamed["latents_equal_uncapped"] is True and math.isfinite(streamed["vs_uncapped"])
    assert streamed["streamer"]["copies"] >= 2 and streamed["text_phase"]["prompts"] == 1
    assert streamed["streamer"]["copy_s_per_forward"] > 0 and streamed["streamer"]["h2d_gb_s"] > 0
    assert streamed["expected_gb"]["denoise"] >= 0 and streamed["memory"]["plan"] == "streamed"
    assert queue["text_phase"]["prompts"] == 2 and queue["text_phase"]["seconds_per_prompt"] > 0
    assert queue["text_phase"]["host_bytes"] > 0
