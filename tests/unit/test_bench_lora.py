"""CPU smoke run of scripts/bench.py's `lora` stage (scripts/bench_lora.py), in process through the flags the
device call uses, at the tiny model's shapes: every row the H200 run records comes out, with finite positive
times, the side-path rows for each count and the fp8 rows, so the GPU runs the code that ran here."""

from __future__ import annotations

import math

from tests._bench import run_bench


def test_bench_lora_stage_runs_on_cpu(tmp_path):
    argv = ["--stages", "lora", "--lora-model", "tiny", "--lora-device", "cpu", "--lora-canvas", "128x64x22",
            "--lora-text", "6", "--lora-ranks", "4", "--lora-counts", "1,2", "--lora-reps", "1",
            "--lora-queue-forwards", "1", "--lora-vsa", "0.75", "--lora-dir", str(tmp_path / "new")]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "lora"]
    assert not [r for r in rows if "error" in r], rows
    whats = {r["what"] for r in rows}
    assert {r["attention"] for r in rows if "forward" in r["what"]} == {"vsa 0.75"}  # as the device call runs it
    for precision in ("bf16", "fp8"):
        assert {f"forward base {precision}", f"forward side 1 x rank 4 {precision}",
                f"forward side 2 x rank 4 {precision}", f"queue 4 jobs x 1 forwards {precision}"} <= whats
    assert {"fuse / unfuse 1 x rank 4", "fuse / unfuse 2 x rank 4"} <= whats
    for r in rows:
        for key in ("seconds", "fuse_s", "unfuse_s", "no_lora_s", "alternating_s"):
            if key in r and r["what"] != "stage wall":
                assert math.isfinite(r[key]) and r[key] > 0, r
    assert all(math.isfinite(r["overhead"]) for r in rows if "overhead" in r)
