"""FP8 (e4m3, per-row scale) kernels vs their torch references, and the references pinned by hand.

Triton runs under TRITON_INTERPRET=1 on CPU; every launcher writes into NaN-poisoned outputs, so an element or a
scale the kernel fails to write fails the test. Bounds (the same on CPU and GPU):
- quantize_rows: bit-exact (scale and every byte): both sides divide with IEEE fp32 on the same fp32 row.
- modulate / swiglu fused: the fp32 row itself differs by a few ulps from the reference (RMS sum order, silu as
  x * sigmoid(x); on the GPU also FMA contraction and approximate rsqrt / exp), so the scale agrees to
  SCALE_RTOL = 1e-6 (~8 fp32 ulps; measured <= 5 ulps at C = 1000 on CPU) and an e4m3 code may move by one step
  where the row straddles a rounding boundary: at most MAX_OFF_FRACTION = 1e-3 of the elements (measured 1 in 1.5M).
"""

import importlib

import pytest
import torch

from h3render.kernels.fp8 import E4M3_MAX, MIN_SCALE, Fp8Rows, quantize_rows, quantize_rows_naive
from h3render.kernels.fp8.triton_impl import quantize_rows_triton
from h3render.kernels.modulate import modulate, modulate_naive
from h3render.kernels.modulate.triton_impl import modulate_fp8_triton
from h3render.kernels.swiglu import swiglu, swiglu_naive
from h3render.kernels.swiglu.triton_impl import swiglu_fp8_triton
from tests._markers import compiled_cuda, interpreted

DTYPES = [torch.float32, torch.bfloat16]
SCALE_RTOL = 1e-6
MAX_OFF_FRACTION = 1e-3
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Inf/Inf under numpy


def poisoned(S: int, K: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) filled with NaN: 0x7F is e4m3fn's NaN."""
    data = torch.full((S, K), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return data, torch.full((S, 1), float("nan"), device=device)


def signed_codes(data: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes as signed magnitudes: neighbouring finite values differ by 1, +0 and -0 are both 0."""
    b = data.view(torch.uint8).long()
    return torch.where(b >= 128, -(b - 128), b)


def assert_fp8_equal(got, ref):
    """Bit-exact: the same scale and bytes (NaN compared as NaN, whatever its sign bit)."""
    (d, s), (rd, rs) = got, ref
    assert d.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == rs.shape and d.shape == rd.shape
    torch.testing.assert_close(s, rs, rtol=0, atol=0, equal_nan=True)
    nan, ref_nan = d.float().isnan(), rd.float().isnan()
    assert torch.equal(nan, ref_nan), "NaN positions differ"
    assert torch.equal(d.view(torch.uint8)[~nan], rd.view(torch.uint8)[~nan]), "e4m3 bytes differ"


def assert_fp8_close(got, ref):
    """Fused bound (module docstring): scales to SCALE_RTOL, codes within one step, few of them off at all."""
    (d, s), (rd, rs) = got, ref
    assert d.dtype == torch.float8_e4m3fn and d.shape == rd.shape and s.dtype == torch.float32 and s.shape == rs.shape
    assert not d.float().isnan().any() and not s.isnan().any(), "unwritten or non-finite output"
    torch.testing.assert_close(s, rs, rtol=SCALE_RTOL, atol=0)
    off = (signed_codes(d) - signed_codes(rd)).abs()
    assert off.max().item() <= 1, f"an e4m3 code is {off.max().item()} steps off"
    assert off.sum().item() <= MAX_OFF_FRACTION * off.numel() or off.sum().item() <= 1, f"{off.sum().item()} off"
    # Dequantized: within one e4m3 step of the reference value (step <= 2**-3 relative, 2**-9 * scale absolute).
    deq, ref_deq = Fp8Rows(d, s).dequantize(), Fp8Rows(rd, rs).dequantize()
    step = torch.maximum(ref_deq.abs() * 2**-3, rs * 2**-9)
    assert ((deq - ref_deq).abs() <= step * (1 + 1e-5)).all()


# ---------------------------------------------------------------- the reference, by hand


def test_reference_pinned_by_hand():
    s = 2.0**-3
    data, scale = quantize_rows_naive(torch.tensor([[448 * s, -s, 0.0, 0.0], [3 * 448.0, 3.0, -6.0, 0.0]]))
    assert scale.shape == (2, 1) and scale[0, 0].item() == s and scale[1, 0].item() == 3.0
    assert data.float().tolist() == [[448.0, -1.0, 0.0, 0.0], [448.0, 1.0, -2.0, 0.0]]
    # Scale 1 (abs-max 448): round to nearest, ties to the even mantissa, in the normal and the subnormal range.
    row = torch.tensor([[448.0, 1.0625, 1.1875, 1.0625 + 2**-20, 17.0, 19.0, -1.5 * 2**-9, 2**-10, 431.0, 433.0]])
    data, scale = quantize_rows_naive(row)
    assert scale.item() == 1.0
    assert data.float().tolist() == [[448.0, 1.0, 1.25, 1.125, 16.0, 20.0, -(2.0**-8), 0.0, 416.0, 448.0]]


def test_reference_zero_and_non_finite_rows():
    y = torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 1.0, -2.0], [float("nan"), 1.0, 2.0]])
    data, scale = quantize_rows_naive(y)
    assert scale[0].item() == MIN_SCALE and data[0].float().tolist() == [0.0, 0.0, 0.0]
    assert scale[1].item() == float("inf")
    assert data[1, 0].float().isnan() and data[1, 1:].float().tolist() == [0.0, 0.0]  # Inf / Inf, 1 / Inf
    assert scale[2].isnan().item() and data[2].float().isnan().all()


# ---------------------------------------------------------------- quantize_rows


@interpreted
def test_quantize_rows_rounding_every_e4m3_value_and_midpoint():
    # Abs-max 448 gives scale exactly 1, so the kernel's codes are its rounding of these very values.
    finite = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    mid = (finite[1:] + finite[:-1]) / 2  # ties (exact in fp32)
    vals = torch.cat((finite, mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)))
    y = torch.cat((vals, -vals))[None]
    got = quantize_rows_triton(y, out=poisoned(*y.shape))
    assert got[1].item() == 1.0
    assert_fp8_equal(got, quantize_rows_naive(y))


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,K", [(1, 24), (7, 40), (33, 100), (33, 130), (2, 5376)])
def test_quantize_rows_triton_matches_naive(S, K, dtype):
    g = torch.Generator().manual_seed(S * K)
    # Row magnitudes from 1e-30 to 1e30 (subnormal e4m3 codes included), a zero row, a row with one huge value.
    y = torch.randn(S, K + 3, generator=g) * torch.logspace(-30, 30, S)[:, None]
    y[S // 2] = 0.0
    y[-1, K // 3] = 3e38 if dtype == torch.float32 else 1e38
    y = y.to(dtype)[:, :K]  # row stride K + 3
    assert_fp8_equal(quantize_rows_triton(y, out=poisoned(S, K)), quantize_rows_naive(y))


@interpreted
def test_quantize_rows_zero_and_non_finite_rows():
    y = torch.randn(5, 40)
    y[0] = 0.0
    y[1, 3] = float("inf")
    y[2, 7] = float("nan")
    y[3] = -0.0
    data, scale = quantize_rows_triton(y, out=poisoned(5, 40))
    assert_fp8_equal((data, scale), quantize_rows_naive(y))
    assert scale[0].item() == MIN_SCALE and (data[0].float() == 0).all() and not data[3].float().isnan().any()
    assert scale[1].item() == float("inf") and data[1, 3].float().isnan() and (data[1, :3].float() == 0).all()
    assert scale[2].isnan() and data[2].float().isnan().all()


@interpreted
def test_quantize_rows_public_api(monkeypatch):
    y = (torch.randn(7, 100) * 5).to(torch.bfloat16)
    ref = quantize_rows_naive(y)
    mod = importlib.import_module("h3render.kernels.fp8")
    monkeypatch.setattr(mod, "quantize_rows_naive", lambda *a: pytest.fail("naive path taken"))
    got = quantize_rows(y, use_triton=True)
    assert isinstance(got, Fp8Rows) and got.data.shape == (7, 100) and got.scale.shape == (7, 1)
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float32
    assert_fp8_equal(got, ref)
    # Dequantized rows are within half an e4m3 step (2**-4 relative) of the input, plus the subnormal floor.
    err = (got.dequantize() - y.float()).abs()
    assert (err <= y.float().abs() * 2**-4 + got.scale * 2**-10).all()
    with pytest.raises(ValueError, match="out data"):
        quantize_rows_triton(y, out=(torch.empty(7, 100), torch.empty(7, 1)))


# ---------------------------------------------------------------- modulate


def _modulate_inputs(S, C, R, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(S, C, generator=g)).to(dtype)
    table = (0.5 * torch.randn(R, 6, C, generator=g)).to(dtype)  # [R, 6, C]: one block's AdaLN table
    row_index = torch.randint(0, R, (S,), generator=g)
    return x, table, row_index


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,C,R,with_weight", [(1, 24, 1, True), (7, 40, 3, False), (33, 100, 6, True),
                                               (33, 130, 6, False), (2, 5376, 2, True)])
def test_modulate_fp8_triton_matches_naive(S, C, R, with_weight, dtype):
    x, table, row_index = _modulate_inputs(S, C, R + 1, dtype, seed=S + C)
    weight = (1 + 0.1 * torch.randn(C)).to(dtype) if with_weight else None
    # Last row: x = 0 with a zero shift row gives a zero result row; first row: one huge value.
    table[R, 0] = 0.0
    x[-1], row_index[-1] = 0.0, R
    if S > 1:
        x[0, C // 2] = 1e4
    shift, scale = table[:, 0], table[:, 1]  # strided views, row stride 6C
    got = modulate_fp8_triton(x, weight, shift, scale, row_index, 1e-5, out=poisoned(S, C))
    ref = modulate_naive(x, weight, shift, scale, row_index, 1e-5, fp8=True)
    assert_fp8_close(got, ref)
    assert got[1][-1].item() == MIN_SCALE and (got[0][-1].float() == 0).all()


@interpreted
def test_modulate_fp8_public_api(monkeypatch):
    x, table, row_index = _modulate_inputs(7, 40, 3, torch.bfloat16, seed=4)
    w = torch.ones(40, dtype=torch.bfloat16)
    ref = modulate_naive(x, w, table[:, 3], table[:, 4], row_index, 1e-5, fp8=True)
    mod = importlib.import_module("h3render.kernels.modulate")
    monkeypatch.setattr(mod, "modulate_naive", lambda *a, **k: pytest.fail("naive path taken"))
    got = modulate(x, w, table[:, 3], table[:, 4], row_index.to(torch.int32), fp8=True, use_triton=True)
    assert isinstance(got, Fp8Rows) and got.data.shape == (7, 40) and got.scale.shape == (7, 1)
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float32
    assert_fp8_close(got, ref)
    with pytest.raises(ValueError, match="out="):
        modulate(x, w, table[:, 3], table[:, 4], row_index, fp8=True, out=x, use_triton=True)


@interpreted
def test_modulate_bf16_path_unchanged():
    # The FP8 switch shares the kernel: the bf16 result must still be the reference rounded once.
    from h3render.kernels.modulate.triton_impl import modulate_triton

    x, table, row_index = _modulate_inputs(7, 130, 3, torch.bfloat16, seed=9)
    got = modulate_triton(x, None, table[:, 0], table[:, 1], row_index, 1e-5,
                          out=torch.full((7, 130), float("nan"), dtype=torch.bfloat16))
    torch.testing.assert_close(got, modulate_naive(x, None, table[:, 0], table[:, 1], row_index, 1e-5),
                               atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- swiglu


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,F", [(1, 24), (7, 45), (33, 100), (33, 131), (2, 14336)])
def test_swiglu_fp8_triton_matches_naive(S, F, dtype):
    g = torch.Generator().manual_seed(S + F)
    h = 2 * torch.randn(S, 2 * F + 6, generator=g)
    h[-1] = 0.0  # zero row
    if S > 1:
        h[0, F + F // 2] = 1e4  # one huge value
    h = h.to(dtype)[:, : 2 * F]  # row stride 2F + 6
    got = swiglu_fp8_triton(h, out=poisoned(S, F))
    assert_fp8_close(got, swiglu_naive(h, fp8=True))
    assert got[1][-1].item() == MIN_SCALE and (got[0][-1].float() == 0).all()


@interpreted
def test_swiglu_fp8_non_finite_propagates():
    h = torch.randn(3, 80)
    h[0, 45] = float("inf")  # value inf -> y = +-inf: scale Inf, that element NaN, the rest 0
    h[1, 3] = float("-inf")  # gate -inf -> silu = -inf * 0 = NaN: the whole row NaN
    data, scale = swiglu_fp8_triton(h, out=poisoned(3, 40))
    ref = swiglu_naive(h, fp8=True)
    assert_fp8_equal((data[:2], scale[:2]), (ref[0][:2], ref[1][:2]))
    assert scale[0].item() == float("inf") and data[0, 5].float().isnan() and scale[1].isnan()
    assert_fp8_close((data[2:], scale[2:]), (ref[0][2:], ref[1][2:]))


@interpreted
def test_swiglu_fp8_public_api(monkeypatch):
    h = torch.randn(7, 90)
    ref, ref_naive = swiglu_naive(h, fp8=True), swiglu_naive
    mod = importlib.import_module("h3render.kernels.swiglu")
    monkeypatch.setattr(mod, "swiglu_naive", lambda *a, **k: pytest.fail("naive path taken"))
    got = swiglu(h, fp8=True, use_triton=True)
    assert isinstance(got, Fp8Rows) and got.data.shape == (7, 45) and got.scale.shape == (7, 1)
    assert got.data.dtype == torch.float8_e4m3fn and got.scale.dtype == torch.float32
    assert_fp8_close(got, ref)
    bias = torch.randn(90)
    assert_fp8_close(swiglu(h, fp8=True, value_first=True, bias=bias, use_triton=True),
                     ref_naive(h, fp8=True, value_first=True, bias=bias))
    with pytest.raises(ValueError, match="out="):
        swiglu(h, fp8=True, out=torch.empty(7, 45), use_triton=True)
    with pytest.raises(ValueError, match="bias"):
        swiglu(h, fp8=True, bias=torch.randn(45), use_triton=True)


def _layout_inputs(S, F, dtype, with_bias, seed):
    """h [S, 2F] (row stride 2F + 6) with one huge value, its last row cancelled to zero by the bias (or zero),
    and bias [2F] or None."""
    g = torch.Generator().manual_seed(seed)
    h = 2 * torch.randn(S, 2 * F + 6, generator=g)
    bias = (torch.randn(2 * F, generator=g)).to(dtype) if with_bias else None
    h[0, F + F // 2] = 1e4  # one huge value, in the second half
    h = h.to(dtype)[:, : 2 * F]
    h[-1] = 0.0 if bias is None else -bias  # h + bias = 0 exactly: the zero row
    return h, bias


@interpreted
@pytest.mark.parametrize("value_first,with_bias", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("S,F,dtype", [(37, 40, torch.bfloat16), (37, 96, torch.float32)])
def test_swiglu_fp8_layouts_triton_match_naive(S, F, dtype, value_first, with_bias):
    """The video VAE's variants (value half first, fc1 bias added here) of the fused kernel: the fused bound."""
    h, bias = _layout_inputs(S, F, dtype, with_bias, seed=S + F)
    got = swiglu_fp8_triton(h, out=poisoned(S, F), value_first=value_first, bias=bias)
    assert_fp8_close(got, swiglu_naive(h, fp8=True, value_first=value_first, bias=bias))
    assert got[1][-1].item() == MIN_SCALE and (got[0][-1].float() == 0).all()


@pytest.mark.parametrize("value_first,with_bias", [(False, False), (False, True), (True, False), (True, True)])
def test_swiglu_reference_layouts_against_float64(value_first, with_bias):
    """`swiglu_naive(fp8=True)` against value * silu(gate) (+ bias) and the e4m3 row quantization, in float64 from
    the definitions: a swapped half or a lost bias moves values by O(1), far past these bounds."""
    S, F = 37, 40
    h, bias = _layout_inputs(S, F, torch.bfloat16, with_bias, seed=5)
    data, scale = swiglu_naive(h, fp8=True, value_first=value_first, bias=bias)
    x = h.double() + (0 if bias is None else bias.double())
    value, gate = (x[:, :F], x[:, F:]) if value_first else (x[:, F:], x[:, :F])
    y = value * gate / (1 + torch.exp(-gate))  # [S, F] float64
    want_scale = (y.abs().amax(dim=1, keepdim=True) / 448).clamp_min(MIN_SCALE)
    torch.testing.assert_close(scale.double(), want_scale, rtol=1e-6, atol=0)
    v = y / want_scale  # in [-448, 448]
    # e4m3 grid step at |v|: 2**(exponent - 3), 2**-9 below the smallest normal 2**-6; a code is the nearest grid
    # value, so within half a step (+ the fp32 reference's own ~1e-6 relative error on y and on the scale).
    step = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))) - 3)
    err = (data.double() - v).abs()
    assert (err <= step / 2 + 4e-6 * v.abs()).all(), float((err / step).max())
    assert (data[-1].float() == 0).all() and scale[-1].item() == MIN_SCALE


# ---------------------------------------------------------------- CUDA (compiled kernels, a medium shape)


@compiled_cuda
def test_fp8_kernels_on_cuda_match_naive():
    g = torch.Generator(device="cuda").manual_seed(0)
    S, C, F, R = 4096, 5376, 14336, 6
    x = (3 * torch.randn(S, C, device="cuda", generator=g)).bfloat16()
    table = (0.5 * torch.randn(R, 6, C, device="cuda", generator=g)).bfloat16()
    row_index = torch.randint(0, R, (S,), device="cuda", generator=g)
    w = (1 + 0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16()
    h = (2 * torch.randn(S, 2 * F, device="cuda", generator=g)).bfloat16()
    # The default (use_triton=None) must pick Triton for CUDA tensors.
    got_m = modulate(x, w, table[:, 0], table[:, 1], row_index, fp8=True)
    got_s = swiglu(h, fp8=True)
    got_q = quantize_rows(x)
    # The fused producers compute their fp32 row in another order than torch (FMA contraction): the bound. The
    # stand-alone quantization reads the same bf16 row as the reference: bit-exact (the first H200 run, before the
    # reference divided by a tensor 448, had 1.2e-3 of the codes off at ties: h3render/kernels/fp8/naive.py).
    for got, ref in ((got_m, modulate_naive(x, w, table[:, 0], table[:, 1], row_index, 1e-5, fp8=True)),
                     (got_s, swiglu_naive(h, fp8=True))):
        assert_fp8_close(tuple(t.cpu() for t in got), tuple(t.cpu() for t in ref))
    assert_fp8_equal(tuple(t.cpu() for t in got_q), tuple(t.cpu() for t in quantize_rows_naive(x)))
    # The video VAE decoder's FFN (value half first, fc1 bias in the kernel) at one released batch's width.
    h_vae, bias = h[:, : 2 * 8192], (0.5 * torch.randn(2 * 8192, device="cuda", generator=g)).bfloat16()
    got_v = swiglu(h_vae, fp8=True, value_first=True, bias=bias)
    assert_fp8_close(tuple(t.cpu() for t in got_v),
                     tuple(t.cpu() for t in swiglu_naive(h_vae, fp8=True, value_first=True, bias=bias)))
    assert (got_q.dequantize() - x.float()).abs().max().item() <= E4M3_MAX * got_q.scale.max().item() * 2**-4
