"""CPU smoke run of scripts/bench.py's `prepare` stage (scripts/bench_prepare.py), in process through the flags the
device call uses, on the tiny model: the load row, where the AdaLN projections are, a first prepare that builds and
writes the tables and a second that reads them back bit for bit, so the GPU runs the code that ran here."""

from __future__ import annotations

import os

from tests._bench import run_bench


def test_bench_prepare_stage_runs_a_first_and_a_second_prepare_on_cpu(tmp_path):
    before = os.environ.get("H3RENDER_ADALN_CACHE")
    argv = ["--stages", "prepare", "--precision", "bf16", "--e2e-model", "tiny", "--e2e-device", "cpu",
            "--e2e-canvases", "160x128x22", "--prepare-steps", "3", "--tables-dir", str(tmp_path)]
    rows = [r for r in run_bench(argv, tmp_path / "rows.json") if r.get("stage") == "prepare"]
    assert not [r for r in rows if "error" in r], rows
    by_what = {r["what"]: r for r in rows}
    assert by_what["bf16: components loaded"]["seconds"] > 0
    assert by_what["bf16: where the AdaLN projections are after the load"]["adaln_on"] == ["cpu"]
    first = by_what["bf16: Engine.prepare, first run (160x128x22, K=3)"]
    second = by_what["bf16: Engine.prepare, second run (160x128x22, K=3)"]
    assert first["cache"] == ["built"] and second["cache"] == ["hit"] and second["bit_equal"] is True
    assert first["seconds"] > 0 and second["seconds"] > 0 and second["adaln_tables_s"] >= 0
    assert os.environ.get("H3RENDER_ADALN_CACHE") == before  # the stage's folder was the stage's alone
