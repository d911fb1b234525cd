"""The weight-only FP8 GEMM (`kernels.fp8_weight`, issue 26) against its torch reference, and `Fp8WeightLinear`'s
mode "rows" (w8a8: `Fp8Linear`'s product) against `Fp8Linear` and, on CUDA, the dequantized product.

Triton runs under TRITON_INTERPRET=1 on CPU tensors; the outputs are NaN-poisoned first, so an element the kernel
does not write fails. Bounds: every e4m3 code decodes exactly (bit-exact through an identity product); on odd shapes
the kernel differs from the fp32 reference by two bf16 / fp16 roundings, the dequantized weight `w * scale` (it
reaches the dot product in the activation dtype) and the output, plus fp32 summation order: rel. error <= 6e-3
(bf16's half-ulp is 2**-9 = 2e-3 per rounding; with 24 outputs and the bias partly cancelling the sum, 60 seeds of
the 1x40x24 case gave 2.3e-3 .. 4.9e-3, median 3.2e-3; the output rounding alone is 1.6e-3). The inputs are seeded:
an unseeded draw once gave 4.3e-3 against the former 4e-3 bound.
"""

import pytest
import torch
from torch import nn

from h3render.kernels.fp8 import quantize_rows
from h3render.kernels.fp8_weight import fp8_weight_linear, fp8_weight_linear_naive
from h3render.models.fp8 import Fp8Linear, Fp8WeightLinear, quantize_weight
from tests._markers import compiled_cuda, interpreted
from tests._numerics import rel_err

TOL = 6e-3


def _weights(n, k, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return quantize_weight(torch.randn(n, k, device=device, generator=g) * 0.05)


def _linear(k, n, device="cpu", seed=0):
    """A bf16 nn.Linear [k -> n] with bias, seeded weights (nn.Linear's own init draws from the global generator)."""
    g = torch.Generator(device=device).manual_seed(seed)
    lin = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device=device, generator=g) * k ** -0.5)
        lin.bias.copy_(torch.randn(n, device=device, generator=g))
    return lin


def _run(x, w, s, b):
    from h3render.kernels.fp8_weight.triton_impl import fp8_weight_linear_triton

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return fp8_weight_linear_triton(x, w, s, b, out=out)


@interpreted
def test_every_e4m3_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes: never written by quantize_weight
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    x = torch.eye(16, dtype=torch.bfloat16)
    got = _run(x, w, torch.ones(1, 16), None)  # y[i, n] = w[n, i]: one exact term per output
    assert torch.equal(got.float(), w.float().t()), "an e4m3 code decoded wrong"


@interpreted
@pytest.mark.parametrize("m,k,n,dtype,bias", [(1, 40, 24, torch.bfloat16, True), (77, 200, 136, torch.float16, False),
                                              (130, 96, 72, torch.bfloat16, True)])
def test_triton_matches_reference_on_odd_shapes(m, k, n, dtype, bias):
    w, s = _weights(n, k)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = _run(x, w, s, b)
    assert not got.isnan().any(), "an output element was not written"
    assert rel_err(got, fp8_weight_linear_naive(x.float(), w, s, b)) <= TOL


@interpreted
def test_fused_dequantize_is_the_torch_expression_bit_for_bit():
    """Both factors of its product are exact (code x 2**-8, scale x 2**8): one fp32 rounding, then one to bf16."""
    from h3render.kernels.fp8_weight.triton_impl import dequantize_triton

    w, s = _weights(37, 300, seed=4)
    assert torch.equal(dequantize_triton(w, s), (w.float() * s.t()).to(torch.bfloat16))


def test_public_api_dispatch_and_checks(monkeypatch):
    w, s = _weights(32, 48)
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16)
    y = fp8_weight_linear(x, w, s)  # CPU tensor: the reference
    assert y.shape == (2, 3, 32) and torch.equal(y, fp8_weight_linear_naive(x.reshape(6, 48), w, s).view(2, 3, 32))
    with pytest.raises(ValueError, match="do not match"):
        fp8_weight_linear(x, w, s[:, :5])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_linear(x, w.float(), s)


def test_rows_mode_is_the_fp8_linear_product(monkeypatch):
    """Mode "rows" runs `Fp8Linear`'s product (one shared function): bit for bit on the same weight and input, and
    not the weight-only output (the mode switches). monkeypatch puts the class setting back."""
    lin = _linear(96, 48, seed=1)
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    q = Fp8WeightLinear.from_linear(lin)
    weight_only = q(x)
    monkeypatch.setattr(Fp8WeightLinear, "mode", "rows")
    got = q(x)
    assert got.shape == (2, 5, 48) and got.dtype == x.dtype
    assert torch.equal(got, Fp8Linear.from_linear(lin)(x))
    assert not torch.equal(got, weight_only)


@pytest.mark.parametrize("k,n", [(40, 32), (48, 24)])
def test_rows_mode_falls_back_to_auto_off_multiples_of_16(monkeypatch, k, n):
    # torch._scaled_mm needs K and N multiples of 16: such a linear keeps the weight-only "auto" path.
    q = Fp8WeightLinear.from_linear(_linear(k, n, seed=k))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    auto = q(x)
    monkeypatch.setattr(Fp8WeightLinear, "mode", "rows")
    assert torch.equal(q(x), auto)


@compiled_cuda
def test_rows_mode_on_cuda_against_the_dequantized_product(monkeypatch):
    # cuBLASLt's row-wise _scaled_mm at the released k/v projection's width (5120 -> 1024), below and above
    # GEMM_MAX_ROWS: only the bf16 output rounding and the accumulation order separate it from the fp32 product of
    # the dequantized operands (the CPU path: 1.6e-3 for Fp8Linear, tests/unit/test_fp8_model.py).
    q = Fp8WeightLinear.from_linear(_linear(5120, 1024, "cuda", seed=3))
    monkeypatch.setattr(Fp8WeightLinear, "mode", "rows")
    g = torch.Generator("cuda").manual_seed(4)
    for rows in (5, 300):
        x = torch.randn(rows, 5120, device="cuda", generator=g).bfloat16()
        got = q(x)
        exact = quantize_rows(x).dequantize() @ q.dequantized_weight().t() + q.bias.float()
        assert got.dtype == torch.bfloat16 and rel_err(got.float(), exact) < 1e-2, rows


@compiled_cuda
def test_triton_on_cuda_matches_reference_and_the_linear():
    # Odd shapes, then the released text encoder's widths (k/v 5120 -> 1024, down 25600 -> 5120) at prompt lengths.
    for m, k, n in ((1, 40, 24), (77, 200, 136), (300, 5120, 1024), (2000, 25600, 5120)):
        w, s = _weights(n, k, "cuda")
        x = torch.randn(m, k, device="cuda").bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        got = _run(x, w, s, b)
        assert not got.isnan().any() and rel_err(got, fp8_weight_linear_naive(x.float(), w, s, b)) <= TOL, (m, k, n)
    from h3render.kernels.fp8_weight import fp8_dequantize
    from h3render.kernels.fp8_weight.triton_impl import CANDIDATES

    w, s = _weights(1000, 3000, "cuda")
    assert torch.equal(fp8_dequantize(w, s), (w.float() * s.t()).to(torch.bfloat16))
    x = torch.randn(77, 3000, device="cuda").bfloat16()
    for config in CANDIDATES:  # every launch setting the benchmark may pick
        got = _run_config(x, w, s, config)
        assert not got.isnan().any() and rel_err(got, fp8_weight_linear_naive(x.float(), w, s)) <= TOL, config
    linear = torch.nn.Linear(256, 96, device="cuda").bfloat16()
    q = Fp8WeightLinear.from_linear(linear)
    outputs = {}
    for rows in (5, 300):  # below and above GEMM_MAX_ROWS (K = 256: below GEMM_MAX_K)
        x = torch.randn(rows, 256, device="cuda").bfloat16()
        for mode in ("dequant", "gemm", "dequant-fused", "auto"):
            Fp8WeightLinear.mode = mode
            try:
                outputs[mode] = q(x)
            finally:
                Fp8WeightLinear.mode = "auto"
        assert torch.equal(outputs["dequant-fused"], outputs["dequant"])  # the same bf16 weight, the same GEMM
        assert rel_err(outputs["gemm"], outputs["dequant"]) <= TOL
        assert torch.equal(outputs["auto"], outputs["gemm" if rows <= q.GEMM_MAX_ROWS else "dequant-fused"])


def _run_config(x, w, s, config):
    from h3render.kernels.fp8_weight.triton_impl import fp8_weight_linear_triton

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return fp8_weight_linear_triton(x, w, s, config=config, out=out)
