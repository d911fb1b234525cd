"""CPU smoke run of scripts/bench.py's vae-fp8 stage (scripts/bench_vae_fp8.py): one in-process `bench.main()` with
the flags of the device call at the tiny model's shapes, so the function the H200 runs is the one that ran here.
The rows must name both precisions, report finite times, the FP8 linears, and an error that is non-zero (the FP8
path really ran) and bounded."""

from __future__ import annotations

import math

from tests._bench import run_bench


def test_vae_fp8_stage_runs_on_cpu_at_a_tiny_shape(tmp_path, capsys):
    argv = ["--stages", "vae-fp8", "--vae-fp8-model", "tiny", "--vae-fp8-device", "cpu", "--vae-fp8-latents",
            "7x4x4", "--vae-fp8-reps", "1", "--vae-fp8-modes", "eager,compiled", "--vae-fp8-gains", "0.02,0.3",
            "--vae-fp8-batch", "2"]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "vae-fp8"]
    assert not [r for r in rows if "error" in r], rows
    setup = next(r for r in rows if r.get("what") == "video VAE fp8 setup")
    assert setup["fp8_linears"] == 8 and setup["modes"] == ["eager"]  # compiled is CUDA-only: dropped on the CPU
    assert setup["precision_components"]["fp8"].startswith("fp8_e4m3 decoder blocks")
    assert setup["precision_components"]["bf16"].startswith("bf16")
    timed = [r for r in rows if "ms_per_frame" in r]
    assert [r["what"].split("(")[1].split(",")[0] for r in timed] == ["bf16", "fp8-exact-accum", "fp8"]
    assert all(math.isfinite(r["ours_s"]) and r["ours_s"] > 0 and r["frames"] == 22 for r in timed)
    errors = [r for r in rows if "psnr_db" in r]
    # fp32 promotion vs fast accumulation is a cuBLASLt setting: on the CPU the same product, so the same frames
    assert [(r["what"].split(" vs ")[0].rsplit(" ", 1)[1], r["what"].rsplit("gains ", 1)[1]) for r in errors] == [
        ("fp8-exact-accum", "0.02)"), ("fp8", "0.02)"), ("fp8-exact-accum", "0.3)"), ("fp8", "0.3)")]
    assert errors[0]["psnr_db"] == errors[1]["psnr_db"] and errors[2]["psnr_db"] == errors[3]["psnr_db"]
    for r in errors:
        # FP8 really ran (codes differ) and stays close; the stronger gains give the larger error
        assert 0 < r["max_abs"] <= 64 and 0 < r["codes_differing"] < 1 and 20 < r["psnr_db"] < 80, r
    assert errors[2]["psnr_db"] < errors[0]["psnr_db"]
    assert "| video VAE decode 7 latents 64x64 fp8 vs bf16 (eager, gains 0.02) |" in capsys.readouterr().out
