"""`kernels.residual_norm_fp8`: the FP8 video VAE decoder's residual add + RMSNorm + bf16 + e4m3 row quantization.

Kernel cases run under TRITON_INTERPRET=1 on CPU tensors, the `compiled_cuda` ones compiled on a GPU; every launcher
writes into NaN-poisoned outputs. Bounds:
- x_new (the new residual): bit-equal to the reference (one rounded product, one rounded add; no FMA on the GPU).
- data and scale: bit-equal on every row whose fp32 normed values all lie more than TIE_ULPS fp32 ulps from a bf16
  rounding midpoint. The kernel's sum of squares is a tree (torch's a cascade) and its 1/sqrt is IEEE (the CPU's
  `torch.rsqrt` is not: 0.6 % of inputs 1 ulp off, torch 2.13 AVX-512), so its fp32 normed row can sit an ulp or a
  few from torch's, and the bf16 rounding of an element at such a near-tie can go the other way: then that element
  is one bf16 step off, its e4m3 code at most one step, and the row's scale one bf16 step of its abs-max. Measured:
  2 codes in 4.1 M (2000 x 2048 rows, interpreted), none in the cases below.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from h3render.kernels.fp8 import MIN_SCALE, Fp8Rows, quantize_rows_naive
from h3render.kernels.residual_norm_fp8 import residual_norm_fp8, residual_norm_fp8_naive
from h3render.kernels.residual_norm_fp8.triton_impl import _round_bf16, residual_norm_fp8_triton
from tests._markers import compiled_cuda, interpreted

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN / Inf rows
EPS = 1e-5  # the decoder's (`VideoVAEConfig.decoder_norm_eps`)
# The kernel's fp32 normed values vs torch's on the CPU: measured at most 6 ulps apart (17 % of them differ at all;
# 20,000 rows of N = 48 .. 4096, numpy's pairwise sum as the interpreter's tl.sum).
TIE_ULPS = 8
SHAPES = [(1, 48), (7, 80), (33, 96), (33, 200), (7, 2048)]


@triton.jit
def _round_bf16_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[:n] = the kernel's interpreter-path bf16 rounding of src[:n] (fp32 in, fp32 out)."""
    cols = tl.arange(0, BLOCK)
    v = tl.load(src + cols, mask=cols < n, other=0.0)
    tl.store(dst + cols, _round_bf16(v, False), mask=cols < n)


def poisoned(M: int, N: int, device="cpu"):
    """(x_new, data, scale) filled with NaN (0x7F is e4m3fn's NaN)."""
    data = torch.full((M, N), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return (torch.full((M, N), float("nan"), device=device), data, torch.full((M, 1), float("nan"), device=device))


def inputs(M: int, N: int, residual: bool, seed: int, device="cpu"):
    """x [M, N] fp32 (row stride N + 3) with row magnitudes 1e-3 .. 1e3, one outlier and a zero row; y [M, N] bf16
    (row stride N + 5) that cancels nothing; gain [N], weight [N] fp32. Without residual, y and gain are None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N + 3, generator=g) * torch.logspace(-3, 3, M)[:, None]
    y = (2 * torch.randn(M, N + 5, generator=g)).bfloat16()
    gain = 0.3 * torch.randn(N, generator=g)
    weight = 1 + 0.1 * torch.randn(N, generator=g)
    x[0, N // 3] = 300.0 * x[0].abs().max()  # an outlier (the decoder's residual has a few)
    x[-1], y[-1] = 0.0, 0.0  # the zero row (when M > 1): scale MIN_SCALE, codes 0
    x, y = x[:, :N].to(device), y[:, :N].to(device)
    if not residual:
        return x, None, None, weight.to(device)
    return x, y, gain.to(device), weight.to(device)


def near_ties(x_new: torch.Tensor, weight: torch.Tensor, ulps: int = TIE_ULPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the kernel's bf16 rounding may legitimately go the other way than the reference's.

    Returns:
        ties [M, N] bool: the reference's fp32 normed value lies within `ulps` fp32 ulps of a bf16 rounding midpoint
        (low 16 bits of its fp32 pattern near 0x8000); rows [M] bool: such an element is within a bf16 step of the
        row's abs-max, so the row's scale may move too (and with it any code of the row)."""
    h = F.rms_norm(x_new.float(), (x_new.shape[1],), weight, EPS)
    ties = ((h.view(torch.int32) & 0xFFFF) - 0x8000).abs() <= ulps
    amax = h.abs().amax(dim=1, keepdim=True)
    return ties, (ties & (h.abs() >= amax * (1 - 2.0**-7))).any(dim=1)


def signed_codes(data: torch.Tensor) -> torch.Tensor:
    b = data.view(torch.uint8).long()
    return torch.where(b >= 128, -(b - 128), b)


def assert_matches_reference(got, ref, exempt=None) -> None:
    """x_new bit-equal; scales and e4m3 bytes bit-equal (NaN as NaN) except where `exempt` = `near_ties(...)` allows
    a tie to round the other way: there one bf16 step of the abs-max (scale) and one e4m3 step (code) at most."""
    (x_new, data, scale), (rx, rd, rs) = got, ref
    assert x_new.dtype == torch.float32 and data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert data.shape == rd.shape and scale.shape == rs.shape == (rd.shape[0], 1)
    torch.testing.assert_close(x_new, rx, rtol=0, atol=0, equal_nan=True)
    ties, rows = (torch.zeros(rd.shape, dtype=torch.bool), torch.zeros(rd.shape[0], dtype=torch.bool)) \
        if exempt is None else (t.to(data.device) for t in exempt)
    torch.testing.assert_close(scale[~rows], rs[~rows], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(scale[rows], rs[rows], rtol=2.0**-7, atol=0, equal_nan=True)  # a bf16 step of amax
    nan, ref_nan = data.float().isnan(), rd.float().isnan()
    assert torch.equal(nan, ref_nan), "NaN positions differ"
    same_scale = (scale == rs) | (scale.isnan() & rs.isnan())  # [M, 1]
    strict = same_scale & ~ties & ~nan
    assert torch.equal(data.view(torch.uint8)[strict], rd.view(torch.uint8)[strict]), "e4m3 bytes differ"
    loose = ~strict & ~nan
    assert ((signed_codes(data[loose]) - signed_codes(rd[loose])).abs() <= 1).all()


# ---------------------------------------------------------------- the reference


@pytest.mark.parametrize("residual", [True, False])
def test_reference_against_float64(residual):
    """`residual_norm_fp8_naive` against the definitions computed in float64: a dropped gain, a swapped weight or a
    missing norm moves values by O(1), far past these bounds."""
    x, y, gain, weight = inputs(33, 200, residual, seed=1)
    x_new, data, scale = residual_norm_fp8_naive(x, y, gain, weight, EPS)
    x64 = x.double() if y is None else x.double() + y.double() * gain.double()
    # fp32: the product and the sum rounded once each
    assert ((x_new.double() - x64).abs() <= 2.0**-23 * (x.double().abs() + (x64 - x.double()).abs())).all()
    assert (x_new is x) == (not residual)
    h = x64 * torch.rsqrt(x64.square().mean(dim=1, keepdim=True) + EPS) * weight.double()  # [M, N] float64
    want_scale = (h.abs().amax(dim=1, keepdim=True) / 448).clamp_min(MIN_SCALE)
    # the bf16 rounding of h (half a bf16 step: 2**-8 relative at most) moves the abs-max, plus fp32 noise
    torch.testing.assert_close(scale.double(), want_scale, rtol=2.0**-8 + 1e-6, atol=0)
    v = h / want_scale  # in [-448, 448]
    # A code is the nearest e4m3 grid value (half a step: 2**(e - 3), 2**-9 below 2**-6) to v up to the bf16
    # rounding of h and of the abs-max in the scale (2**-8 relative each).
    step = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))) - 3)
    err = (data.double() - v).abs()
    assert (err <= step / 2 + (2.0**-7 + 1e-5) * v.abs()).all(), float((err / step).max())
    assert scale[-1].item() == MIN_SCALE and (data[-1].float() == 0).all()  # the zero row


def test_reference_is_the_unfused_block_math():
    """The reference is op for op what the unfused FP8 block hands `Fp8Linear`: x + y * gain (fp32), nn.RMSNorm,
    `.to(bf16)`, `quantize_rows` (the decoder's [B, S, dim] view of the rows included)."""
    x, y, gain, weight = inputs(7, 80, True, seed=2)
    norm = torch.nn.RMSNorm(80, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
        x3 = x.view(1, 7, 80) + y.view(1, 7, 80) * gain  # bf16 * fp32 promotes to fp32, as `attn * scale1`
        want = quantize_rows_naive(norm(x3).to(torch.bfloat16).view(7, 80))
    x_new, data, scale = residual_norm_fp8_naive(x, y, gain, weight, EPS)
    assert torch.equal(x_new, x3.view(7, 80)) and torch.equal(scale, want[1])
    assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8))


# ---------------------------------------------------------------- the kernel (interpreted)


@interpreted
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("M,N", SHAPES)
def test_kernel_matches_reference(M, N, residual):
    x, y, gain, weight = inputs(M, N, residual, seed=M * N + residual)
    got = residual_norm_fp8_triton(x, y, gain, weight, EPS, out=poisoned(M, N))
    ref = residual_norm_fp8_naive(x, y, gain, weight, EPS)
    exempt = near_ties(ref[0], weight)
    assert_matches_reference(got, ref, exempt)
    assert exempt[0].float().mean().item() <= 2e-3 and exempt[1].sum().item() <= 1  # the exception, not the rule
    if M > 1:
        assert got[2][-1].item() == MIN_SCALE and (got[1][-1].float() == 0).all()
    if not residual:
        assert got[0] is x  # nothing written to x


@interpreted
def test_bf16_rounding_helper_is_torchs():
    """The interpreter path rounds the normed row to bf16 by hand (triton's interpreter cast rounds ties away from
    zero): every case of torch's round-to-nearest-even, bit for bit, through the kernel's own helper."""
    g = torch.Generator().manual_seed(7)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (3000,), generator=g, dtype=torch.int64).to(torch.int32)
    bf16 = torch.randint(0, 2**16, (500,), generator=g, dtype=torch.int32) << 16  # bf16 values ...
    ties = torch.cat([bf16 | 0x8000, bf16 | 0x7FFF, bf16 | 0x8001])  # ... their midpoints and the fp32 next to them
    special = torch.tensor([1.0, -0.0, 2.0**-149, 2.0**-126 * (1 - 2.0**-8), 3.3895313e38, 3.4028235e38, 1 + 2.0**-8,
                            1 + 3 * 2.0**-8, 2 - 2.0**-9, float("inf"), float("-inf"), float("nan")]).view(torch.int32)
    src = torch.cat([random_bits, ties, special]).view(torch.float32)
    dst = torch.full_like(src, 1.0)
    _round_bf16_kernel[(1,)](src, dst, src.numel(), BLOCK=triton.next_power_of_2(src.numel()))
    want = src.bfloat16().float()
    assert torch.equal(dst.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(dst[finite].view(torch.int32), want[finite].view(torch.int32))


@interpreted
def test_non_finite_propagates():
    """NaN or Inf in x or y: x_new keeps it; the row's scale and every code turn NaN, as `quantize_rows` does with
    the NaN rows the reference norm writes (Inf: mean square Inf, r = 0, Inf * 0 = NaN); other rows are untouched."""
    x, y, gain, weight = inputs(6, 48, True, seed=3)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    y[3, 9] = float("nan")
    y[4, 11] = float("-inf")
    got = residual_norm_fp8_triton(x, y, gain, weight, EPS, out=poisoned(6, 48))
    ref = residual_norm_fp8_naive(x, y, gain, weight, EPS)
    assert_matches_reference(got, ref)
    x_new, data, scale = got
    assert x_new[1, 5].isnan() and x_new[2, 7].isinf() and x_new[3, 9].isnan() and x_new[4, 11].isinf()
    assert x_new.isfinite().sum().item() == 6 * 48 - 4
    assert scale[1:5].isnan().all() and data[1:5].float().isnan().all()
    assert scale[[0, 5]].isfinite().all() and not data[[0, 5]].float().isnan().any()
    # without the residual too
    data, scale = residual_norm_fp8_triton(x, None, None, weight, EPS)[1:]
    assert scale[1:3].isnan().all() and data[1:3].float().isnan().all() and scale[3:].isfinite().all()


@interpreted
def test_public_api_dispatch_and_checks(monkeypatch):
    x, y, gain, weight = inputs(7, 80, True, seed=4)
    want = residual_norm_fp8_naive(x, y, gain, weight, EPS)
    mod = importlib.import_module("h3render.kernels.residual_norm_fp8")
    monkeypatch.setattr(mod, "residual_norm_fp8_naive", lambda *a: pytest.fail("naive path taken"))
    x_new, rows = residual_norm_fp8(x, y, gain, weight, EPS, use_triton=True)
    assert isinstance(rows, Fp8Rows) and rows.data.shape == (7, 80) and rows.scale.shape == (7, 1)
    assert_matches_reference((x_new, *rows), want)
    same, rows = residual_norm_fp8(x, None, None, weight, EPS, use_triton=True)
    assert same is x
    monkeypatch.undo()
    assert residual_norm_fp8(x, None, None, weight, EPS)[0] is x  # CPU default: the reference
    bad = [
        dict(x=x.double()), dict(x=x[None]), dict(x=x.t()), dict(y=y[:, :40]), dict(y=y.t().contiguous().t()),
        dict(gain=None), dict(y=None), dict(gain=gain[:40]), dict(weight=weight.bfloat16()), dict(y=y.int()),
    ]
    for change in bad:
        args = dict(x=x, y=y, gain=gain, weight=weight) | change
        with pytest.raises(ValueError):
            residual_norm_fp8(args["x"], args["y"], args["gain"], args["weight"], EPS, use_triton=True)
    with pytest.raises(ValueError, match="out x_new"):
        residual_norm_fp8_triton(x, y, gain, weight, EPS, out=(torch.empty(7, 81), *poisoned(7, 80)[1:]))


# ---------------------------------------------------------------- compiled, on CUDA (GPU machine, TRITON_INTERPRET=0)


@compiled_cuda
def test_kernel_on_cuda_matches_reference():
    """Compiled kernel vs torch on CUDA, at the odd shapes and one released batch's rows (14,376 x 2048). The GPU
    reference's own rms (torch's CUDA reduction and rsqrt) is a few ulps from the kernel's: a wider tie window."""
    for M, N in [*SHAPES, (14376, 2048)]:
        for residual in (True, False):
            x, y, gain, weight = inputs(M, N, residual, seed=M + N, device="cuda")
            got = residual_norm_fp8_triton(x, y, gain, weight, EPS, out=poisoned(M, N, "cuda"))
            ref = residual_norm_fp8_naive(x, y, gain, weight, EPS)
            exempt = tuple(t.cpu() for t in near_ties(ref[0], weight, ulps=64))
            assert_matches_reference(tuple(t.cpu() for t in got), tuple(t.cpu() for t in ref), exempt)
