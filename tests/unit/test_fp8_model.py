"""FP8 linears (`h3render.models.fp8`, issue #18) on CPU: the GEMM against exact and float references, which linears
are replaced, the tiny DiT and text encoder against their unquantized selves, the bf16 path unchanged, loading with
`precision="fp8"`, and Ulysses over FP8 blocks.

Bounds are about twice the values measured on CPU (torch 2.13, the seeds below); each measured value is in a comment.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from h3render.checkpoint.load import load_components
from h3render.checkpoint.load import build_random
from h3render.kernels.fp8 import Fp8Rows, quantize_rows
from h3render.models import fp8
from h3render.models.dit_config import DIT_TINY
from h3render.models.fp8 import (Fp8Linear, Fp8WeightLinear, precision_report, quantize_dit_fp8_,
                                 quantize_text_encoder_fp8_, quantize_weight)
from tests._diffusers_ref import random_dit
from tests._numerics import rel_err
from tests._spawn import cpu_rank, put_result, run_ranks
from tests.unit.test_vsa_dit import _forward, _vsa_dit
from tests._markers import compiled_cuda

WORLD = 2


def _linear(k: int, n: int, seed: int, bias: bool = False) -> tuple[nn.Linear, torch.Tensor]:
    """A linear whose output channels have gains spread over 0.1..10 (so a scale applied to the wrong axis shows)
    and gaussian inputs [64, k] with row gains spread the same way."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        gains = torch.logspace(-1, 1, n)[torch.randperm(n, generator=g)]
        lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5 * gains[:, None])
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(64, k, generator=g) * torch.logspace(-1, 1, 64)[:, None]
    return lin, x


@pytest.mark.parametrize("k, n", [(64, 48), (512, 384)])
def test_fp8_linear_against_float_and_exact_references(k, n):
    lin, x = _linear(k, n, seed=k)
    f = Fp8Linear.from_linear(lin)
    assert f.weight.dtype == torch.float8_e4m3fn and f.weight.shape == (n, k) and f.weight_scale.shape == (1, n)
    y = f(x)
    assert y.shape == (64, n) and y.dtype == torch.float32  # the linear's own dtype
    # e4m3 on both operands (3 mantissa bits): measured 0.0359 (64x48) and 0.0361 (512x384).
    assert rel_err(y, F.linear(x, lin.weight.detach())) <= 0.075
    # Against dequantize(x) @ dequantize(w).T the only error left is the bf16 output rounding: measured 1.7e-3 and
    # 1.6e-3. A misapplied weight scale (gains 0.1..10 per channel) is off by O(1): 1.23 with the scales reversed.
    rows = quantize_rows(x)
    exact = rows.dequantize() @ f.dequantized_weight().t()
    assert rel_err(y, exact) <= 4e-3
    # The weight's own quantization: data * scale reproduces each channel to e4m3 precision (measured 0.024, 0.026).
    assert rel_err(f.dequantized_weight(), lin.weight.detach()) <= 0.05
    # Fp8Rows input (a fused producer's) gives the same GEMM as the float input.
    assert torch.equal(f(rows), y)


def test_fp8_linear_bias_leading_dims_and_bf16_output():
    lin, x = _linear(64, 32, seed=5, bias=True)
    lin = lin.to(torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    y = f(x.bfloat16().view(4, 16, 64))
    assert y.shape == (4, 16, 32) and y.dtype == torch.bfloat16
    ref = F.linear(x.bfloat16().float(), lin.weight.detach().float(), lin.bias.detach().float()).view(4, 16, 32)
    assert rel_err(y, ref) <= 0.075  # measured 0.036


def test_fp8_linear_adds_its_bias_before_the_one_bf16_rounding():
    """As cuBLASLt's bias epilogue (on CUDA the bias rides in `_scaled_mm`): bf16(product + bias), not
    bf16(bf16(product) + bias), which rounds twice and differs in about a quarter of the elements here."""
    lin, x = _linear(64, 32, seed=9, bias=True)
    lin = lin.to(torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    x = x.bfloat16()
    product = quantize_rows(x).dequantize() @ f.dequantized_weight().t()  # fp32 [16, 32]
    y = f(x)
    assert torch.equal(y, (product + lin.bias.float()).bfloat16())
    twice = product.bfloat16() + lin.bias
    assert (y != twice).float().mean() > 0.1


def test_fp8_linear_needs_multiples_of_16():
    with pytest.raises(ValueError, match="in_features .* 40 is not a multiple of 16"):
        Fp8Linear.from_linear(nn.Linear(40, 32))
    with pytest.raises(ValueError, match="out_features .* 24 is not a multiple of 16"):
        Fp8Linear.from_linear(nn.Linear(32, 24))


def test_module_to_moves_but_keeps_fp8_dtypes():
    f = Fp8Linear.from_linear(_linear(64, 48, seed=1)[0])
    data, scale = f.weight.clone(), f.weight_scale.clone()
    f.to(torch.bfloat16).float()
    assert f.weight.dtype == torch.float8_e4m3fn and f.weight_scale.dtype == torch.float32
    assert torch.equal(f.weight.view(torch.uint8), data.view(torch.uint8)) and torch.equal(f.weight_scale, scale)


def test_quantize_weight_zero_channel_stays_zero():
    w = torch.randn(32, 16)
    w[3] = 0
    data, scale = quantize_weight(w)
    deq = data.float() * scale.t()
    assert torch.isfinite(deq).all() and torch.equal(deq[3], torch.zeros(16))


@pytest.mark.parametrize("vsa", [False, True])
def test_quantize_dit_replaces_exactly_the_block_linears(vsa):
    dit = random_dit(DIT_TINY, seed=1)
    if vsa:
        dit.enable_vsa(0.75)
    before = {name: type(m) for name, m in dit.named_modules()}
    count = quantize_dit_fp8_(dit)
    per_block = 5 if vsa else 4
    assert count == per_block * DIT_TINY.num_layers
    changed = {name for name, m in dit.named_modules() if type(m) is not before.get(name)}
    leaves = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2") + (("attn.gate_proj",) if vsa else ())
    assert changed == {f"blocks.{i}.{leaf}" for i in range(DIT_TINY.num_layers) for leaf in leaves}
    assert all(isinstance(dit.get_submodule(name), Fp8Linear) for name in changed)
    # cuBLASLt's fast accumulation on the GEMMs it speeds up at the released shapes (qkv, out, fc1 and the VSA gate),
    # not fc2 (docs/performance.md §25.6, §26.2)
    fast = {name for name in changed if dit.get_submodule(name).fast_accum}
    assert fast == {f"blocks.{i}.{leaf}" for i in range(DIT_TINY.num_layers)
                    for leaf in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1") + (("attn.gate_proj",) if vsa else ())}
    if torch.cuda.is_available():  # the sidecar names the paths that run it: the gate only on a VSA DiT
        dit.cuda()
        paths = ("attn.qkv_proj, attn.gate_proj, attn.out_proj, mlp.fc1" if vsa
                 else "attn.qkv_proj, attn.out_proj, mlp.fc1")
        assert precision_report(type("C", (), {"dit": dit})())["dit_blocks"].endswith(
            f"; fast accumulation in {len(fast)} of them ({paths})")
        dit.cpu()
    assert quantize_dit_fp8_(dit) == 0  # idempotent
    dense = random_dit(DIT_TINY, seed=1)
    quantize_dit_fp8_(dense)
    with pytest.raises(ValueError, match="enable VSA first"):
        dense.enable_vsa(0.75)  # its gates would be bf16 linears reading FP8 rows


@pytest.mark.parametrize("vsa", [False, True])
def test_tiny_dit_fp8_against_bf16_and_bf16_unchanged(vsa):
    # Reference forward of the bf16 model before any FP8 module exists for it.
    dit = (_vsa_dit(0.75, gate_seed=2) if vsa else random_dit(DIT_TINY, seed=1)).apply_precision_(torch.bfloat16)
    ref_v, ref_a = _forward(dit)
    quantized = copy.deepcopy(dit)
    quantize_dit_fp8_(quantized)
    v, a = _forward(quantized)
    # One forward with FP8 block linears: measured dense 0.0186 (video) / 0.0162 (audio), VSA 0.0224 / 0.0168.
    assert rel_err(v, ref_v) <= 0.045 and rel_err(a, ref_a) <= 0.035
    # The bf16 model is untouched by the quantized copy, and its forward is byte-identical.
    again_v, again_a = _forward(dit)
    assert torch.equal(again_v, ref_v) and torch.equal(again_a, ref_a)


def test_fp8_block_feeds_qkv_and_gate_the_same_rows():
    dit = _vsa_dit(0.75, gate_seed=2)
    quantize_dit_fp8_(dit)
    seen = {}
    attn, mlp = dit.blocks[1].attn, dit.blocks[1].mlp
    for name, module in (("qkv", attn.qkv_proj), ("gate", attn.gate_proj), ("out", attn.out_proj),
                         ("fc1", mlp.fc1), ("fc2", mlp.fc2)):
        module.register_forward_hook(lambda m, i, o, name=name: seen.update({name: i[0]}))
    _forward(dit)
    assert seen["gate"] is seen["qkv"] and isinstance(seen["qkv"], Fp8Rows)  # modulate wrote them once
    assert isinstance(seen["fc1"], Fp8Rows) and isinstance(seen["fc2"], Fp8Rows)  # modulate / swiglu fp8=True
    assert not isinstance(seen["out"], Fp8Rows)  # the attention output: out_proj quantizes it itself


def _text_encoder_inputs():
    return torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(0))


def test_text_encoder_weight_only_fp8_against_bf16(monkeypatch):
    te = build_random("tiny", parts=("text_encoder",)).text_encoder
    ids = _text_encoder_inputs()
    with torch.no_grad():
        ref = te(ids)  # the read layer's un-normed state (hidden_states[read_layer])
        quantized = copy.deepcopy(te)
        assert quantize_text_encoder_fp8_(quantized) == 7 * te.read_layer
        assert quantize_text_encoder_fp8_(quantized) == 0
        out = quantized(ids)
        # The scaled-GEMM alternative (activations quantized per row too), for the accuracy argument.
        w8a8 = copy.deepcopy(te)
        for layer in w8a8.layers:
            for path in fp8.TEXT_ENCODER_LINEARS:
                fp8._replace(layer, path, Fp8Linear.from_linear)
        out_w8a8 = w8a8(ids)
        # Mode "rows" of the same quantized encoder: the w8a8 product inside Fp8WeightLinear (monkeypatch restores).
        monkeypatch.setattr(Fp8WeightLinear, "mode", "rows")
        out_rows = quantized(ids)
    assert isinstance(quantized.layers[0].mlp.down_proj, Fp8WeightLinear)
    assert quantized.embed_tokens.weight.dtype == te.embed_tokens.weight.dtype  # embeddings stay
    # Measured 0.0822 (torch 2.13 CPU; 0.0875 when first written). The tiny random stack amplifies weight error about
    # 3.5x: 2.5% gaussian noise on every linear's weights (the e4m3 rounding measures 0.024-0.025 per linear) gives
    # 0.085 at its output.
    err = rel_err(out, ref)
    assert err <= 0.18
    # Weight-only is the more accurate choice (measured 0.0822 vs 0.1274 with row-quantized activations).
    err_w8a8 = rel_err(out_w8a8, ref)
    assert err < err_w8a8
    # Mode "rows" is that w8a8 product, bit for bit (the tiny widths 48 / 64 / 32 / 96 are multiples of 16, so no
    # linear falls back), and so costs the same accuracy: measured 0.1274.
    assert torch.equal(out_rows, out_w8a8)
    assert err < err_w8a8 <= 0.14


def test_load_components_fp8_builtin_tiny():
    c = load_components("tiny", precision="fp8")
    plain = load_components("tiny")
    n_dit = sum(isinstance(m, Fp8Linear) for m in c.dit.modules())
    n_te = sum(isinstance(m, Fp8WeightLinear) for m in c.text_encoder.modules())
    assert n_dit == 4 * DIT_TINY.num_layers and n_te == 7 * c.text_encoder.read_layer
    # the DiT quantized while streaming (`empty_dit_fp8_`) gets the same fast-accumulation GEMMs; all the video VAE
    # decoder's FP8 linears fast-accumulate (their PSNR on decoded frames measured the same, docs/performance.md §26.1)
    assert sum(m.fast_accum for m in c.dit.modules() if isinstance(m, Fp8Linear)) == 3 * DIT_TINY.num_layers
    vae = copy.deepcopy(c.video_vae)
    n = fp8.quantize_video_decoder_fp8_(vae)  # as the Engine quantizes it
    assert n > 0 and [m.fast_accum for m in vae.modules() if isinstance(m, Fp8Linear)] == [True] * n
    assert not any(isinstance(m, (Fp8Linear, Fp8WeightLinear)) for m in plain.dit.modules())
    # The text encoder's weights, quantized while streaming, equal quantizing the loaded encoder afterwards.
    after = copy.deepcopy(plain.text_encoder)
    quantize_text_encoder_fp8_(after)
    streamed, loaded = c.text_encoder.state_dict(), after.state_dict()
    assert streamed.keys() == loaded.keys()
    assert all(torch.equal(streamed[k].float(), loaded[k].float()) for k in streamed)
    text = c.text_encoder.encode("a red fox runs")
    assert torch.isfinite(text).all()
    v, a = _forward(c.dit)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    report = precision_report(c)
    assert report["dit_blocks"].startswith("fp8_e4m3") and report["text_encoder"].startswith("fp8_e4m3 weights")
    assert "fast accumulation" not in report["dit_blocks"]  # cuBLASLt's: the CPU computes the product in fp32
    if torch.cuda.is_available():
        c.dit.cuda()
        assert f"; fast accumulation in {3 * DIT_TINY.num_layers} of them (attn.qkv_proj, attn.out_proj, mlp.fc1)" \
            in precision_report(c)["dit_blocks"]
        c.dit.cpu()
    assert report["audio_vae"] == "fp32" and precision_report(plain)["dit_blocks"] == "fp32"
    with pytest.raises(ValueError, match="precision must be one of bf16, fp8"):
        load_components("tiny", precision="int8")


def test_precision_report_names_int8_qk_only_on_a_vsa_dit():
    dit = random_dit(DIT_TINY, seed=1)
    c = type("C", (), {"dit": dit})()
    dit.vsa_qk_int8 = True
    assert "int8" not in precision_report(c)["dit_blocks"]  # dense: no VSA layer to run it
    dit.enable_vsa(0.5)
    assert precision_report(c)["dit_blocks"].endswith("; VSA QK^T int8 (smoothed keys, per-row scales)")
    dit.vsa_qk_int8 = False
    assert "int8" not in precision_report(c)["dit_blocks"]


def test_int8_qk_only_for_fp8_on_a_gpu_with_the_tma_kernel(monkeypatch):
    from h3render.models.attention import vsa_qk_int8_pays
    from h3render.kernels.vsa import triton_hopper

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not vsa_qk_int8_pays("fp8", cpu) and not vsa_qk_int8_pays("bf16", cuda)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: "probe")  # no CUDA here: the capability comes from the stub
    for capability_9, want in ((True, True), (False, False)):
        monkeypatch.setattr(triton_hopper, "tma_supported", lambda x, ok=capability_9: x == "probe" and ok)
        assert vsa_qk_int8_pays("fp8", cuda) is want  # sm_90+ runs the TMA kernel; sm_89 the pointer one


def test_fp8_load_quantizes_the_fasth3_fused_weights(tmp_path):
    from h3render.checkpoint.adapter import TINY_BASE_MODEL, AdapterFusion, read_adapter
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    adapter = read_adapter(write_synthetic_adapter(tmp_path / "a.safetensors", DIT_TINY, seed=3, rank=4),
                           base_model=TINY_BASE_MODEL)
    fused = load_components("tiny", parts=("dit",), tensor_hook=AdapterFusion(adapter, DIT_TINY, "cpu")).dit
    base = load_components("tiny", parts=("dit",)).dit
    dit = load_components("tiny", parts=("dit",), tensor_hook=AdapterFusion(adapter, DIT_TINY, "cpu"),
                          precision="fp8").dit
    for name in ("blocks.0.attn.qkv_proj", "blocks.1.mlp.fc2"):
        data, scale = quantize_weight(fused.get_submodule(name).weight)
        got = dit.get_submodule(name)
        assert torch.equal(got.weight.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(got.weight_scale, scale)
        assert not torch.equal(fused.get_submodule(name).weight, base.get_submodule(name).weight)  # fusion changed it


def _worker(rank: int, port: int, queue) -> None:
    with cpu_rank(rank, port, WORLD) as ctx:
        dit = _vsa_dit(0.75, gate_seed=2)
        quantize_dit_fp8_(dit)
        v, a = _forward(dit, window_ctx=ctx)
        if rank == 0:
            put_result(queue, (v.clone(), a.clone()))


def test_ulysses_fp8_two_ranks_equal_one():
    """Row-sharded FP8 blocks: each rank quantizes its own rows (per-row scales do not depend on the other rows),
    and Ulysses only reshuffles the projections' outputs, so 2 ranks equal 1."""
    [(v, a)] = run_ranks(_worker, WORLD, results=1)
    dit = _vsa_dit(0.75, gate_seed=2)
    quantize_dit_fp8_(dit)
    ref_v, ref_a = _forward(dit)
    assert rel_err(v, ref_v) <= 1e-5 and rel_err(a, ref_a) <= 1e-5  # measured 0.0 (bit-equal)


# ---------------------------------------------------------------- CUDA (cuBLASLt's FP8 GEMM, the compiled producers)

@compiled_cuda
@pytest.mark.parametrize("rows", [0, 1, 77, 4096])
def test_fp8_linear_on_cuda_against_exact_reference(rows):
    # cuBLASLt's row-wise scaled GEMM (not the CPU fallback): scale orientation, odd row counts and an empty shard.
    lin, x = _linear(512, 384, seed=7, bias=True)
    lin = lin.to("cuda", torch.bfloat16)
    x = x.repeat(rows // 64 + 1, 1)[:rows].to("cuda", torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    y = f(x)
    assert y.shape == (rows, 384) and y.dtype == torch.bfloat16
    if rows == 0:
        return
    exact = quantize_rows(x).dequantize() @ f.dequantized_weight().t() + lin.bias.float()
    assert rel_err(y.float(), exact) <= 4e-3  # bf16 output rounding only (CPU: 1.7e-3)
    assert rel_err(y.float(), F.linear(x.float(), lin.weight.float(), lin.bias.float())) <= 0.075
    # The bias rides in the GEMM's epilogue (`BIAS_EPILOGUE`): one bf16 rounding of product + bias, so every output
    # is within one bf16 step of the fp32 value, give or take the fp32 accumulation's own error (cuBLAS sums the
    # K = 512 products in its own order: up to K * 2^-24 of the sum of |products|, which decides outputs that nearly
    # cancel; the GPU run of 2026-12-04 failed the bare one-step bound there). The switch changes bits: the separate
    # add rounds twice (on the CPU about a quarter of the outputs differ, tests above).
    import h3render.models.fp8 as fp8_module

    step = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))
    accumulation = 512 * 2.0 ** -24 * (quantize_rows(x).dequantize().abs() @ f.dequantized_weight().abs().t())
    assert bool(((y.float() - exact).abs() <= step + accumulation).all())
    fp8_module.BIAS_EPILOGUE = False
    try:
        apart = f(x)
    finally:
        fp8_module.BIAS_EPILOGUE = True
    assert not torch.equal(apart, y)


@compiled_cuda
@pytest.mark.parametrize("vsa", [False, True])
def test_tiny_dit_fp8_on_cuda_against_bf16(vsa):
    # The whole FP8 block on the GPU: fused Triton producers -> _scaled_mm, against the same model in bf16 on the GPU.
    from tests.unit.test_vsa_dit import _inputs, _tables

    dit = (_vsa_dit(0.75, gate_seed=2) if vsa else random_dit(DIT_TINY, seed=1)).apply_precision_(torch.bfloat16)
    dit = dit.to("cuda")
    layout, video, audio, text = _inputs()
    layout = layout.to("cuda")
    video, audio, text = (t.to("cuda", torch.bfloat16) for t in (video, audio, text))
    tables, index = _tables(dit, layout)
    with torch.no_grad():
        ref_v, ref_a = dit(video, audio, text, layout, tables, index)
        quantize_dit_fp8_(dit)
        v, a = dit(video, audio, text, layout, tables, index)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()
    # the CPU bounds (test_tiny_dit_fp8_against_bf16_and_bf16_unchanged): the GPU path is the same arithmetic
    assert rel_err(v.float(), ref_v.float()) <= 0.045 and rel_err(a.float(), ref_a.float()) <= 0.035


def test_fp8_linear_off_cuda_needs_no_scaled_mm(monkeypatch):
    # torch 2.11's CPU _scaled_mm takes per-tensor scales only (an INTERNAL ASSERT on the H200 machine's CPU
    # tensors): off CUDA the GEMM is the dequantized product, whatever the torch version.
    lin, x = _linear(512, 384, seed=11)
    f = Fp8Linear.from_linear(lin.to(torch.bfloat16))
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("CPU _scaled_mm called"))
    y = f(x.bfloat16())
    exact = quantize_rows(x.bfloat16()).dequantize() @ f.dequantized_weight().t()
    assert y.dtype == torch.bfloat16 and rel_err(y.float(), exact) <= 4e-3  # bf16 rounding of the output only


def test_fp8_linear_empty_shard():
    # A rank can hold no rows of a stream (Ulysses shard of a short clip); cuBLASLt rejects M = 0, so it is skipped.
    lin, _ = _linear(64, 32, seed=3, bias=True)
    y = Fp8Linear.from_linear(lin.to(torch.bfloat16))(torch.empty(0, 64, dtype=torch.bfloat16))
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16
