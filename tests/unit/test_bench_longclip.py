"""CPU smoke run of scripts/bench.py's longclip stage (scripts/bench_longclip.py): the same functions the device run
calls, at the tiny model's shapes: a 1.8 s clip (43 frames) in windows of 39 and 22 frames on a FastH3-style VSA schedule in fp8. Every row
it prints must be there and hold real numbers (no stage error)."""

from __future__ import annotations

from tests._bench import run_bench


def test_longclip_stage_runs_at_a_tiny_shape(tmp_path):
    argv = ["--stages", "longclip", "--longclip-model", "tiny", "--longclip-device", "cpu", "--longclip-canvas",
            "160x128", "--longclip-duration", "1.8", "--longclip-window", "39", "--longclip-overlap", "5",
            "--vsa-sparsity", "0.75", "--longclip-dir", str(tmp_path)]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "longclip"]
    assert not [r for r in rows if "error" in r], rows
    what = [r.get("what", "") for r in rows if r.get("what") != "fp8: components loaded"]
    assert what[0].startswith("plan: 1.8 s → 43 frames = 1.792 s in 2 windows of 39/22 frames, 5-frame overlaps "
                              "cross-faded, not conditioned on each other (FastH3 students are t2va-only)"), what[0]
    windows = [r for r in rows if r.get("what", "").startswith("window ")]
    assert [r["task"] for r in windows] == ["t2va", "t2va"] and [r["seed"] for r in windows] == [0, 1]
    assert all(r["seconds"] > 0 and r["generate_s"] > 0 for r in windows)
    overhead = next(r for r in rows if r.get("what") == "overlap overhead")
    assert overhead["extra_frames"] == 39 + 22 - 43 and overhead["overlap_s"] > 0
    mp4 = next(r for r in rows if r.get("what", "").startswith("complete MP4"))
    assert mp4["frames_written"] == 43 and mp4["wall_s"] > 0 and "fp8, vsa 0.75" in mp4["what"]
    assert (tmp_path / "longclip.mp4").is_file()
