"""`qk_norm_rope` writing into any-stride outputs, q and k themselves included (the DiT normalizes q and k inside its
interleaved qkv projection output, `models.dit.Attention.forward`): the same values as new contiguous outputs, bit
for bit, v untouched where it was not asked for. Triton under TRITON_INTERPRET=1 on CPU, compiled on the device."""

from __future__ import annotations

import os

import pytest
import torch

from h3render.kernels import qk_norm_rope
from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_triton

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _qkv(shape, seed, dtype):
    """An interleaved projection output [*lead, H, 3, D] (the DiT's per-head q|k|v layout) and cos/sin [S, R]."""
    *lead, h, d, r = shape
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(*lead, h, 3, d, generator=g)).to(dtype).to(DEVICE)
    angles = torch.rand(lead[-1], r // 2, generator=g) * 50
    angles = torch.cat([angles, angles], dim=-1).to(DEVICE)
    w = (1 + 0.1 * torch.randn(2, d, generator=g)).to(dtype).to(DEVICE)
    return qkv, angles.cos(), angles.sin(), w


@pytest.mark.parametrize("shape, dtype, weighted, rope", [
    ((37, 3, 32, 24), torch.bfloat16, True, True),  # [S, H, D], R < D (the DiT's form, odd sizes)
    ((2, 19, 5, 16, 16), torch.float32, False, True),  # [B, S, H, D] items sharing cos/sin (the VAE's form)
    ((11, 4, 64, 0), torch.bfloat16, True, False),  # norm only (the token refiner)
])
def test_in_place_is_the_out_of_place_result_and_leaves_v(shape, dtype, weighted, rope):
    qkv, cos, sin, w = _qkv(shape if rope else (*shape[:-1], 2), seed=sum(shape), dtype=dtype)
    cos, sin = (cos, sin) if rope else (None, None)
    qw, kw = (w[0], w[1]) if weighted else (None, None)
    q, k, v = qkv.unbind(-2)  # strided views
    fresh_q, fresh_k, _ = qk_norm_rope_triton(q, k, None, qw, kw, cos, sin, 1e-5)
    v_before = v.clone()
    got = qk_norm_rope_triton(q, k, None, qw, kw, cos, sin, 1e-5, out=(q, k, None))
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()
    assert torch.equal(q, fresh_q) and torch.equal(k, fresh_k)
    assert torch.equal(v, v_before)
    # And the public function on both paths (the torch reference computes first, then copies into out).
    for use_triton in (True, False):
        qkv2 = _qkv(shape if rope else (*shape[:-1], 2), seed=sum(shape), dtype=dtype)[0]
        q2, k2, _ = qkv2.unbind(-2)
        qk_norm_rope(q2, k2, None, qw, kw, cos, sin, out=(q2, k2, None), use_triton=use_triton)
        if use_triton:
            assert torch.equal(q2, fresh_q) and torch.equal(k2, fresh_k)
        else:
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(q2.float(), fresh_q.float(), rtol=tol, atol=tol)
            torch.testing.assert_close(k2.float(), fresh_k.float(), rtol=tol, atol=tol)


def test_strided_outputs_get_the_values_at_their_strides():
    qkv, cos, sin, w = _qkv((29, 3, 32, 16), seed=5, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(-2)
    fresh = qk_norm_rope_triton(q, k, v, w[0], w[1], cos, sin, 1e-5)
    dst = torch.full((29, 3, 3, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)  # [S, 3, H, D]
    outs = tuple(dst[:, i] for i in range(3))  # row stride 3*H*D, head stride D
    qk_norm_rope_triton(q, k, v, w[0], w[1], cos, sin, 1e-5, out=outs)
    for got, want in zip(outs, fresh):
        assert torch.equal(got, want)


def test_out_must_match_where_an_input_is_given():
    qkv, cos, sin, w = _qkv((7, 2, 16, 8), seed=1, dtype=torch.float32)
    q, k, v = qkv.unbind(-2)
    with pytest.raises(ValueError, match=r"out\[2\]"):
        qk_norm_rope(q, k, None, w[0], w[1], cos, sin, out=(q, k, v))
    with pytest.raises(ValueError, match=r"out\[0\]"):
        qk_norm_rope(q, k, None, w[0], w[1], cos, sin, out=(q[:3], k, None))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        qk_norm_rope(q, k, None, w[0], w[1], cos, sin, out=(q, k.double(), None))
