"""The modulate kernel's multi-row launch (`kernels.modulate.triton_impl`: ROWS rows a program, `LAUNCH`, `launch=`)
against the torch reference, under TRITON_INTERPRET=1 on CPU and compiled on CUDA (TRITON_INTERPRET=0).

Every launcher writes into NaN-poisoned outputs (an unwritten element or scale fails) and the tolerances are those of
tests/unit/test_kernels.py (bf16 / fp32 output) and tests/unit/test_fp8_kernels.py (FP8 codes and scales). Shapes are
odd on purpose: S = 1, 3, 37 leave the last program of a 2- or 4-row launch with rows past S, C = 97 and 300 leave
masked columns in every row.
"""

import importlib

import pytest
import torch

from h3render.kernels.modulate import modulate, modulate_naive
from h3render.kernels.modulate import triton_impl
from h3render.kernels.modulate.triton_impl import launch_settings, modulate_fp8_triton, modulate_triton
from tests._markers import compiled_cuda, interpreted
from tests.unit.test_fp8_kernels import assert_fp8_close
from tests.unit.test_fp8_kernels import poisoned as poisoned_fp8
from tests.unit.test_kernels import TOL

LAUNCHES = [(1, 4), (2, 4), (4, 8)]  # 1, 2 and 4 rows a program
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN poison under numpy


def _inputs(S, C, R, dtype, seed, device="cpu"):
    """x [S, C], a [R, 6, C] AdaLN table, row_index [S] into it (every table row used once S >= 3), weight [C]."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(S, C, generator=g)).to(dtype)
    table = (0.5 * torch.randn(R, 6, C, generator=g)).to(dtype)
    row_index = torch.randint(0, R, (S,), generator=g)
    row_index[: min(S, R)] = torch.arange(min(S, R))
    weight = (1 + 0.1 * torch.randn(C, generator=g)).to(dtype)
    return tuple(t.to(device) for t in (x, table, row_index, weight))


def _nan(shape, dtype, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _check_launch(S, C, launch, with_weight, device="cpu"):
    """bf16 / fp32 and FP8 outputs of one launch shape against `modulate_naive`, strided table views as a block's."""
    for dtype in (torch.float32, torch.bfloat16):
        x, table, row_index, weight = _inputs(S, C, 3, dtype, seed=S * 1000 + C, device=device)
        w = weight if with_weight else None
        shift, scale = table[:, 3], table[:, 4]  # row stride 6C
        got = modulate_triton(x, w, shift, scale, row_index, 1e-5, out=_nan((S, C), dtype, device), launch=launch)
        torch.testing.assert_close(got, modulate_naive(x, w, shift, scale, row_index, 1e-5), **TOL[dtype])
        got = modulate_fp8_triton(x, w, shift, scale, row_index, 1e-5, out=poisoned_fp8(S, C, device), launch=launch)
        assert_fp8_close(got, modulate_naive(x, w, shift, scale, row_index, 1e-5, fp8=True))


@interpreted
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("S", [1, 3, 37])
@pytest.mark.parametrize("C,with_weight", [(97, True), (300, False)])
def test_launch_matches_naive(S, C, with_weight, launch):
    _check_launch(S, C, launch, with_weight)


def _sentinel_check(S, C, launch, device="cpu"):
    """Outputs as [S, C] views of buffers with `pad` sentinel rows after them: a program's rows past S write nothing.
    x and row_index are views of padded buffers too, so that an unmasked read past S stays in memory and the test
    fails on the sentinels rather than crashing."""
    pad = 4  # >= ROWS - 1 of every launch here
    x, table, row_index, weight = _inputs(S + pad, C, 3, torch.bfloat16, seed=S + C, device=device)
    x, row_index = x[:S], row_index[:S]
    shift, scale = table[:, 0], table[:, 1]

    buf = torch.full((S + pad, C), 7.0, dtype=torch.bfloat16, device=device)
    buf[:S] = float("nan")
    got = modulate_triton(x, weight, shift, scale, row_index, 1e-5, out=buf[:S], launch=launch)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, modulate_naive(x, weight, shift, scale, row_index, 1e-5), **TOL[torch.bfloat16])
    assert (buf[S:] == 7.0).all(), "a masked row was written"

    codes = torch.full((S + pad, C), 0x55, dtype=torch.uint8, device=device)
    codes[:S] = 0x7F  # e4m3fn NaN
    scales = torch.full((S + pad, 1), 123.0, device=device)
    scales[:S] = float("nan")
    data = codes.view(torch.float8_e4m3fn)
    got = modulate_fp8_triton(x, weight, shift, scale, row_index, 1e-5, out=(data[:S], scales[:S]), launch=launch)
    assert_fp8_close(got, modulate_naive(x, weight, shift, scale, row_index, 1e-5, fp8=True))
    assert (codes[S:] == 0x55).all(), "a masked row's codes were written"
    assert (scales[S:] == 123.0).all(), "a masked row's scale was written"


@interpreted
@pytest.mark.parametrize("S,launch", [(1, (2, 4)), (1, (4, 8)), (37, (2, 4)), (37, (4, 8)), (3, (4, 4))])
def test_tail_rows_write_nothing_past_S(S, launch):
    _sentinel_check(S, 97, launch)


@interpreted
@pytest.mark.parametrize("launch", [(2, 4), (4, 8)])
def test_out_aliasing_x(launch):
    x, table, row_index, weight = _inputs(37, 300, 3, torch.bfloat16, seed=11)
    ref = modulate_naive(x, weight, table[:, 0], table[:, 1], row_index, 1e-5)
    got = modulate_triton(x, weight, table[:, 0], table[:, 1], row_index, 1e-5, out=x, launch=launch)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, ref, **TOL[torch.bfloat16])


def test_launch_settings(monkeypatch):
    # LAUNCH applies to the FP8 output at the block width it was timed at (8192: 4097 <= C <= 8192) only.
    assert triton_impl.LAUNCH == (2, 4) and triton_impl.LAUNCH_BLOCK_C == 8192
    assert launch_settings(5376, fp8=True) == (8192, 2, 4)
    assert launch_settings(4097, fp8=True) == (8192, 2, 4)
    assert launch_settings(5376, fp8=False) == (8192, 1, 16)  # calculate_settings(5376)
    assert launch_settings(4096, fp8=True) == (4096, 1, 8)
    assert launch_settings(8193, fp8=True) == (16384, 1, 16)
    assert launch_settings(300, fp8=True) == (512, 1, 4)
    assert launch_settings(300, fp8=False, launch=(4, 8)) == (512, 4, 8)
    assert launch_settings(5376, fp8=True, launch=(1, 16)) == (8192, 1, 16)
    monkeypatch.setattr(triton_impl, "LAUNCH", None)  # the one-row launch everywhere (bench_e2e's session18)
    assert launch_settings(5376, fp8=True) == (8192, 1, 16)
    for bad in [(3, 4), (2, 0), (2, 6), (2.0, 4), (0, 4)]:
        with pytest.raises(ValueError, match="powers of two"):
            launch_settings(300, fp8=True, launch=bad)
    with pytest.raises(ValueError, match="fused limit"):
        launch_settings(65537, fp8=True)


class _Spy:
    """Stands in for `_modulate_kernel`: records each launch's grid, ROWS and num_warps, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, kwargs["ROWS"], kwargs["num_warps"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


@interpreted
def test_default_launch_reaches_the_kernel(monkeypatch):
    # Through the public `modulate`: C = 4100 is in LAUNCH's block width; S = 5 leaves the last 2-row program half
    # empty.
    S, C = 5, 4100
    x, table, row_index, weight = _inputs(S, C, 3, torch.bfloat16, seed=3)
    spy = _Spy(triton_impl._modulate_kernel)
    monkeypatch.setattr(triton_impl, "_modulate_kernel", spy)
    mod = importlib.import_module("h3render.kernels.modulate")
    monkeypatch.setattr(mod, "modulate_naive", lambda *a, **k: pytest.fail("naive path taken"))
    ref = modulate_naive(x, weight, table[:, 0], table[:, 1], row_index, 1e-5, fp8=True)

    got = modulate(x, weight, table[:, 0], table[:, 1], row_index, fp8=True, use_triton=True)
    assert spy.calls[-1] == ((3,), 2, 4)
    assert_fp8_close(tuple(got), ref)
    modulate(x, weight, table[:, 0], table[:, 1], row_index, use_triton=True)
    assert spy.calls[-1] == ((5,), 1, 16)  # bf16 output: the one-row launch
    monkeypatch.setattr(triton_impl, "LAUNCH", None)
    got = modulate(x, weight, table[:, 0], table[:, 1], row_index, fp8=True, use_triton=True)
    assert spy.calls[-1] == ((5,), 1, 16)
    assert_fp8_close(tuple(got), ref)


@compiled_cuda
def test_launches_on_cuda():
    # The interpreted cases compiled, plus the released width (C = 5,376) at every launch §28.5 timed, against the
    # reference and with sentinel rows after the outputs.
    for launch in LAUNCHES + [(1, 16), (2, 8), (4, 4)]:
        for S in (1, 3, 37):
            _check_launch(S, 97, launch, True, device="cuda")
            _check_launch(S, 300, launch, False, device="cuda")
            _sentinel_check(S, 97, launch, device="cuda")
        _check_launch(1001, 5376, launch, True, device="cuda")
        _sentinel_check(1001, 5376, launch, device="cuda")
    _check_launch(1001, 5376, None, True, device="cuda")  # the default (LAUNCH for FP8)
