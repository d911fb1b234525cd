"""VSA's fused prep pass (`kernels.vsa.vsa_prep`, h3render/kernels/vsa/prep_triton.py): q/k norm + RoPE, v in tile
order and the three fp32 tile means in one pass, against the unfused path it replaces (`qk_norm_rope(..., v_slot=)`
into `empty_tiles`, then `pool_tiles_triton` three times) and its torch reference; `vsa_attention(pooled=)`; and the
DiT with `Attention.vsa_fused_prep` on and off.

Triton runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py), or compiled on CUDA tensors where the run
has a GPU and TRITON_INTERPRET=0 (`FAST_DEVICE`, as tests/unit/test_vsa.py)."""

from __future__ import annotations

import os

import pytest
import torch

from h3render.kernels.qk_norm_rope import qk_norm_rope
from h3render.kernels.vsa import empty_tiles, tile_plan, vsa_attention, vsa_prep
from h3render.kernels.vsa.naive import pool_tiles_naive
from h3render.kernels.vsa.tiles import to_tiles
from tests._markers import compiled_cuda, interpreted
from tests._numerics import rel_err

FAST_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
F32, BF16 = torch.float32, torch.bfloat16
# Prefix 5 + 70 rows -> tiles of 5, 64 and 6 rows; video grid (5, 6, 9) -> 4x4x4 boxes cut at t 4+1, h 4+2,
# w 4+4+1: tile sizes 64, 32, 16, 8, 4 and 2 among others, which ROWS = 4 or 8 do not all divide.
PREFIX, GRID = (5, 70), (5, 6, 9)
# qk_norm_rope's two implementations differ by fp32 order (fp32) or one bf16 ulp where that straddles a rounding
# boundary (tests/unit/test_kernels.py's TOL).
TOL = {F32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=1e-2, rtol=1e-2)}


def _inputs(heads, dim, rope, weights, dtype, layout="interleaved", seed=0, device=FAST_DEVICE, rot=None,
            prefix=PREFIX):
    """(plan, q, k, v strided [S, H, D] views of one qkv projection output, q_weight, k_weight, cos, sin); `rot`
    rotary channels (default dim - 4: a partial rotary part, as the released R = 96 of D = 128)."""
    plan = tile_plan(prefix, GRID, device)
    s = plan.seq_len
    g = torch.Generator().manual_seed(seed)
    if layout == "interleaved":  # the released checkpoint: per head [q k v]
        qkv = torch.randn(s, heads, 3, dim, generator=g).to(dtype).to(device)
    else:  # a stacked [q; k; v] projection: [S, 3, H, D] seen as [S, H, 3, D]
        qkv = torch.randn(s, 3, heads, dim, generator=g).to(dtype).to(device).transpose(1, 2)
    q, k, v = qkv.unbind(2)
    q_w = k_w = cos = sin = None
    if weights:
        q_w, k_w = ((1 + 0.1 * torch.randn(dim, generator=g)).to(dtype).to(device) for _ in range(2))
    if rope:
        angles = torch.rand(s, (rot or dim - 4) // 2, generator=g) * 50
        angles = torch.cat((angles, angles), dim=-1).to(device)
        cos, sin = angles.cos(), angles.sin()
    return plan, q, k, v, q_w, k_w, cos, sin


def _unfused(plan, q, k, v, q_w, k_w, cos, sin):
    """The path `vsa_prep` replaces: qk_norm_rope with v scattered into `empty_tiles`, then the three pools."""
    s, heads, dim = q.shape
    buffers = (q.new_empty(q.shape), k.new_empty(k.shape), empty_tiles(plan, heads, dim, v.dtype, v.device))
    q_out, k_out, v_tiles = qk_norm_rope(q, k, v, q_w, k_w, cos, sin, 1e-5, out=buffers, v_slot=plan.slot,
                                         use_triton=True)
    return (q_out, k_out, v_tiles, *_unfused_pools(plan, q_out, k_out, v_tiles))


def _unfused_pools(plan, q_out, k_out, v_tiles):
    """The three pool passes `vsa_attention` runs without `pooled`: packed q, k and v in tile order."""
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton

    return pool_tiles_triton(q_out, plan), pool_tiles_triton(k_out, plan), pool_tiles_triton(v_tiles, plan, tiled=True)


def _assert_qk_norm_ropes(got, ref):
    """`got` (q or k from `vsa_prep`) is qk_norm_rope's Triton output `ref`: bit for bit in the interpreter; compiled
    (CUDA), within one rounding at the small head dims here, where the two kernels may spread a head's 16 or 32
    channels over other lanes and so sum the norm's squares in another order (the released geometry's bits:
    `test_vsa_prep_on_the_gpu_writes_qk_norm_ropes_bits`)."""
    if got.is_cuda:
        torch.testing.assert_close(got, ref, **TOL[got.dtype])
    else:
        assert torch.equal(got, ref)


def _poisoned_out(plan, heads, dim, dtype):
    return tuple(torch.full(shape, float("nan"), dtype=dtype, device=FAST_DEVICE)
                 for shape in ((plan.seq_len, heads, dim),) * 2 + ((plan.padded_len, heads, dim),))


def _check_means(got, stored, plan):
    """`got` [H, n, D] fp32 is the tile mean of `stored` (the written tensor, packed [S, H, D]) to fp32 summation
    order: against an fp64 mean of the same stored values, within 1e-6 of the largest mean (a sum of <= 64 terms of
    unit scale in fp32 is off by a few 1e-7 at most). Summing the unrounded fp32 values instead would be off by the
    bf16 rounding, ~1e-3."""
    exact = pool_tiles_naive(stored.double(), plan)  # [H, n, D] float64 (the reference sums in the input dtype)
    assert got.dtype == torch.float32 and got.shape == exact.shape and got.is_contiguous()
    err = float((got.double() - exact).abs().max() / exact.abs().max())
    assert err <= 1e-6, err


# (heads, dim, rope, weights, dtype, layout, rows, block_h, preallocated out): H = 3 and 5 with head blocks that
# leave masked heads, D = 16 and 32, both qkv layouts, ROWS from 1 to a whole tile.
CASES = [(3, 16, True, True, F32, "interleaved", 4, 2, True),
         (5, 32, True, True, BF16, "stacked", 8, 4, False),
         (5, 16, False, True, BF16, "interleaved", 2, 8, True),
         (3, 32, True, False, F32, "stacked", 1, None, False),
         (3, 16, False, False, BF16, "interleaved", 64, 1, True),
         (5, 32, True, True, F32, "interleaved", None, None, True)]


@pytest.mark.parametrize("heads, dim, rope, weights, dtype, layout, rows, block_h, preallocated", CASES)
def test_vsa_prep_is_the_unfused_path(heads, dim, rope, weights, dtype, layout, rows, block_h, preallocated):
    """q, k and v_tiles bit for bit what qk_norm_rope + v_slot writes (the kernel shares its math; compiled, see
    `_assert_qk_norm_ropes`), the pad slots exactly +0, and the means the pools' of those tensors up to fp32
    summation order."""
    plan, q, k, v, q_w, k_w, cos, sin = _inputs(heads, dim, rope, weights, dtype, layout, seed=heads * dim)
    ref = _unfused(plan, q, k, v, q_w, k_w, cos, sin)
    out = _poisoned_out(plan, heads, dim, dtype) if preallocated else None
    got = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, out=out, use_triton=True, rows=rows, block_h=block_h)
    if preallocated:
        assert all(a is b for a, b in zip(got[:3], out))
    for a, b in zip(got[:2], ref[:2]):
        assert a.is_contiguous() and a.dtype == dtype
        _assert_qk_norm_ropes(a, b)
    assert got[2].is_contiguous() and torch.equal(got[2], ref[2])
    pads = got[2][plan.pad_slot]
    assert pads.numel() > 0 and bool((pads.view(torch.int16 if dtype == BF16 else torch.int32) == 0).all())
    pools = _unfused_pools(plan, *got[:3])  # of the tensors written (on CPU: ref's, the same bits)
    for name, mean, pool, stored in zip("qkv", got[3:], pools, (got[0], got[1], got[2][plan.slot])):
        torch.testing.assert_close(mean, pool, rtol=1e-6, atol=1e-6, msg=f"{name} mean")
        _check_means(mean, stored, plan)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter's masked lanes: the point
def test_vsa_prep_keeps_masked_lanes_out_of_the_means():
    """eps = 0: a masked lane (a pad slot's row, a head past H) normalizes 0 * rsqrt(0) = NaN, which must not reach
    the sums (partial tiles, 3 heads in blocks of 2, rows 8)."""
    plan, q, k, v, q_w, k_w, cos, sin = _inputs(3, 16, True, True, BF16, seed=2)
    q_out, k_out, v_tiles, *means = vsa_prep(q, k, v, q_w, k_w, cos, sin, 0.0, plan, use_triton=True, rows=8,
                                             block_h=2)
    ref = qk_norm_rope(q, k, None, q_w, k_w, cos, sin, 0.0, use_triton=True)
    _assert_qk_norm_ropes(q_out, ref[0])
    _assert_qk_norm_ropes(k_out, ref[1])
    for mean, stored in zip(means, (q_out, k_out, v_tiles[plan.slot])):
        assert bool(mean.isfinite().all())
        _check_means(mean, stored, plan)


@compiled_cuda
@pytest.mark.parametrize("launch", [{}, dict(rows=4, block_h=8, num_warps=8), dict(rows=1, block_h=16, num_warps=8),
                                    dict(rows=2, block_h=8, num_warps=4, stages=2)])
def test_vsa_prep_on_the_gpu_writes_qk_norm_ropes_bits(launch):
    """At the released head geometry (56 heads x 128, R = 96, bf16, interleaved qkv) the compiled kernel spreads a
    head's channels over the lanes as `_qk_norm_rope_kernel` does (8 a thread x 16 lanes in Triton 3.9's sm_90 code,
    for every launch with >= 8 elements a thread), so the norm's sum runs in the same order: q, k and v_tiles bit
    for bit, the means within fp32 summation order."""
    plan, q, k, v, q_w, k_w, cos, sin = _inputs(56, 128, True, True, BF16, seed=3, device="cuda", rot=96,
                                                prefix=(300, 70))
    ref = _unfused(plan, q, k, v, q_w, k_w, cos, sin)
    got = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, **launch)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3]))
    for mean, pool, stored in zip(got[3:], ref[3:], (got[0], got[1], got[2][plan.slot])):
        torch.testing.assert_close(mean, pool, rtol=1e-6, atol=1e-6)
        _check_means(mean, stored, plan)


@interpreted
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_vsa_prep_reference_and_kernel_agree(dtype):
    """`vsa_prep_naive` (use_triton=False) is qk_norm_rope's reference + `to_tiles` + `pool_tiles_naive`, bit for
    bit; the kernel is within one rounding of it (qk_norm_rope's two implementations differ by that), v exactly."""
    plan, q, k, v, q_w, k_w, cos, sin = _inputs(5, 32, True, True, dtype, "stacked", seed=7)
    ref = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, use_triton=False)
    q_ref, k_ref, _ = qk_norm_rope(q, k, None, q_w, k_w, cos, sin, 1e-5, use_triton=False)
    expected = (q_ref, k_ref, to_tiles(v, plan), pool_tiles_naive(q_ref, plan), pool_tiles_naive(k_ref, plan),
                pool_tiles_naive(v, plan))
    assert all(torch.equal(a, b) for a, b in zip(ref, expected))
    got = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, use_triton=True)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert torch.equal(got[2], ref[2])
    for a, b in zip(got[3:], ref[3:]):
        torch.testing.assert_close(a, b, **TOL[dtype])
    out = _poisoned_out(plan, 5, 32, dtype)  # the reference writes preallocated outputs too
    naive = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, out=out, use_triton=False)
    assert all(a is b for a, b in zip(naive[:3], out)) and all(torch.equal(a, b) for a, b in zip(naive, ref))


def test_vsa_prep_dispatch_and_bad_input(monkeypatch):
    from h3render.kernels.vsa import prep_triton

    plan, q, k, v, q_w, k_w, cos, sin = _inputs(3, 16, True, True, F32, device="cpu")
    monkeypatch.setattr(prep_triton, "vsa_prep_triton", lambda *a, **kw: pytest.fail("Triton on CPU tensors"))
    vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan)  # CPU tensors: the reference
    for bad in (dict(q=q[1:], k=k[1:], v=v[1:], cos=cos[1:], sin=sin[1:]), dict(v=None)):
        args = dict(q=q, k=k, v=v, cos=cos, sin=sin) | bad
        with pytest.raises(ValueError, match="vsa_prep takes"):
            vsa_prep(args["q"], args["k"], args["v"], q_w, k_w, args["cos"], args["sin"], 1e-5, plan)
    plan24, *rest = _inputs(3, 24, False, False, F32, device="cpu")  # head dim not a power of two
    with pytest.raises(ValueError, match="power of two"):
        vsa_prep(*rest[:3], None, None, None, None, 1e-5, plan24)
    with pytest.raises(ValueError, match="k_weight"):  # qk_norm_rope's own checks
        vsa_prep(q, k, v, q_w, None, cos, sin, 1e-5, plan)
    good = [torch.empty(plan.seq_len, 3, 16), torch.empty(plan.seq_len, 3, 16), torch.empty(plan.padded_len, 3, 16)]
    for i, wrong in ((2, torch.empty(plan.seq_len, 3, 16)), (0, torch.empty(plan.seq_len, 16, 3).transpose(1, 2)),
                     (1, torch.empty(plan.seq_len, 3, 16, dtype=BF16))):
        with pytest.raises(ValueError, match="out must be"):
            vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, out=tuple(good[:i] + [wrong] + good[i + 1:]))
    monkeypatch.undo()
    for launch in (dict(rows=3), dict(rows=128), dict(block_h=6)):  # checked before any launch
        with pytest.raises(ValueError, match="power of two"):
            vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, use_triton=True, **launch)


# (fine, qk_int8, gate, dtype)
POOLED_CASES = [("triton", False, True, F32), ("triton", True, True, BF16), ("triton", False, False, BF16),
                ("torch", False, True, F32), ("torch", True, False, F32)]


@pytest.mark.parametrize("fine, qk_int8, with_gate, dtype", POOLED_CASES)
def test_vsa_attention_with_pooled_means_is_the_pooling_call(monkeypatch, fine, qk_int8, with_gate, dtype):
    """`vsa_attention(pooled=)` with the pools' own means is the call that pools, bit for bit, and pools nothing;
    with `vsa_prep`'s means (another fp32 summation order) it is the same call on the Triton stage here too."""
    from h3render.kernels.vsa import triton_impl

    plan, q, k, v, q_w, k_w, cos, sin = _inputs(3, 32, True, True, dtype, seed=11)
    q, k, v_tiles, *means = vsa_prep(q, k, v, q_w, k_w, cos, sin, 1e-5, plan, use_triton=fine == "triton")
    gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype).to(q.device) \
        if with_gate else None
    v_tiled = fine == "triton"
    v_in = v_tiles if v_tiled else v_tiles[plan.slot]
    ref = vsa_attention(q, k, v_in, gate, plan, 0.7, fine=fine, qk_int8=qk_int8, v_tiles=v_tiled)
    pool = triton_impl.pool_tiles_triton if fine == "triton" or q.is_cuda else pool_tiles_naive  # as the call
    pools = (pool(q, plan), pool(k, plan), pool(v_tiles, plan, tiled=True) if v_tiled else pool(v_in, plan))
    calls = []
    monkeypatch.setattr(triton_impl, "pool_tiles_triton", lambda *a, **kw: calls.append(1))
    out = vsa_attention(q, k, v_in, gate, plan, 0.7, fine=fine, qk_int8=qk_int8, v_tiles=v_tiled, pooled=pools)
    assert torch.equal(out, ref) and not calls
    fused = vsa_attention(q, k, v_in, gate, plan, 0.7, fine=fine, qk_int8=qk_int8, v_tiles=v_tiled, pooled=means)
    assert not calls and rel_err(fused, ref) <= (1e-6 if dtype == F32 else 1e-2)
    no_v = vsa_attention(q, k, v_in, None, plan, 0.7, fine=fine, qk_int8=qk_int8, v_tiles=v_tiled,
                         pooled=(*pools[:2], None))  # v̄ may be left out without a gate
    assert no_v.shape == q.shape
    bad = [(pools[0][:, 1:], *pools[1:]), (pools[0], pools[1].double(), pools[2]), pools[:2]]
    if with_gate:
        bad.append((*pools[:2], None))
    for pooled in bad:
        with pytest.raises(ValueError, match="pooled must be"):
            vsa_attention(q, k, v_in, gate, plan, 0.7, fine=fine, qk_int8=qk_int8, v_tiles=v_tiled, pooled=pooled)


@interpreted  # the Triton fine stage forced on CPU tensors: the interpreter only (a GPU run has no CPU Triton)
@pytest.mark.parametrize("triton_prep", [False, True])
def test_the_dit_with_the_fused_prep_is_the_unfused_one(monkeypatch, triton_prep):
    """`Attention.vsa_fused_prep` on (`vsa_prep`: no pool at all) against off (qk_norm_rope + three pools) on the
    tiny DiT (fp32) with VSA, gates and the Triton fine stage forced, with the reference prep (what a CPU run takes)
    and the Triton one. q, k and v are the same bits either way; the tile means differ in fp32 summation order only,
    which could flip a near-tie of the top-k selection and does move the scores and the coarse output (softmax over
    all tiles, times the gate) by fp32 ulps. On this model the kept sets are the same in every layer and the outputs
    differ by 1.5e-7 relative, 1e-6 at most (measured): asserted as the same sets and 1e-6."""
    import functools

    from h3render import kernels
    from h3render.kernels import vsa
    from h3render.kernels.vsa import triton_impl
    from h3render.models import dit as dit_module
    from h3render.models.attention import SparseAttention
    from h3render.models.dit_config import DIT_TINY
    from tests._diffusers_ref import random_dit
    from tests.unit.test_vsa_dit import _forward, _vsa_dit

    for_layout = SparseAttention.for_layout.__func__
    monkeypatch.setattr(SparseAttention, "for_layout",
                        classmethod(lambda cls, *a, **kw: for_layout(cls, *a, **{**kw, "fine": "triton"})))
    monkeypatch.setattr(dit_module, "qk_norm_rope", functools.partial(kernels.qk_norm_rope, use_triton=triton_prep))
    monkeypatch.setattr(dit_module, "vsa_prep", functools.partial(vsa.vsa_prep, use_triton=triton_prep))
    pools, preps = [], []
    pool = triton_impl.pool_tiles_triton
    monkeypatch.setattr(triton_impl, "pool_tiles_triton", lambda *a, **kw: pools.append(1) or pool(*a, **kw))
    prep = dit_module.vsa_prep
    monkeypatch.setattr(dit_module, "vsa_prep", lambda *a, **kw: preps.append(1) or prep(*a, **kw))
    kept = []
    select = vsa.select_tiles
    monkeypatch.setattr(vsa, "select_tiles", lambda *a, **kw: kept.append(select(*a, **kw)) or kept[-1])

    dit = _vsa_dit(0.75, gate_seed=2)  # the gate: v's tile means enter through the coarse branch
    assert dit_module.Attention.vsa_fused_prep is True  # the default
    fused = _forward(dit)
    assert len(preps) == DIT_TINY.num_layers and not pools
    monkeypatch.setattr(dit_module.Attention, "vsa_fused_prep", False)
    unfused = _forward(dit)
    assert len(preps) == DIT_TINY.num_layers and len(pools) == 3 * DIT_TINY.num_layers  # q, k and v every layer
    assert len(kept) == 2 * DIT_TINY.num_layers and all(sel is not None for sel in kept)
    assert all(torch.equal(a, b) for a, b in zip(kept[:DIT_TINY.num_layers], kept[DIT_TINY.num_layers:]))
    assert rel_err(fused[0], unfused[0]) <= 1e-6 and rel_err(fused[1], unfused[1]) <= 1e-6
    assert rel_err(fused[0], _forward(random_dit(DIT_TINY, seed=1))[0]) > 1e-3  # VSA and its gate did run

