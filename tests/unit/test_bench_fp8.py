"""CPU smoke run of scripts/bench.py's FP8 stages (fp8-gemm, fp8-quant, fp8-dit: scripts/bench_fp8.py) and of
fp8-memory and e2e with `--precision bf16,fp8` (scripts/bench_e2e.py): one in-process `bench.main()` through the CLI
flags the device calls use, at the tiny model's shapes, so the functions the GPU runs are the ones that ran here.
Every timed row must be finite, every error below a loose bound and, for an FP8 variant, above zero (the FP8 path
really ran); plus the random-gate fill of an FP8 DiT (bench.py's old `gate_proj.weight.copy_` would write raw values
into an e4m3 buffer), and the compare stage's pairing of the e2e stage's saved runs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3render.models.dit_config import DIT_TINY
from h3render.models.fp8 import Fp8Linear, quantize_dit_fp8_
from tests._diffusers_ref import random_dit
from tests._numerics import rel_err

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CANVAS = "160x128x22"  # 4 video tiles of 4x4x4 with 6 text + 74 audio rows: VSA has tiles to drop at 0.75


@pytest.fixture(scope="module")
def bench_fp8():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_fp8

        yield bench_fp8
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="module")
def bench_out(tmp_path_factory) -> Path:
    """Where the module's bench run writes its rows and the e2e stage its MP4s (`--e2e-dir`)."""
    return tmp_path_factory.mktemp("bench-fp8")


@pytest.fixture(scope="module")
def rows(bench_fp8, bench_out):
    import bench

    out = bench_out
    argv = ["bench.py", "--stages", "fp8-gemm,fp8-quant,fp8-dit,fp8-memory,e2e", "--fp8-model", "tiny",
            "--fp8-device", "cpu", "--fp8-canvas", CANVAS, "--fp8-text", "6", "--fp8-gemm-reps", "1",
            "--fp8-reps", "1", "--vsa-sparsity", "0.75", "--precision", "bf16,fp8", "--e2e-model", "tiny",
            "--e2e-device", "cpu", "--e2e-canvases", CANVAS, "--e2e-vsa", "--forwards", "1", "--e2e-dir", str(out),
            "--e2e-vsa-kernels", "current,bf16-qk", "--out", str(out / "rows.json")]
    saved_argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = argv
    torch.set_num_threads(1)  # the 2 shared cores: tiny ops spin-wait for each other's threads with more
    bench.RESULTS.clear()
    try:
        bench.main()
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)
    return json.loads((out / "rows.json").read_text())


def _stage(rows, stage):
    found = [r for r in rows if r["stage"] == stage and r.get("what") != "stage wall"]
    assert found, f"no rows for {stage}"
    return found


def _finite_time(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_no_stage_failed(rows):
    errors = [r for r in rows if "error" in r]
    assert not errors, errors


def test_fp8_gemm_rows(rows):
    inner = DIT_TINY.num_attention_heads * DIT_TINY.attention_head_dim
    h, ffn = DIT_TINY.hidden_size, DIT_TINY.ffn_dim
    found = _stage(rows, "fp8-gemm")
    for name, k, n in (("qkv", h, 3 * inner), ("out", inner, h), ("fc1", h, 2 * ffn), ("fc2", ffn, h), ("gate", h, inner)):
        mine = [r for r in found if r["what"].startswith(f"{name} GEMM {k}->{n}, S=")]
        assert len(mine) == 5, (name, [r["what"] for r in found])
        assert all(_finite_time(r["ours_s"]) for r in mine)
        bf16 = next(r for r in mine if r["what"].endswith("bf16 F.linear"))
        assert 0 < bf16["rel_err"] <= 1e-2  # bf16 rounding of the output vs the fp32 GEMM (measured 1.7e-3)
        fp8 = [r for r in mine if "Fp8Linear" in r["what"]]
        assert len(fp8) == 3  # Fp8Rows input without and with fast accumulation, bf16 input
        for r in fp8:  # e4m3 on both operands: measured 0.035-0.037 against bf16
            assert 5e-3 <= r["rel_err"] <= 0.08 and 5e-3 <= r["rel_err_vs_fp32"] <= 0.08
            assert _finite_time(r["ref_s"]) and r["tflops"] >= 0


def test_fp8_quant_rows(rows):
    found = {r["what"].split(":")[0].split(" [")[0]: [] for r in _stage(rows, "fp8-quant")}
    for r in _stage(rows, "fp8-quant"):
        found[r["what"].split(":")[0].split(" [")[0]].append(r)
    assert set(found) == {"modulate", "swiglu", "quantize_rows, attention output"}
    for name in ("modulate", "swiglu"):
        bf16, fp8 = (next(r for r in found[name] if r["what"].endswith(tail)) for tail in (": bf16", ": fp8=True"))
        assert _finite_time(bf16["ours_s"]) and _finite_time(fp8["ours_s"]) and bf16["gb_per_s"] > 0
        assert bf16["rel_err"] <= 1e-2
        # e4m3 rounding: at most 2**-4 relative per element, measured 0.023-0.025 rms
        assert 5e-3 <= fp8["rel_err"] <= 0.0625 and fp8["within_bound"]
    (q,) = found["quantize_rows, attention output"]
    assert f", {DIT_TINY.num_attention_heads * DIT_TINY.attention_head_dim}]" in q["what"]
    assert q["bit_exact"] and 5e-3 <= q["rel_err"] <= 0.0625 and _finite_time(q["ours_s"])


def test_fp8_dit_rows(rows):
    found = _stage(rows, "fp8-dit")
    by = {r["what"]: r for r in found}
    forwards = [r for r in found if r["what"].startswith("DiT forward")]
    chains = [r for r in found if r["what"].startswith("4-forward FastH3 chain")]
    assert len(forwards) == 5 and len(chains) == 3  # fp8 VSA forward and chain again without fast accumulation
    assert all(_finite_time(r["ours_s"]) for r in forwards + chains)
    for r in forwards + chains:
        if r["precision"].startswith("fp8"):  # measured 4.4e-4 (dense), 1e-3 (VSA), 2.8e-4 (chain); 0 if FP8 never ran
            assert 1e-5 < r["rel_err_video"] <= 0.05 and 1e-5 < r["rel_err_audio"] <= 0.05, r
    assert chains[0]["forwards"] == 4
    mem = by["DiT resident weights bf16 vs fp8 (AdaLN dropped)"]
    assert mem["fp8_linears"] == 5 * DIT_TINY.num_layers  # qkv, gate, out, fc1, fc2 per block
    assert 0 < mem["bytes"]["fp8"] < mem["bytes"]["bf16"]
    assert mem["bytes"]["fp8_with_gates"] > mem["bytes"]["fp8"]


def test_fp8_memory_and_e2e_rows(rows):
    for stage in ("fp8-memory", "e2e"):
        loaded = {r["precision"]: r for r in _stage(rows, stage) if r["what"].endswith("components loaded")}
        assert set(loaded) == {"bf16", "fp8"}
        b16, b8 = loaded["bf16"]["components_bytes"], loaded["fp8"]["components_bytes"]
        assert b8["dit"] < b16["dit"] and b8["text_encoder"] < b16["text_encoder"]
        # the video VAE's decoder block linears are FP8 too (models.fp8.quantize_video_decoder_fp8_), the audio VAE not
        assert b8["video_vae"] < b16["video_vae"] and b8["audio_vae"] == b16["audio_vae"]
        assert "fp8_e4m3 decoder blocks" in loaded["fp8"]["report"]["video_vae"]
        assert "fp8_e4m3" in loaded["fp8"]["report"]["dit_blocks"]
    renders = [r for r in _stage(rows, "e2e") if r["what"].startswith("complete MP4")]
    assert {(r["precision"], r["attention"], r["vsa_kernels"]) for r in renders} == {
        (p, a, v) for p in ("bf16", "fp8") for a, v in (("dense", "current"), ("vsa", "current"), ("vsa", "bf16-qk"))}
    assert all(_finite_time(r["wall_s"]) and r["mp4_bytes"] > 0 and len(r["denoise_steps"]) == 1 for r in renders)


def test_random_gates_on_an_fp8_dit_match_the_bf16_ones(bench_fp8):
    """The same seed gives the bf16 DiT's gates and, quantized, the FP8 DiT's; a raw copy into the e4m3 buffer
    (what bench.py did) leaves the dequantized gate at ~0 (rel. err 1)."""
    bf16 = random_dit(DIT_TINY, seed=1).apply_precision_(torch.bfloat16)
    bench_fp8.enable_random_vsa_(bf16, 0.75, seed=1)
    fp8 = random_dit(DIT_TINY, seed=1).apply_precision_(torch.bfloat16)
    quantize_dit_fp8_(fp8)  # dense FP8 DiT: DiT.enable_vsa refuses it, the bench helper adds FP8 gates
    bench_fp8.enable_random_vsa_(fp8, 0.75, seed=1)
    assert fp8.vsa_sparsity == bf16.vsa_sparsity == 0.75
    quantized = random_dit(DIT_TINY, seed=1).apply_precision_(torch.bfloat16)
    bench_fp8.enable_random_vsa_(quantized, 0.75, seed=1)
    quantize_dit_fp8_(quantized)  # a student's way: gates first, then the quantization
    for a, b, c in zip(bf16.blocks, fp8.blocks, quantized.blocks):
        assert isinstance(b.attn.gate_proj, Fp8Linear)
        # the bench's added gates accumulate as a quantized student's do (a render's gates ran exact before 26.2)
        assert b.attn.gate_proj.fast_accum is c.attn.gate_proj.fast_accum is True
        ref = a.attn.gate_proj.weight.detach().float()
        assert ref.abs().sum() > 0
        assert rel_err(b.attn.gate_proj.dequantized_weight(), ref) <= 0.04  # e4m3 rounding, measured ~0.02


def test_the_bf16_qk_variant_is_patched_in_and_restored(bench_fp8):
    """`--e2e-vsa-kernels bf16-qk` turns the fp8 engine's int8 QK^T off inside the block only."""
    import bench_e2e

    from h3render.kernels.vsa import triton_impl
    from h3render.models.video_vae import FeedForward

    dit = random_dit(DIT_TINY, seed=1)
    engine = SimpleNamespace(c=SimpleNamespace(dit=dit))
    dit.vsa_qk_int8 = True
    with bench_e2e.vsa_kernels("bf16-qk", engine):
        assert dit.vsa_qk_int8 is False and FeedForward.fused_fp8 is True
    assert dit.vsa_qk_int8 is True
    with bench_e2e.vsa_kernels("session12", engine):  # the VAE's FP8 FFN without the fused SwiGLU; int8 QK^T kept
        assert dit.vsa_qk_int8 is True and FeedForward.fused_fp8 is False
    assert FeedForward.fused_fp8 is True
    with bench_e2e.vsa_kernels("current", engine):
        assert dit.vsa_qk_int8 is True and FeedForward.fused_fp8 is True and triton_impl.LONG_FIRST is True
    with bench_e2e.vsa_kernels("head-order", engine):  # the fine kernels' programs head by head
        assert triton_impl.LONG_FIRST is False and dit.vsa_qk_int8 is True
    assert triton_impl.LONG_FIRST is True
    quantize_dit_fp8_(dit)
    fast = [m.fast_accum for m in dit.modules() if isinstance(m, Fp8Linear)]
    with bench_e2e.vsa_kernels("exact-accum", engine):  # every FP8 GEMM of the DiT promoting to fp32
        assert not any(m.fast_accum for m in dit.modules() if isinstance(m, Fp8Linear))
    assert [m.fast_accum for m in dit.modules() if isinstance(m, Fp8Linear)] == fast and any(fast)
    vae = torch.nn.Sequential(Fp8Linear.from_linear(torch.nn.Linear(32, 16)))  # a decoder's FP8 linear stands in
    vae[0].fast_accum = True  # as `quantize_video_decoder_fp8_` sets it
    engine.c.video_vae = vae
    with bench_e2e.vsa_kernels("vae-exact", engine):  # the decoder's FP8 GEMMs promoting to fp32; the DiT's as shipped
        assert vae[0].fast_accum is False
        assert [m.fast_accum for m in dit.modules() if isinstance(m, Fp8Linear)] == fast
    assert vae[0].fast_accum is True
    bench_fp8.enable_random_vsa_(dit, 0.75, seed=1)  # FP8 gates, fast-accumulating as a student's
    with bench_e2e.vsa_kernels("gate-exact", engine):  # the gates' FP8 GEMMs promoting to fp32; the rest as shipped
        assert not any(b.attn.gate_proj.fast_accum for b in dit.blocks) and vae[0].fast_accum is True
        assert all(b.attn.qkv_proj.fast_accum for b in dit.blocks)
    assert all(b.attn.gate_proj.fast_accum for b in dit.blocks)
    from h3render.kernels import vsa
    from h3render.kernels.vsa import select_triton
    from h3render.models.video_vae import ViTAttention, ViTBlock

    shipped = select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8
    assert shipped == ("interpolate", True, None, True)
    with bench_e2e.vsa_kernels("session16", engine):  # the seventeenth session's work off, the rest as shipped
        assert (select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8) == (
            "radix", False, False, False)
        assert dit.vsa_qk_int8 is True and FeedForward.fused_fp8 is True and vae[0].fast_accum is True
    assert (select_triton.SEARCH, vsa.COARSE_TF32, ViTAttention.use_triton, ViTBlock.fused_norm_fp8) == shipped
    from h3render.kernels.modulate import triton_impl as modulate_impl

    from h3render.models.dit import Attention

    shipped18 = (2, 4), True, True
    assert (modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep) == shipped18
    with bench_e2e.vsa_kernels("session18", engine):  # the nineteenth session's work off: one-row modulate, v gathered,
        # the tile means pooled apart
        assert (modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep) == (None, False, False)
        assert dit.vsa_qk_int8 is True and vae[0].fast_accum is True
    assert (modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep) == shipped18
    with bench_e2e.vsa_kernels("unfused-prep", engine):  # the tile means pooled apart, the rest as shipped
        assert (modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep) == ((2, 4), True, False)
        assert dit.vsa_qk_int8 is True and vae[0].fast_accum is True and triton_impl.LONG_FIRST is True
    assert (modulate_impl.LAUNCH, Attention.vsa_v_tiles, Attention.vsa_fused_prep) == shipped18
    from h3render.graphs import ShapeGraphs

    engine.text_graphs = ShapeGraphs(lambda x: x, name="text encoder")
    with bench_e2e.vsa_kernels("eager-text", engine):  # the prompt encode eager, the rest as shipped
        assert engine.text_graphs.enabled is False and dit.vsa_qk_int8 is True
    assert engine.text_graphs.enabled is True
    with bench_e2e.vsa_kernels("current", engine):
        assert engine.text_graphs.enabled is True
    with pytest.raises(ValueError, match="expected some of current, bf16-qk, session12"):
        bench_e2e.vsa_variants(type("A", (), {"e2e_vsa_kernels": "session10"})())


def test_compare_pairs_each_precisions_one_gpu_run_with_its_multi_gpu_runs(rows, bench_out, tmp_path):
    """`--stages compare` in `--e2e-dir`: each stem's (precision and canvas) -w1 files against its -w<N> ones. It read
    bf16's e2e-w* only, in /tmp only, and a stem held the last canvas alone. The e2e stage's MP4s stand in for every
    run (frames equal); the latents differ by a known factor per (stem, world)."""
    import shutil

    from tests._bench import run_bench

    # the e2e stage's own files carry their canvas (the run above renders one)
    assert {p.name for p in bench_out.glob("e2e*-w1.mp4")} == {f"e2e-{CANVAS}-w1.mp4", f"e2e-fp8-{CANVAS}-w1.mp4"}
    g = torch.Generator().manual_seed(0)
    base = {"video": torch.randn(24, 3, 4, 5, generator=g), "audio": torch.randn(2, 32, 7, generator=g)}
    canvases = (CANVAS, "64x32x5")  # the second stands for another canvas of the same e2e run
    runs = {("e2e", CANVAS, 4): 0.002, ("e2e-fp8", CANVAS, 2): 0.01, ("e2e-fp8", canvases[1], 2): 0.03}
    for (stem, canvas, world), err in [((s, c, 1), 0.0) for s, c in {(s, c) for s, c, _ in runs}] + list(runs.items()):
        shutil.copy(bench_out / f"{stem}-{CANVAS}-w1.mp4", tmp_path / f"{stem}-{canvas}-w{world}.mp4")
        torch.save({k: v * (1 + err) for k, v in base.items()}, tmp_path / f"{stem}-{canvas}-w{world}.latents.pt")
    found = {r["what"]: r for r in run_bench(["--stages", "compare", "--e2e-dir", str(tmp_path)], tmp_path / "c.json")
             if r["stage"] == "compare" and r["what"] != "stage wall"}
    for (stem, canvas, world), err in runs.items():
        pair = f"{stem}-{canvas}-w1.latents.pt vs {stem}-{canvas}-w{world}.latents.pt"
        for key in ("video", "audio"):
            assert found[f"{pair}: {key} latents"]["rel_err"] == pytest.approx(err, rel=1e-4)
        assert found[f"{pair}: decoded frames (8-bit RGB)"]["max_abs"] == 0
    assert len(found) == 9
