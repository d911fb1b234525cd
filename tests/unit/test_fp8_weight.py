"""The weight-only FP8 GEMM (`kernels.fp8_weight`, issue 26: y^T = w x^T, K split across programs) against its torch
reference, and `Fp8WeightLinear`'s modes: "auto" / "gemm" on CUDA, "rows" (w8a8: `Fp8Linear`'s product) against
`Fp8Linear` and, on CUDA, the dequantized product.

Triton runs under TRITON_INTERPRET=1 on CPU tensors (the integer decode, by pointers; the sm_89+ `cvt` decodes are
inline PTX and tensor descriptors want a GPU: the CUDA cases run those, and `rows_to_f16` runs in both). Outputs are
NaN-poisoned first, so an element no program writes fails. Bounds: every e4m3 code decodes exactly (bit-exact through
an identity product); on odd shapes the kernel differs from the fp32 reference by two bf16 / fp16 roundings, the
dequantized weight `w * scale` (it reaches the dot product in the activation dtype) and the output, plus fp32
summation order: rel. error <= 6e-3 (bf16's half-ulp is 2**-9 = 2e-3 per rounding; with 24 outputs and the bias partly
cancelling the sum, 60 seeds of the 1x40x24 case gave 2.3e-3 .. 4.9e-3, median 3.2e-3; the output rounding alone is
1.6e-3). A split's partial sums are fp32 and add in split order: the same fp32 terms in another order. The inputs are
seeded: an unseeded draw once gave 4.3e-3 against the former 4e-3 bound.
"""

import itertools

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


def _run(x, w, s, b=None, config=None):
    from h3render.kernels.fp8_weight.triton_impl import fp8_weight_linear_triton

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return fp8_weight_linear_triton(x, w, s, b, config=config, out=out)


def _every_code(n_rows):
    """All 254 finite e4m3 codes (the two NaN codes set to 0: quantize_weight never writes them) as [n_rows, 256 /
    n_rows]; the identity reads them back: y = eye @ w^T = w^T, one exact term per output."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(n_rows, 256 // n_rows)


@interpreted
@pytest.mark.parametrize("split", [1, 2])
def test_every_e4m3_code_decodes_exactly(split):
    w = _every_code(8)  # [8, 32]
    x = torch.eye(32, dtype=torch.bfloat16)
    got = _run(x, w, torch.ones(1, 8), config=(64, 16, 16, split, 4, 1, 0, 0))  # two 16-token tiles, K split in 2
    assert torch.equal(got.float(), w.float().t()), "an e4m3 code decoded wrong"


@interpreted
@pytest.mark.parametrize("m,k,n,dtype,bias,config", [
    (1, 40, 24, torch.bfloat16, True, None),  # the default setting, one token, K below one block
    (77, 200, 136, torch.float16, False, None),
    (130, 96, 72, torch.bfloat16, True, None),
    (130, 1000, 72, torch.bfloat16, True, (64, 64, 128, 3, 4, 1, 0, 0)),  # 3 token tiles, K split 3 (the last short)
    (64, 520, 200, torch.bfloat16, True, (128, 128, 128, 8, 8, 1, 0, 0)),  # split 8 -> 5 (520 = 4 x 128 + 8)
    (50, 1000, 130, torch.bfloat16, True, (128, 64, 128, 6, 8, 1, 0, 0)),  # split 6 -> 4 (1000 = 3 x 256 + 232)
    (200, 300, 70, torch.float16, True, (128, 128, 64, 2, 8, 1, 2, 1)),  # DECODE 2, TMA asked on the CPU: integers
    (190, 150, 40, torch.bfloat16, False, (64, 256, 64, 2, 4, 1, 1, 1)),  # one 256-token tile, 66 of its rows past M
])
def test_triton_matches_reference_on_odd_shapes(m, k, n, dtype, bias, config):
    w, s = _weights(n, k, seed=m)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    got = _run(x, w, s, b, config)
    assert got.dtype == dtype and not got.isnan().any(), "an output element was not written"
    assert rel_err(got, fp8_weight_linear_naive(x.float(), w, s, b)) <= TOL


@interpreted
def test_fused_dequantize_is_the_torch_expression_bit_for_bit():
    """Both factors of its product are exact (code x 2**-8, scale x 2**8): one fp32 rounding, then one to bf16."""
    from h3render.kernels.fp8_weight.triton_impl import dequantize_triton

    w, s = _weights(37, 300, seed=4)
    assert torch.equal(dequantize_triton(w, s), (w.float() * s.t()).to(torch.bfloat16))


@interpreted
def test_rows_to_f16_is_exact_at_every_row_magnitude():
    from h3render.kernels.fp8_weight.triton_impl import rows_to_f16

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1500, generator=g)
    x[1] *= 1e4  # largest ~4e4: past fp16's 32768 without a scale
    x[2] *= 3e9  # far past fp16
    x[3] = 0.0
    x[4] *= 1e-3  # largest ~3e-3: its small elements would fall into fp16's subnormals without a scale
    x[5] *= 1e-30  # far below fp16
    x = x.bfloat16()
    out, rs = rows_to_f16(x)
    assert out.dtype == torch.float16 and out.isfinite().all()
    assert torch.equal(torch.log2(rs), torch.log2(rs).round())  # powers of two: the epilogue's product is exact
    top = out.float().abs().amax(1)
    assert ((top >= 2 ** 14) & (top < 2 ** 15))[[0, 1, 2, 4, 5]].all() and top[3] == 0
    # bf16's 8 significant bits fit fp16's 11: every element here is within 2**28 of its row's largest, so all exact
    assert torch.equal(out.float() * rs[:, None], x.float())


def test_dense_copies_what_a_tensor_descriptor_cannot_take():
    from h3render.kernels.fp8_weight.triton_impl import _dense

    base = torch.arange(3 * 40, dtype=torch.bfloat16).view(3, 40)
    assert _dense(base) is base  # rows K apart, aligned: as is
    one_row = base[1:2, :32]  # torch calls it contiguous, but its row stride is 40
    assert one_row.is_contiguous() and one_row.stride(0) == 40
    got = _dense(one_row)
    assert got.stride() == (32, 1) and got.data_ptr() % 16 == 0 and torch.equal(got, one_row)
    wide = base[:, :32]  # rows 40 apart
    assert _dense(wide).stride() == (32, 1) and torch.equal(_dense(wide), wide)


def test_config_key_buckets_rows_as_the_prompt_padding_does():
    from h3render.kernels.fp8_weight.triton_impl import CONFIGS, config_key

    # up to 64 rows BLOCK_T's powers of two; above, text_graph's 64-token buckets, so 192 is not 256's setting
    assert [config_key(m, 8, 16)[2] for m in (1, 16, 17, 40, 64, 65, 128, 129, 150, 192, 193, 256, 300)] == \
        [16, 16, 32, 64, 64, 128, 128, 192, 192, 192, 256, 256, 320]
    assert all(rows in (64, 128, 192, 256) for _, _, rows in CONFIGS)  # the table holds only padded prompt lengths


def test_default_config_fills_the_gpu_and_keeps_depth():
    from h3render.kernels.fp8_weight.triton_impl import _default_config

    # The released text encoder's linears at a 77-token prompt (128 rows) on an H200's 132 multiprocessors.
    for n, k in ((8192, 5120), (1024, 5120), (5120, 8192), (25600, 5120), (5120, 25600)):
        bn, _, _, split, *_ = _default_config(128, n, k, 132)
        tiles = -(-n // bn)
        assert k // split >= 512, (n, k, split)  # a split keeps the pipeline's depth
        assert tiles * split >= 264 or split == 8 or k // (2 * split) < 512, (n, k, split)  # or could not split more
    assert _default_config(128, 25600, 5120, 132)[3] == 1  # 400 weight tiles fill the GPU alone
    assert _default_config(128, 1024, 5120, 132)[3] == 8  # 16 weight tiles: split as far as it goes


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
def test_triton_on_cuda_at_the_released_shapes():
    from h3render.kernels.fp8_weight import fp8_dequantize
    from h3render.kernels.fp8_weight import triton_impl as ti

    # Every decode (integers, the conversion instruction to bf16, to fp16 with the fp16 product) reads every code back
    # exactly, split or not, by pointers or by tensor copies.
    w = _every_code(8).cuda()
    x = torch.eye(32, dtype=torch.bfloat16, device="cuda")
    for split, decode, tma in itertools.product((1, 2), (0, 1, 2), (0, 1)):
        got = _run(x, w, torch.ones(1, 8, device="cuda"), config=(64, 16, 16, split, 4, 2, decode, tma))
        assert torch.equal(got.float(), w.float().t()), (split, decode, tma)
    # k/v 5120 -> 1024 and down 25600 -> 5120 at a padded prompt's rows, and a longer presentation: the kept setting
    # for the shape, the default, and each decode with and without a split; two runs give the same bits.
    for m, k, n in ((64, 5120, 1024), (128, 5120, 1024), (192, 5120, 8192), (64, 25600, 5120), (256, 25600, 5120),
                    (77, 200, 136), (300, 5120, 1024)):
        w, s = _weights(n, k, "cuda", seed=n)
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(k)).bfloat16()
        x[1] *= 3e5  # a row past fp16's range: DECODE 2 scales it down and back up (the error bound is relative)
        b = torch.randn(n, device="cuda").bfloat16()
        ref = fp8_weight_linear_naive(x.float(), w, s, b)
        configs = {ti.CONFIGS.get(ti.config_key(m, n, k)), ti._default_config(m, n, k, 132),
                   (64, 128, 128, 1, 4, 3, 0, 0), (64, 128, 128, 4, 4, 3, 1, 1), (128, 64, 64, 2, 8, 4, 2, 0),
                   (256, 128, 64, 1, 8, 3, 2, 1), (64, 64, 128, 8, 4, 3, 0, 1), (64, 256, 64, 1, 4, 3, 1, 1),
                   (64, 256, 128, 2, 4, 3, 2, 1), (128, 256, 64, 4, 8, 3, 1, 1)} - {None}
        for config in configs:
            got = _run(x, w, s, b, config)
            assert not got.isnan().any() and rel_err(got, ref) <= TOL, (m, k, n, config)
            assert rel_err(got[2:], ref[2:]) <= TOL, (m, k, n, config)  # not hidden under row 1's norm
            assert torch.equal(got, _run(x, w, s, b, config)), (m, k, n, config)
    w, s = _weights(1000, 3000, "cuda")
    assert torch.equal(fp8_dequantize(w, s), (w.float() * s.t()).to(torch.bfloat16))


@compiled_cuda
def test_linear_modes_on_cuda(monkeypatch):
    q = Fp8WeightLinear.from_linear(_linear(512, 96, "cuda", seed=5))
    g = torch.Generator("cuda").manual_seed(6)
    for rows in (5, 256, 300):  # up to GEMM_MAX_ROWS the Triton GEMM, above it dequantize + cuBLAS
        x = torch.randn(rows, 512, device="cuda", generator=g).bfloat16()
        outputs = {}
        for mode in ("dequant", "gemm", "dequant-fused", "auto"):
            monkeypatch.setattr(Fp8WeightLinear, "mode", mode)
            outputs[mode] = q(x)
        assert torch.equal(outputs["dequant-fused"], outputs["dequant"])  # the same bf16 weight, the same GEMM
        assert rel_err(outputs["gemm"], outputs["dequant"]) <= TOL
        assert torch.equal(outputs["gemm"], fp8_weight_linear(x, q.weight, q.weight_scale, q.bias.to(x.dtype)))
        assert torch.equal(outputs["auto"], outputs["gemm" if rows <= q.GEMM_MAX_ROWS else "dequant-fused"]), rows
