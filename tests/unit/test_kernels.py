"""Triton kernels vs their torch references (under TRITON_INTERPRET=1 on CPU), and the references vs diffusers.

Every Triton call writes into a NaN-poisoned output, so an element the kernel fails to write fails the test.
"""

import importlib
import os

import pytest
import torch

from h3render.kernels import gated_residual, modulate, qk_norm_rope, qk_norm_rope_qkv, swiglu
from h3render.kernels.gated_residual import gated_residual_naive
from h3render.kernels.gated_residual.triton_impl import gated_residual_triton
from h3render.kernels.modulate import modulate_naive
from h3render.kernels.modulate.triton_impl import modulate_triton
from h3render.kernels.qk_norm_rope import qk_norm_rope_naive
from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_triton
from h3render.kernels.swiglu import swiglu_naive
from h3render.kernels.swiglu.triton_impl import swiglu_triton
from h3render.kernels.utils import calculate_settings
from tests._markers import compiled_cuda, interpreted
from tests._numerics import rel_err

# fp32: both sides do the same fp32 math in a different order. bf16: both round an fp32 result once, so they can
# differ by one bf16 ulp (2**-8 relative) where the fp32 values straddle a rounding boundary.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]
# `interpreted` cases: CPU tensors through the interpreter; a GPU run with TRITON_INTERPRET=0 skips them and runs
# the compiled kernels on CUDA tensors instead (test_kernels_on_cuda_match_naive).


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


@interpreted
def test_interpreter_is_on():
    # CPU tensors can only reach the @triton.jit code through the interpreter; conftest.py turns it on.
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_calculate_settings():
    assert calculate_settings(5376) == (8192, 16)
    assert calculate_settings(128) == (128, 4)
    assert calculate_settings(2048) == (2048, 8)
    with pytest.raises(ValueError, match="fused limit"):
        calculate_settings(70000)


# ---------------------------------------------------------------- qk_norm_rope


def _qkv_inputs(S, H, D, R, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    if layout == "interleaved":  # official checkpoint: per head [q k v]
        qkv = torch.randn(S, H * 3 * D, generator=g).to(dtype).view(S, H, 3, D)
    else:  # stacked [q; k; v]
        qkv = torch.randn(S, 3 * H * D, generator=g).to(dtype).view(S, 3, H, D).transpose(1, 2)
    q_w = 1 + 0.1 * torch.randn(D, generator=g)
    k_w = 1 + 0.1 * torch.randn(D, generator=g)
    angles = torch.rand(S, R // 2, generator=g) * 50
    angles = torch.cat((angles, angles), dim=-1)  # [S, R], as the model builds it for rotate_half
    return qkv, q_w.to(dtype), k_w.to(dtype), angles.cos(), angles.sin()


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "S,H,D,R,layout",
    [
        (1, 1, 8, 6, "interleaved"),
        (37, 3, 40, 24, "stacked"),
        (129, 2, 128, 96, "interleaved"),
        (5, 56, 128, 96, "stacked"),
    ],
)
def test_qk_norm_rope_triton_matches_naive(S, H, D, R, layout, dtype):
    qkv, q_w, k_w, cos, sin = _qkv_inputs(S, H, D, R, dtype, layout, seed=S * 7 + H)
    q, k, v = qkv.unbind(2)
    out = tuple(poisoned((S, H, D), dtype) for _ in range(3))
    got = qk_norm_rope_triton(q, k, v, q_w, k_w, cos, sin, 1e-5, out=out)
    ref = qk_norm_rope_naive(q, k, v, q_w, k_w, cos, sin, 1e-5)
    for name, a, b in zip("qkv", got, ref):
        assert a.is_contiguous() and a.shape == (S, H, D), name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"{name} differs")
    # v is a plain copy: bit-exact.
    assert torch.equal(got[2], v)


@interpreted
def test_qk_norm_rope_without_v_and_dispatch(monkeypatch):
    S, H, D, R = 37, 2, 32, 16
    qkv, q_w, k_w, cos, sin = _qkv_inputs(S, H, D, R, torch.float32, "interleaved", seed=3)
    q, k, _ = qkv.unbind(2)
    ref_q, ref_k, _ = qk_norm_rope_naive(q, k, None, q_w, k_w, cos, sin, 1e-5)
    # Forcing Triton on CPU must never fall back to the reference.
    mod = importlib.import_module("h3render.kernels.qk_norm_rope")  # the package re-exports a function of the same name

    monkeypatch.setattr(mod, "qk_norm_rope_naive", lambda *a: pytest.fail("naive path taken"))
    got_q, got_k, got_v = qk_norm_rope(q, k, None, q_w, k_w, cos, sin, use_triton=True)
    assert got_v is None
    torch.testing.assert_close(got_q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(got_k, ref_k, **TOL[torch.float32])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_without_rope(dtype):
    # cos = sin = None (the token refiner): normalize only, with every element written.
    S, H, D = 37, 3, 40
    qkv, q_w, k_w, _, _ = _qkv_inputs(S, H, D, 8, dtype, "stacked", seed=2)
    q, k, v = qkv.unbind(2)
    out = tuple(poisoned((S, H, D), dtype) for _ in range(3))
    got = qk_norm_rope_triton(q, k, v, q_w, k_w, None, None, 1e-5, out=out)
    ref = qk_norm_rope_naive(q, k, v, q_w, k_w, None, None, 1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TOL[dtype])
    x = q.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * q_w.float()
    torch.testing.assert_close(ref[0], normed.to(dtype), **TOL[dtype])


@interpreted
def test_qk_norm_rope_passes_unrotated_channels_and_is_rotation():
    # Channels R..D are only normalized; a rotation keeps each head's rotary-part norm.
    S, H, D, R = 9, 2, 16, 8
    qkv, q_w, k_w, cos, sin = _qkv_inputs(S, H, D, R, torch.float32, "interleaved", seed=11)
    ones = torch.ones(D)
    q, k, v = qk_norm_rope_qkv(qkv, ones, ones, cos, sin, use_triton=True)
    x = qkv[:, :, 0].float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(q[..., R:], normed[..., R:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q[..., :R].norm(dim=-1), normed[..., :R].norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(q[..., :R], normed[..., :R], atol=1e-3)


def test_qk_norm_rope_rejects_bad_input():
    qkv, q_w, k_w, cos, sin = _qkv_inputs(4, 2, 16, 8, torch.float32, "interleaved", seed=0)
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope_qkv(qkv.flatten(2), q_w, k_w, cos, sin)
    with pytest.raises(ValueError, match="even"):
        qk_norm_rope_qkv(qkv, q_w, k_w, cos[:, :7], sin[:, :7])
    with pytest.raises(ValueError, match="cos and sin"):
        qk_norm_rope_qkv(qkv, q_w, k_w, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="k_weight"):
        qk_norm_rope_qkv(qkv, q_w, k_w[:8], cos, sin)
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope_qkv(qkv, q_w, k_w, cos, None)


def _slotted_call(qkv, q_w, k_w, cos, sin, use_triton, extra_rows=11, seed=0):
    """`qk_norm_rope` with v scattered by a shuffled row map into a random [S + extra_rows, H, D] buffer: (q, k, v
    buffer, the buffer before the call, v_slot). The DiT's form: q, k, v strided views of the projection output."""
    q, k, v = qkv.unbind(2)
    S, H, D = q.shape
    g = torch.Generator().manual_seed(seed)
    v_slot = torch.randperm(S + extra_rows, generator=g)[:S]  # distinct, out of order, some rows never hit
    buf = torch.randn(S + extra_rows, H, D, generator=g).to(v.dtype)
    before = buf.clone()
    out = (poisoned((S, H, D), q.dtype), poisoned((S, H, D), q.dtype), buf)
    got = qk_norm_rope(q, k, v, q_w, k_w, cos, sin, out=out, v_slot=v_slot, use_triton=use_triton)
    assert got[2] is buf
    return got[0], got[1], buf, before, v_slot


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=interpreted)])
@pytest.mark.parametrize("D, rope, weights, dtype", [(16, True, True, torch.float32), (32, False, True, torch.bfloat16),
                                                     (32, True, False, torch.float32), (16, False, False, torch.bfloat16)])
def test_qk_norm_rope_v_slot_scatters_v_rows(use_triton, D, rope, weights, dtype):
    """With `v_slot` v row s lands in row v_slot[s] of the buffer, bit for bit, and nothing else of the buffer moves;
    q and k are the un-slotted call's."""
    S, H, R = 37, 3, 8
    qkv, q_w, k_w, cos, sin = _qkv_inputs(S, H, D, R, dtype, "interleaved", seed=D + rope)
    if not rope:
        cos = sin = None
    if not weights:
        q_w = k_w = None
    ref_q, ref_k, ref_v = qk_norm_rope(*qkv.unbind(2), q_w, k_w, cos, sin, use_triton=use_triton)
    q, k, buf, before, v_slot = _slotted_call(qkv, q_w, k_w, cos, sin, use_triton, seed=D)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(buf[v_slot], ref_v) and torch.equal(ref_v, qkv[:, :, 2])
    untouched = torch.ones(buf.shape[0], dtype=torch.bool)
    untouched[v_slot] = False
    assert int(untouched.sum()) == 11 and torch.equal(buf[untouched], before[untouched])


@interpreted
def test_qk_norm_rope_v_slot_triton_matches_naive():
    qkv, q_w, k_w, cos, sin = _qkv_inputs(37, 3, 32, 16, torch.bfloat16, "stacked", seed=5)
    triton_out = _slotted_call(qkv, q_w, k_w, cos, sin, use_triton=True, seed=1)
    naive_out = _slotted_call(qkv, q_w, k_w, cos, sin, use_triton=False, seed=1)
    for a, b in zip(triton_out[:2], naive_out[:2]):
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])
    assert torch.equal(triton_out[2], naive_out[2])


def test_qk_norm_rope_v_slot_rejects_bad_input(monkeypatch):
    S, H, D = 37, 3, 16
    qkv, q_w, k_w, cos, sin = _qkv_inputs(S, H, D, 8, torch.float32, "interleaved", seed=0)
    q, k, v = qkv.unbind(2)
    slot = torch.arange(S)

    def call(q=q, k=k, v=v, cos=cos, sin=sin, out="default", v_slot=slot, **kw):
        if out == "default":
            out = (torch.empty(q.shape), torch.empty(q.shape), torch.empty(S + 3, H, D))
        return qk_norm_rope(q, k, v, q_w, k_w, cos, sin, out=out, v_slot=v_slot, **kw)

    with pytest.raises(ValueError, match="needs v and out"):
        call(out=None)
    with pytest.raises(ValueError, match="needs v and out"):
        call(v=None, out=(torch.empty(q.shape), torch.empty(q.shape), None))
    with pytest.raises(ValueError, match=r"must be \[S=37\]"):
        call(v_slot=slot[:-1])
    with pytest.raises(ValueError, match=r"must be \[S=37\]"):
        call(v_slot=slot.float())
    with pytest.raises(ValueError, match="one item"):
        q4, k4, v4 = (t[None] for t in (q, k, v))
        call(q=q4, k=k4, v=v4, out=tuple(torch.empty(q4.shape) for _ in range(3)))
    for buf in (torch.empty(S - 1, H, D), torch.empty(S, H + 1, D), torch.empty(S, D, H).transpose(1, 2),
                torch.empty(S, H, D, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="the v buffer must be"):
            call(out=(torch.empty(q.shape), torch.empty(q.shape), buf))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled op has no v to scatter
    with pytest.raises(ValueError, match="torch.compile"):
        call(use_triton=True)


# ---------------------------------------------------------------- modulate / gated_residual


def _rows(S, C, R, dtype, index_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(S, C, generator=g)).to(dtype)
    table = (0.5 * torch.randn(R, 6, C, generator=g)).to(dtype)  # [R, 6, C]: one block's AdaLN table
    row_index = torch.randint(0, R, (S,), generator=g).to(index_dtype)
    return x, table, row_index


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "S,C,R,with_weight,index_dtype",
    [(1, 7, 1, True, torch.int64), (37, 48, 6, False, torch.int32), (129, 1000, 9, True, torch.int64),
     (3, 5376, 6, True, torch.int64)],
)
def test_modulate_triton_matches_naive(S, C, R, with_weight, index_dtype, dtype):
    x, table, row_index = _rows(S, C, R, dtype, index_dtype, seed=S + C)
    weight = (1 + 0.1 * torch.randn(C)).to(dtype) if with_weight else None
    shift, scale = table[:, 3], table[:, 4]  # FFN slots: strided views with row stride 6C
    got = modulate_triton(x, weight, shift, scale, row_index, 1e-5, out=poisoned((S, C), dtype))
    ref = modulate_naive(x, weight, shift, scale, row_index, 1e-5)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,C,R", [(1, 7, 1), (37, 48, 6), (129, 2500, 3), (3, 5376, 6)])
def test_gated_residual_triton_matches_naive(S, C, R, dtype):
    x, table, row_index = _rows(S, C, R, dtype, torch.int64, seed=S * C)
    y = torch.randn(S, C, generator=torch.Generator().manual_seed(S)).to(dtype)
    got = gated_residual_triton(x, y, table[:, 2], row_index, out=poisoned((S, C), dtype))
    ref = gated_residual_naive(x, y, table[:, 2], row_index)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@interpreted
def test_gated_residual_in_place_and_dispatch(monkeypatch):
    x, table, row_index = _rows(37, 2100, 6, torch.float32, torch.int64, seed=5)
    y = torch.randn_like(x)
    ref = gated_residual_naive(x, y, table[:, 5], row_index)
    mod = importlib.import_module("h3render.kernels.gated_residual")  # the package re-exports a function of the same name

    monkeypatch.setattr(mod, "gated_residual_naive", lambda *a: pytest.fail("naive path taken"))
    got = gated_residual(x, y, table[:, 5], row_index, out=x, use_triton=True)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, ref, **TOL[torch.float32])


@interpreted
def test_modulate_dispatch_and_errors(monkeypatch):
    x, table, row_index = _rows(5, 16, 3, torch.float32, torch.int64, seed=1)
    ref = modulate_naive(x, None, table[:, 0], table[:, 1], row_index, 1e-5)
    mod = importlib.import_module("h3render.kernels.modulate")  # the package re-exports a function of the same name

    monkeypatch.setattr(mod, "modulate_naive", lambda *a: pytest.fail("naive path taken"))
    torch.testing.assert_close(modulate(x, None, table[:, 0], table[:, 1], row_index, use_triton=True), ref)
    with pytest.raises(ValueError, match="row_index"):
        modulate(x, None, table[:, 0], table[:, 1], row_index[:4])
    with pytest.raises(ValueError, match="row_index"):
        modulate(x, None, table[:, 0], table[:, 1], row_index.float())
    with pytest.raises(ValueError, match="shift"):
        modulate(x, None, table[:, 0, :8], table[:, 1], row_index)
    with pytest.raises(ValueError, match="unit stride"):
        modulate(x, None, torch.randn(16, 3).t(), table[:, 1], row_index)
    with pytest.raises(ValueError, match="y must match"):
        gated_residual(x, x[:, :8], table[:, 2], row_index)


# ---------------------------------------------------------------- swiglu


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,F", [(1, 1), (37, 45), (129, 2500)])
def test_swiglu_triton_matches_naive(S, F, dtype):
    h = (2 * torch.randn(S, 2 * F, generator=torch.Generator().manual_seed(S + F))).to(dtype)
    got = swiglu_triton(h, out=poisoned((S, F), dtype))
    torch.testing.assert_close(got, swiglu_naive(h), **TOL[dtype])


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_value_first_with_bias_triton_matches_naive(dtype):
    """The video VAE's layout ([value | gate]) with fc1's bias added in fp32, through the bf16-output kernel."""
    g = torch.Generator().manual_seed(11)
    h, bias = (2 * torch.randn(37, 90, generator=g)).to(dtype), torch.randn(90, generator=g).to(dtype)
    got = swiglu_triton(h, out=poisoned((37, 45), dtype), value_first=True, bias=bias)
    torch.testing.assert_close(got, swiglu_naive(h, value_first=True, bias=bias), **TOL[dtype])


@interpreted
def test_swiglu_strided_rows_and_errors(monkeypatch):
    h = torch.randn(37, 100)[:, :90]  # row stride 100, unit column stride
    mod = importlib.import_module("h3render.kernels.swiglu")  # the package re-exports a function of the same name

    ref = swiglu_naive(h)
    monkeypatch.setattr(mod, "swiglu_naive", lambda *a: pytest.fail("naive path taken"))
    torch.testing.assert_close(swiglu(h, use_triton=True), ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="unit stride"):
        swiglu(torch.randn(8, 3).t())


# ---------------------------------------------------------------- compiled, on CUDA (GPU machine, TRITON_INTERPRET=0)


@compiled_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_on_cuda_match_naive(dtype):
    # The interpreted tests' odd shapes, compiled: every launcher writes into a NaN-poisoned output on the GPU.
    def cuda(*ts):
        return tuple(None if t is None else t.cuda() for t in ts)

    def nan(shape):
        return poisoned(shape, dtype).cuda()

    for S, H, D, R, layout in ((1, 1, 8, 6, "interleaved"), (37, 3, 40, 24, "stacked"), (5, 56, 128, 96, "stacked")):
        qkv, q_w, k_w, cos, sin = cuda(*_qkv_inputs(S, H, D, R, dtype, layout, seed=S * 7 + H))
        q, k, v = qkv.unbind(2)
        got = qk_norm_rope_triton(q, k, v, q_w, k_w, cos, sin, 1e-5, out=tuple(nan((S, H, D)) for _ in range(3)))
        for a, b in zip(got, qk_norm_rope_naive(q, k, v, q_w, k_w, cos, sin, 1e-5)):
            torch.testing.assert_close(a, b, **TOL[dtype])
        v_slot, buf = torch.randperm(S + 5, device="cuda")[:S], nan((S + 5, H, D))  # v scattered by a row map
        slotted = qk_norm_rope_triton(q, k, v, q_w, k_w, cos, sin, 1e-5, out=(nan((S, H, D)), nan((S, H, D)), buf),
                                      v_slot=v_slot)
        assert torch.equal(slotted[0], got[0]) and torch.equal(buf[v_slot], v)
    for S, C, R in ((1, 7, 1), (37, 48, 6), (129, 2500, 3), (3, 5376, 6)):
        x, table, row_index = cuda(*_rows(S, C, R, dtype, torch.int64, seed=S + C))
        weight = (1 + 0.1 * torch.randn(C, device="cuda")).to(dtype)
        got = modulate_triton(x, weight, table[:, 3], table[:, 4], row_index, 1e-5, out=nan((S, C)))
        torch.testing.assert_close(got, modulate_naive(x, weight, table[:, 3], table[:, 4], row_index, 1e-5),
                                   **TOL[dtype])
        y = torch.randn(S, C, device="cuda").to(dtype)
        got = gated_residual_triton(x, y, table[:, 2], row_index, out=nan((S, C)))
        torch.testing.assert_close(got, gated_residual_naive(x, y, table[:, 2], row_index), **TOL[dtype])
    for S, F in ((1, 1), (37, 45), (129, 2500)):
        h = (2 * torch.randn(S, 2 * F, device="cuda")).to(dtype)
        torch.testing.assert_close(swiglu_triton(h, out=nan((S, F))), swiglu_naive(h), **TOL[dtype])
        bias = torch.randn(2 * F, device="cuda").to(dtype)
        torch.testing.assert_close(swiglu_triton(h, out=nan((S, F)), value_first=True, bias=bias),
                                   swiglu_naive(h, value_first=True, bias=bias), **TOL[dtype])


# ---------------------------------------------------------------- parity with diffusers (fp32)


def test_naive_references_match_diffusers_parts():
    from diffusers.models.activations import SwiGLU
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3AdaLayerNormOut,
        MiniMaxH3Attention,
        MiniMaxH3RotaryPosEmbed,
        _apply_rotary_emb,
    )

    torch.manual_seed(0)
    S, C, H, D = 37, 48, 2, 32
    attn = MiniMaxH3Attention(hidden_size=C, heads=H, dim_head=D)
    for norm in (attn.norm_q, attn.norm_k):
        torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    positions = torch.randn(S, 3) * 20
    cos, sin = MiniMaxH3RotaryPosEmbed(rope_freq_dim=4)(positions)  # [S, 24]
    q, k = torch.randn(2, S, H, D).unbind(0)
    ref_q = _apply_rotary_emb(attn.norm_q(q)[None], cos, sin)[0]
    ref_k = _apply_rotary_emb(attn.norm_k(k)[None], cos, sin)[0]
    our_q, our_k, _ = qk_norm_rope(q, k, None, attn.norm_q.weight, attn.norm_k.weight, cos, sin, 1e-5, use_triton=False)
    err_q, err_k = rel_err(our_q, ref_q), rel_err(our_k, ref_k)
    print(f"qk_norm_rope vs diffusers: rel err q {err_q:.2e} k {err_k:.2e}")
    assert err_q <= 1e-5 and err_k <= 1e-5

    K, T = 2, 16
    norm_out = MiniMaxH3AdaLayerNormOut(hidden_size=C, time_embed_dim=T, eps=1e-5)
    torch.nn.init.normal_(norm_out.norm.weight, 1.0, 0.2)
    temb = torch.randn(K, T)
    x = torch.randn(S, C) * 3
    timestep_indices = torch.randint(0, K, (S,))
    ref = norm_out(x, temb, timestep_indices)
    table = norm_out.linear(torch.nn.functional.silu(temb)).view(K, 2, C)  # shift, scale
    ours = modulate(x, norm_out.norm.weight, table[:, 0], table[:, 1], timestep_indices, 1e-5, use_triton=False)
    err = rel_err(ours, ref)
    print(f"modulate vs diffusers norm_out: rel err {err:.2e}")
    assert err <= 1e-5

    F = 40
    act = SwiGLU(C, F, bias=False)  # fc1 rows [value; gate]
    h_in = torch.randn(S, C)
    ref = act(h_in)
    value_w, gate_w = act.proj.weight.chunk(2, dim=0)
    ours = swiglu(h_in @ torch.cat((gate_w, value_w)).T, use_triton=False)  # checkpoint rows [gate; value]
    err = rel_err(ours, ref)
    print(f"swiglu vs diffusers SwiGLU: rel err {err:.2e}")
    assert err <= 1e-5


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=interpreted)])
def test_block_from_kernels_matches_diffusers_block(use_triton):
    """One DiT block composed from the kernels and `attention` equals diffusers' block on the same weights."""
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3RotaryPosEmbed,
        MiniMaxH3TransformerBlock,
    )

    from h3render.models.attention import attention

    torch.manual_seed(0)
    S, C, H, D, F, T, K = 37, 48, 2, 32, 64, 16, 2
    block = MiniMaxH3TransformerBlock(C, H, D, F, T, norm_eps=1e-5, qk_norm_eps=1e-5).eval()
    for name, p in block.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, 1.0, 0.2)
    temb = torch.randn(K, T)
    timestep_indices = torch.randint(0, K, (S,))
    tags = torch.randint(0, 3, (S,))
    row_index = timestep_indices * 3 + tags
    cos, sin = MiniMaxH3RotaryPosEmbed(rope_freq_dim=4)(torch.randn(S, 3) * 20)
    x = torch.randn(1, S, C)

    with torch.no_grad():
        ref = block(x, temb, row_index, (cos, sin))[0]

        # Checkpoint-layout weights: qkv interleaved per head, fc1 gate-first.
        a = block.attn
        w_qkv = torch.stack([w.view(H, D, C) for w in (a.to_q.weight, a.to_k.weight, a.to_v.weight)], dim=1)
        w_qkv = w_qkv.reshape(H * 3 * D, C)  # rows [head0: q k v, head1: q k v, ...]
        value_w, gate_w = block.ff.net[0].proj.weight.chunk(2, dim=0)
        w_fc1 = torch.cat((gate_w, value_w))
        table = block.adaln_proj.linear(torch.nn.functional.silu(temb)).view(K * 3, 6, C)

        h = x[0].clone()
        n = modulate(h, block.norm1.weight, table[:, 0], table[:, 1], row_index, use_triton=use_triton)
        qkv = (n @ w_qkv.T).view(S, H, 3, D)
        q, k, v = qk_norm_rope_qkv(qkv, a.norm_q.weight, a.norm_k.weight, cos, sin, use_triton=use_triton)
        o = attention(q[None], k[None], v[None])[0].reshape(S, H * D) @ a.to_out[0].weight.T
        h = gated_residual(h, o, table[:, 2], row_index, out=h, use_triton=use_triton)
        n = modulate(h, block.norm2.weight, table[:, 3], table[:, 4], row_index, use_triton=use_triton)
        f = swiglu(n @ w_fc1.T, use_triton=use_triton) @ block.ff.net[2].weight.T
        h = gated_residual(h, f, table[:, 5], row_index, out=h, use_triton=use_triton)

    err = rel_err(h, ref)
    print(f"block from kernels (use_triton={use_triton}) vs diffusers block: rel err {err:.2e}")
    assert err <= 1e-5
