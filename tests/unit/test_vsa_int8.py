"""INT8 QKᵀ in the VSA fine kernels (h3render/kernels/vsa/quant.py, `qk_int8=True`): the key pass against its torch
reference bit for bit, both fine kernels against the dequantized-codes reference on odd shapes, and the smoothing's
purpose (a channel bias on the keys, which softmax ignores, must not cost precision). CPU under TRITON_INTERPRET=1,
the compiled kernels on the device machine (TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

import pytest
import torch

from h3render.kernels.vsa import select_tiles, tile_plan, vsa_attention
from h3render.kernels.vsa.naive import block_mask, coarse_attention_naive, fine_attention_naive, pool_tiles_naive
from h3render.kernels.vsa.naive import add_gated_coarse, tile_scores
from h3render.kernels.vsa.quant import (fine_attention_int8_naive, head_mean_from_pooled, key_tiles_int8_naive,
                                        rows_int8_naive)
from h3render.kernels.vsa.quant_triton import key_tiles_int8
from tests._numerics import rel_err

FAST_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"

# Odd prefix tile count (3), odd video tile count (9), odd k (3), partial prefix and video tiles; 2 heads (the
# interpreter's time is per program, and the CI's is short).
ODD = ((70, 5), (1, 9, 9), 2, 32, 0.7)


def _qkvg(plan, heads, dim, seed, dtype, bias=0.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, gate = (torch.randn(plan.seq_len, heads, dim, generator=g) for _ in range(4))
    k = k + bias * torch.linspace(-1, 1, dim)  # a per-channel key bias: what smoothing removes
    return [x.to(dtype).to(plan.sizes.device) for x in (q, k, v, gate)]


def test_rows_int8_rounds_half_up_and_keeps_zero_rows_finite():
    x = torch.tensor([[127.0, 63.5, -63.5, 0.25], [0.0, 0.0, 0.0, 0.0]])
    codes, scale = rows_int8_naive(x)
    assert codes.tolist() == [[127, 64, -63, 0], [0, 0, 0, 0]]  # floor(x * 127 / amax + 0.5)
    assert scale[0] == 1.0 and torch.isfinite(scale).all() and scale[1] > 0


def test_key_tiles_int8_matches_reference():
    """Scales bit for bit; codes bit for bit in the interpreter, and compiled except by one at a rounding tie (bf16
    keys put x * 127 / amax on exact halves often, and the GPU fuses `x * inv + 0.5` into one rounding)."""
    plan = tile_plan((70, 5), (1, 9, 9), FAST_DEVICE)
    _, k, _, _ = _qkvg(plan, 3, 32, seed=1, dtype=torch.bfloat16, bias=4.0)
    k[5, 1] = 0  # a zero row of one head
    mean = head_mean_from_pooled(pool_tiles_naive(k, plan), plan)
    mean[1] = 0
    codes, scales = key_tiles_int8(k[:, 1:], plan, mean[1:])  # a head slice: strided rows, as under Ulysses
    # The reference on the CPU: CUDA torch divides by a scalar as a multiply by its reciprocal, not IEEE division.
    codes, scales, k, mean, plan = codes.cpu(), scales.cpu(), k.cpu(), mean.cpu(), tile_plan((70, 5), (1, 9, 9))
    ref_codes, ref_scales = key_tiles_int8_naive(k[:, 1:], plan, mean[1:])
    assert torch.equal(scales, ref_scales)
    x = (k[:, 1:].double() - mean[1:].double())  # [S, H, D]: where a code may sit on a tie
    ratio = x * 127 / x.abs().amax(-1, keepdim=True).clamp_min(1e-20)
    tie = torch.zeros(codes.shape, dtype=torch.bool)
    tie[plan.slot] = ((ratio - ratio.floor()) - 0.5).abs() < 1e-4  # the product's rounding: ~1.5e-5
    diff = (codes.int() - ref_codes.int()).abs()
    assert int(diff.max()) <= 1 and not diff[~tie].any()
    if FAST_DEVICE == "cpu":
        assert not diff.any()  # the interpreter rounds each operation as the reference does
    pad = plan.row_of_slot < 0
    assert int(pad.sum()) > 0 and not codes[pad].any() and not scales[:, pad].any()
    assert codes[plan.slot[5], 0].abs().sum() == 0  # the zero row: zero codes
    assert int(codes.abs().amax()) == 127  # each row's largest magnitude gets the full code


# Each kernel in each dtype once, the gate on and off (3 s each in the interpreter: the CI's time is short).
@pytest.mark.parametrize("tma, dtype, with_gate", [(False, torch.float32, True), (False, torch.bfloat16, False),
                                                   (True, torch.bfloat16, True), (True, torch.float32, False)])
def test_fine_int8_matches_dequantized_reference(tma, dtype, with_gate):
    from h3render.kernels.vsa.triton_impl import fine_attention_triton

    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _qkvg(plan, heads, dim, seed=3, dtype=dtype, bias=3.0)
    kp = pool_tiles_naive(k, plan)
    scores = tile_scores(pool_tiles_naive(q, plan), kp)
    mean = head_mean_from_pooled(kp, plan)
    mask = block_mask(scores, plan.num_prefix, sparsity)
    ref = fine_attention_int8_naive(q, k, v, mask, plan, mean)
    gate = coarse = None
    if with_gate:
        gate, coarse = g, coarse_attention_naive(scores, pool_tiles_naive(v, plan))
        ref = add_gated_coarse(ref, coarse, gate, plan)
    out = torch.full_like(q, float("nan"))
    fine_attention_triton(q, k, v, plan, select_tiles(scores, plan, sparsity), gate, coarse, out=out, tma=tma,
                          qk_int8=True, k_mean=mean)
    # fp32: the same codes and scales, an exact int dot, fp32 operation order (3e-7 measured in the interpreter);
    # compiled, a code may sit one apart on a rounding tie (fused multiply-add). A wrong score or scale is off by far
    # more.
    fp32_tol = 1e-5 if FAST_DEVICE == "cpu" else 1e-3
    assert rel_err(out, ref) < (fp32_tol if dtype == torch.float32 else 1e-2)
    true = fine_attention_naive(q, k, v, mask, plan)  # unquantized: int8 costs something, but not much
    if with_gate:
        true = add_gated_coarse(true, coarse, gate, plan)
    assert 1e-4 < rel_err(out, true) < 2e-2


def test_smoothing_keeps_a_biased_key_precise():
    """A key bias shifts every score of a query row by the same amount (softmax ignores it) but widens each key row's
    range; quantized after the mean is removed, the error stays that of unbiased keys."""
    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, "cpu")
    q, k, v, _ = _qkvg(plan, heads, dim, seed=4, dtype=torch.float32, bias=30.0)
    kp = pool_tiles_naive(k, plan)
    mask = block_mask(tile_scores(pool_tiles_naive(q, plan), kp), plan.num_prefix, sparsity)
    true = fine_attention_naive(q, k, v, mask, plan)
    smoothed = rel_err(fine_attention_int8_naive(q, k, v, mask, plan, head_mean_from_pooled(kp, plan)), true)
    raw = rel_err(fine_attention_int8_naive(q, k, v, mask, plan, None), true)
    assert smoothed < 2e-2 and raw > 3 * smoothed


def test_vsa_attention_int8_triton_equals_torch_fine_stage():
    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, gate = _qkvg(plan, heads, dim, seed=5, dtype=torch.float32, bias=2.0)
    fast = vsa_attention(q, k, v, gate, plan, sparsity, fine="triton", qk_int8=True)
    ref = vsa_attention(q, k, v, gate, plan, sparsity, fine="torch", qk_int8=True)
    plain = vsa_attention(q, k, v, gate, plan, sparsity, fine="torch")
    assert rel_err(fast, ref) < (1e-5 if FAST_DEVICE == "cpu" else 1e-3) and rel_err(ref, plain) > 2e-3  # the torch stage really quantized
    with pytest.raises(ValueError, match="not flex"):
        vsa_attention(q, k, v, gate, plan, sparsity, fine="flex", qk_int8=True)
