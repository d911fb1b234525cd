"""The benchmark's `--e2e-content` (scripts/bench_content.py): the moving scene painted over decoded chunks (the
right frames of the scene, in place, in the chunk's shape and dtype), the seam it hooks restored after, and a CPU
smoke run of the e2e stage in which the painted content really reached the encoder (a far smaller MP4 than noise's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests._bench import run_bench, script_module


@pytest.fixture(scope="module")
def bench_content():
    with script_module("bench_content") as module:
        yield module


def test_paint_shows_frame_first_plus_i_of_the_looping_scene(bench_content):
    scenes = bench_content.MovingScenes("cpu", period=5)
    scenes.prepare(16, 24)
    expected = bench_content.synthetic_video(0, 5, 16, 24, "moving", "cpu")  # [3, 5, 16, 24] in [0, 1]
    chunk = torch.full((3, 4, 16, 24), float("nan"))
    painted = scenes.paint_(3, chunk)  # clip frames 3..6 -> scene frames 3, 4, 0, 1
    assert painted is chunk and chunk.dtype == torch.float32
    assert (chunk - expected[:, [3, 4, 0, 1]]).abs().max() <= 0.5 / 255 + 1e-6  # uint8 rounding only
    assert scenes.nbytes == 3 * 5 * 16 * 24
    half = torch.zeros(3, 2, 16, 24, dtype=torch.bfloat16)
    assert scenes.paint_(0, half).dtype == torch.bfloat16 and half.float().max() > 0
    with pytest.raises(KeyError, match="no scene prepared for 32x16"):
        scenes.paint_(0, torch.zeros(3, 1, 16, 32))


def test_content_wraps_the_decode_stream_then_restores_it(bench_content):
    scenes = bench_content.MovingScenes("cpu", period=3)
    scenes.prepare(8, 8)

    class Plan:
        writes = True

        def decode_stream(self, vae, latent, batch_size):
            yield 0, torch.zeros(3, 2, 8, 8)
            yield 2, torch.zeros(3, 1, 8, 8)

    engine = SimpleNamespace(plan=Plan())
    with bench_content.content(engine, "noise", scenes) as record:
        assert all(c.max() == 0 for _, c in engine.plan.decode_stream(None, None, 1))
    assert record == {"content": "noise"}
    with bench_content.content(engine, "moving", scenes) as record:
        chunks = list(engine.plan.decode_stream(None, None, 1))
    assert [first for first, _ in chunks] == [0, 2] and all(c.max() > 0 for _, c in chunks)
    assert record == {"content": "moving", "content_frames": 3, "content_chunks": 2,
                      "content_bank_bytes": 3 * 3 * 8 * 8}
    assert "decode_stream" not in vars(engine.plan)  # the method again
    with pytest.raises(ValueError, match="--e2e-content"):
        bench_content.parse_contents("moving,footage")


def test_e2e_stage_renders_each_content_on_cpu(tmp_path):
    argv = ["--stages", "e2e", "--e2e-model", "tiny", "--e2e-device", "cpu", "--e2e-canvases", "160x128x22",
            "--forwards", "1", "--e2e-content", "noise,moving", "--e2e-dir", str(tmp_path), "--e2e-prof-decode"]
    rows = run_bench(argv, tmp_path / "rows.json")
    assert not [r for r in rows if "error" in r], rows
    [alone] = [r for r in rows if r.get("what", "").startswith("decode alone 160x128x22")]
    assert alone["first_s"] > 0 and alone["second_s"] > 0 and alone["profiled_s"] > 0  # the decode ran thrice
    assert "total_device_ms" in alone["kernels"][0]
    renders = {r["content"]: r for r in rows if r.get("what", "").startswith("complete MP4")}
    assert set(renders) == {"noise", "moving"}
    noise, moving = renders["noise"], renders["moving"]
    assert moving["content_frames"] == 22 and "content_frames" not in noise
    # The scene reached x264: the random weights' noise costs it several times the bits.
    assert moving["mp4_bytes"] * 2 < noise["mp4_bytes"]
    for row in (noise, moving):
        assert row["decode_alone_s"] > 0 and row["writer"]["open_s"] > 0 and row["mbit_s"] > 0
        assert row["media_on_critical_path_s"] == pytest.approx(row["stages"]["vae_video"] - row["decode_alone_s"],
                                                                abs=2e-3)
