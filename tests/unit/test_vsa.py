"""VSA-H3 (h3render/kernels/vsa): tile geometry, the torch reference's defining properties, and the Triton / flex fine
stages against the reference (Triton under TRITON_INTERPRET=1 on CPU, NaN-poisoned outputs)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from h3render.kernels.vsa import select_tiles, tile_plan, topk_budget, vsa_attention, vsa_attention_naive
from h3render.kernels.vsa.naive import block_mask, pool_tiles_naive, tile_scores
from h3render.kernels.vsa.tiles import TILE, from_tiles, to_tiles
from h3render.kernels.vsa.triton_impl import program_tile
from h3render.models.attention import naive_attention
from tests._numerics import rel_err


# The fast-path cases run on the GPU where there is one and Triton is not interpreted (TRITON_INTERPRET=0 on the
# device machine), else on CPU tensors under the interpreter (tests/conftest.py sets it by default).
FAST_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _rand(plan, heads, dim, seed, dtype=torch.float32, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(plan.seq_len, heads, dim, generator=g).to(dtype).to(plan.sizes.device) for _ in range(n)]


# ---------------------------------------------------------------- geometry


@pytest.mark.parametrize("prefix, grid", [((70, 0, 130), (9, 10, 13)), ((1,), (1, 1, 1)), ((300, 810), (5, 7, 6)),
                                          ((65, 3), (4, 4, 4)), ((), (3, 5, 2))])
def test_slot_map_is_a_bijection_onto_valid_slots(prefix, grid):
    plan = tile_plan(prefix, grid)
    s = sum(prefix) + math.prod(grid)
    assert plan.seq_len == s and int(plan.sizes.sum()) == s
    valid = (torch.arange(TILE)[None, :] < plan.sizes[:, None].long()).reshape(-1)  # [n*64]
    hit = torch.zeros(plan.padded_len, dtype=torch.int64)
    hit.index_add_(0, plan.slot, torch.ones(s, dtype=torch.int64))
    assert torch.equal(hit, valid.long())  # every valid slot exactly once, no pad slot
    assert torch.equal(plan.row_of_slot[plan.slot], torch.arange(s, dtype=torch.int32))
    x = torch.randn(s, 3)
    assert torch.equal(from_tiles(to_tiles(x, plan), plan), x)
    assert bool((to_tiles(x, plan)[~valid] == 0).all())


def test_tile_sizes_hand_computed_on_ragged_grid():
    """Grid (9, 10, 13): t 4+4+1, h 4+4+2, w 4+4+4+1; prefix 70 -> 64+6, 5 -> 5, 130 -> 64+64+2."""
    plan = tile_plan((70, 5, 130), (9, 10, 13))
    assert plan.num_prefix == 6 and plan.num_video == 3 * 3 * 4
    assert plan.sizes[:6].tolist() == [64, 6, 5, 64, 64, 2]
    ext_t, ext_h, ext_w = [4, 4, 1], [4, 4, 2], [4, 4, 4, 1]
    assert plan.sizes[6:].tolist() == [a * b * c for a in ext_t for b in ext_h for c in ext_w]
    # The last video row (t=8, h=9, w=12) sits in the 1 x 2 x 1 corner tile, after (8, 8, 12): offset 1.
    last = plan.slot[-1].item()
    assert last // TILE == plan.num_tiles - 1 and last % TILE == 1 and plan.sizes[-1].item() == 2
    # Row (t=1, h=2, w=5) of the video: tile (0, 0, 1), offset 1*16 + 2*4 + 1 = 25 inside a full 4x4x4 box.
    r = sum((70, 5, 130)) + (1 * 10 + 2) * 13 + 5
    assert plan.slot[r].item() == (6 + 1) * TILE + 25
    # Row (t=0, h=8, w=0): tile (0, 2, 0) is 4 x 2 x 4; row offset 0, next row (h=8, w=1) offset 1, (h=9, w=0) 4.
    base = sum((70, 5, 130))
    assert plan.slot[base + 8 * 13].item() == (6 + 8) * TILE
    assert plan.slot[base + 9 * 13].item() == (6 + 8) * TILE + 4


def test_release_geometry():
    plan = tile_plan((300, 810), (72, 24, 42))
    assert (plan.num_prefix, plan.num_video) == (5 + 13, 18 * 6 * 11)
    assert plan.padded_len == 1206 * 64 and plan.seq_len == 300 + 810 + 72 * 24 * 42
    assert topk_budget(0.9, plan.num_video) == 119 and topk_budget(0.8, plan.num_video) == 238


def test_topk_budget_rounds_in_float64():
    assert topk_budget(0.9, 660) == 66
    k32 = math.ceil(float(torch.tensor(1.0, dtype=torch.float32) - torch.tensor(0.9, dtype=torch.float32)) * 660)
    assert k32 == 67  # the float32 pitfall the float64 formula avoids
    assert topk_budget(0.0, 17) == 17 and topk_budget(0.999, 5) == 1


# ---------------------------------------------------------------- reference properties


def test_sparsity_zero_with_zero_gate_equals_dense():
    plan = tile_plan((70, 5, 130), (9, 6, 5))
    q, k, v = _rand(plan, 2, 8, seed=3, n=3)
    dense = naive_attention(q[None], k[None], v[None])[0]
    for gate in (None, torch.zeros_like(q)):
        out = vsa_attention_naive(q, k, v, gate, plan, 0.0)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


def test_prefix_rows_dense_video_rows_sparse_at_75_percent():
    prefix = (70, 5, 130)
    plan = tile_plan(prefix, (9, 6, 5))
    q, k, v = _rand(plan, 2, 8, seed=4, n=3)
    dense = naive_attention(q[None], k[None], v[None])[0]
    out = vsa_attention_naive(q, k, v, None, plan, 0.75)
    p = sum(prefix)
    torch.testing.assert_close(out[:p], dense[:p], rtol=1e-5, atol=1e-6)
    assert (out[p:] - dense[p:]).abs().max() > 1e-2


def test_block_mask_policy():
    plan = tile_plan((70, 5, 130), (9, 6, 5))
    q, k = _rand(plan, 3, 8, seed=5, n=2)
    scores = tile_scores(pool_tiles_naive(q, plan), pool_tiles_naive(k, plan))
    p, kk = plan.num_prefix, topk_budget(0.75, plan.num_video)
    mask = block_mask(scores, p, 0.75)
    assert mask[:, :p].all() and mask[:, :, :p].all()
    assert (mask[:, p:, p:].sum(-1) == kk).all()
    sel = select_tiles(scores, plan, 0.75)
    assert sel.shape == (3, plan.num_video, kk) and bool((sel.diff(dim=-1) > 0).all())
    rebuilt = torch.zeros_like(mask[:, p:, p:])
    rebuilt.scatter_(-1, sel.long() - p, True)
    assert torch.equal(rebuilt, mask[:, p:, p:])


def test_pooling_is_fp32_mean_over_true_size():
    plan = tile_plan((5, 70), (2, 3, 5))
    (x,) = _rand(plan, 2, 4, seed=6, dtype=torch.bfloat16, n=1)
    pooled = pool_tiles_naive(x, plan)
    tile = plan.tile_of_row
    for j in (0, 1, 2, plan.num_tiles - 1):
        torch.testing.assert_close(pooled[:, j], x[tile == j].float().mean(0), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- fast paths vs the reference

# Shapes small enough for the Triton interpreter: n = 10 or 12 tiles.
CASES = [((37, 21), (5, 6, 7), 2, 16, 0.5), ((70, 5), (6, 5, 4), 3, 32, 0.75), ((40,), (5, 6, 7), 1, 16, 0.0)]


F32, BF16 = torch.float32, torch.bfloat16
TRITON_CASES = [(*CASES[0], F32, True), (*CASES[0], BF16, True), (*CASES[1], BF16, True), (*CASES[1], F32, False),
                (*CASES[2], BF16, False), (*CASES[2], F32, True)]


@pytest.mark.parametrize("prefix, grid, heads, dim, sparsity, dtype, with_gate", TRITON_CASES)
def test_triton_matches_reference(prefix, grid, heads, dim, sparsity, dtype, with_gate):
    from h3render.kernels.vsa.triton_impl import fine_attention_triton, pool_tiles_triton

    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=sum(grid) + heads, dtype=dtype)
    gate = g if with_gate else None
    ref = vsa_attention_naive(q, k, v, gate, plan, sparsity)
    torch.testing.assert_close(pool_tiles_triton(q, plan), pool_tiles_naive(q, plan), rtol=1e-6, atol=1e-6)

    scores = tile_scores(pool_tiles_naive(q, plan), pool_tiles_naive(k, plan))
    coarse = None
    if with_gate:
        from h3render.kernels.vsa.naive import coarse_attention_naive

        coarse = coarse_attention_naive(scores, pool_tiles_naive(v, plan))
    out = torch.full_like(q, float("nan"))
    # the pointer kernel (tma=False: whatever the default, `TMA_BY_DEFAULT`; the TMA kernel is tested below)
    fine_attention_triton(q, k, v, plan, select_tiles(scores, plan, sparsity), gate, coarse, out=out, tma=False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


# Odd prefix tile count (3), odd video tile count (9), odd k (3), partial video and prefix tiles.
ODD = ((70, 5), (1, 9, 9), 3, 32, 0.7)
TMA_CASES = [(*CASES[0], F32, True), (*CASES[0], BF16, True), (*CASES[1], BF16, False), (*CASES[2], F32, True),
             (*ODD, BF16, True), (*ODD, F32, False)]


@pytest.mark.parametrize("prefix, grid, heads, dim, sparsity, dtype, with_gate", TMA_CASES)
def test_tma_fine_matches_reference(prefix, grid, heads, dim, sparsity, dtype, with_gate):
    """The TMA kernel (h3render/kernels/vsa/triton_hopper.py; the default on sm_90 GPUs) against the reference."""
    from h3render.kernels.vsa.naive import coarse_attention_naive
    from h3render.kernels.vsa.triton_impl import fine_attention_triton

    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=sum(grid) + 7 * heads, dtype=dtype)
    gate = g if with_gate else None
    ref = vsa_attention_naive(q, k, v, gate, plan, sparsity)
    scores = tile_scores(pool_tiles_naive(q, plan), pool_tiles_naive(k, plan))
    coarse = coarse_attention_naive(scores, pool_tiles_naive(v, plan)) if with_gate else None
    out = torch.full_like(q, float("nan"))
    fine_attention_triton(q, k, v, plan, select_tiles(scores, plan, sparsity), gate, coarse, out=out, tma=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


# Scores spanning more than fp32's exponent range within a row: q is scaled up so that past the first key tile some
# rows' max grows by more than 2**128 (a missed or wrong rescale of the running max overflows p to inf) while others'
# barely grows; with raw-unit scores and the log2 factor in the exp2's FMA (`online_softmax_step`) both kernels still
# match the reference. ODD's partial tiles exercise the pad-slot mask.
@pytest.mark.parametrize("tma, dtype", [(True, F32), (False, F32), (True, BF16)])
def test_fine_kernels_keep_scores_past_the_exponent_range(tma, dtype):
    from h3render.kernels.vsa.naive import coarse_attention_naive
    from h3render.kernels.vsa.triton_impl import fine_attention_triton

    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=11, dtype=torch.float32)
    q, k, v, g = (x.to(dtype) for x in (q * 120.0, k, v, g))
    # The premise, on head 0.
    s = (q[:, 0].float() @ k[:, 0].float().T) * (math.log2(math.e) / math.sqrt(dim))  # [S, S] log2 units
    first = plan.row_of_slot[:TILE]
    grow = s.amax(1) - s[:, first[first >= 0].long()].amax(1)
    assert bool((grow > 128).any()) and bool((grow < 8).any())
    ref = vsa_attention_naive(q, k, v, g, plan, sparsity)
    sc = tile_scores(pool_tiles_naive(q, plan), pool_tiles_naive(k, plan))
    coarse = coarse_attention_naive(sc, pool_tiles_naive(v, plan))
    out = torch.full_like(q, float("nan"))
    fine_attention_triton(q, k, v, plan, select_tiles(sc, plan, sparsity), g, coarse, out=out, tma=tma)
    # fp32: scores of |s| ~ 300 carry ~300 ulp in exp (1.2e-6 measured); a missed rescale gives inf / NaN.
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_gather_tiles_matches_to_tiles_on_valid_slots():
    from h3render.kernels.vsa.tiles import gather_tiles

    plan = tile_plan((70, 5), (1, 9, 9))
    (x,) = _rand(plan, 2, 4, seed=12, n=1)
    valid = plan.row_of_slot >= 0
    gathered = gather_tiles(x, plan)
    assert torch.equal(gathered[valid], to_tiles(x, plan)[valid])
    assert torch.equal(gathered[~valid], x[0].expand(int((~valid).sum()), -1, -1))  # pad slots: row 0, finite
    strided = gather_tiles(x[:, 1:], plan)  # a Ulysses head slice: the TMA kernel views the result as [n*64, H*D]
    assert strided.is_contiguous() and torch.equal(strided, gathered[:, 1:])


def test_triton_reads_strided_rows():
    """Ulysses hands the kernel `[S, h, D]` slices of a wider buffer: row and head strides must be honoured."""
    plan = tile_plan((37, 21), (5, 6, 7), FAST_DEVICE)
    wide = _rand(plan, 4, 16, seed=9)
    q, k, v, g = (t[:, 1:3] for t in wide)  # non-contiguous head slices
    ref = vsa_attention_naive(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), plan, 0.5)
    out = vsa_attention(q, k, v, g, plan, 0.5, fine="triton")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix, grid, heads, dim, sparsity", CASES[1:2])
def test_flex_matches_reference(prefix, grid, heads, dim, sparsity):
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=11)
    ref = vsa_attention_naive(q, k, v, g, plan, sparsity)
    torch.testing.assert_close(vsa_attention(q, k, v, g, plan, sparsity, fine="flex"), ref, rtol=1e-5, atol=1e-5)


def test_bad_shapes_and_backend_raise():
    plan = tile_plan((37, 21), (5, 6, 7))
    q, k, v, g = _rand(plan, 2, 16, seed=1)
    with pytest.raises(ValueError, match="for this plan"):
        vsa_attention(q[:-1], k[:-1], v[:-1], None, plan, 0.5)
    with pytest.raises(ValueError, match="unknown fine backend"):
        vsa_attention(q, k, v, g, plan, 0.5, fine="tk")
    with pytest.raises(ValueError, match="tile_plan"):
        tile_plan((3,), (0, 2, 2))


@triton.jit
def _order_kernel(out_ptr, num_tiles, dense_q, LONG_FIRST: tl.constexpr):
    """Each program's `program_tile` pair into out [programs, 2] (module level: Triton resolves names here)."""
    qt, h = program_tile(num_tiles, dense_q, LONG_FIRST)
    pid = tl.program_id(0)
    tl.store(out_ptr + 2 * pid, qt)
    tl.store(out_ptr + 2 * pid + 1, h)


@pytest.mark.parametrize("num_tiles, dense_q, heads", [(7, 2, 3), (5, 0, 2), (4, 4, 3), (9, 1, 1)])
@pytest.mark.parametrize("long_first", [True, False])
def test_program_order_visits_every_query_tile_of_every_head_once(num_tiles, dense_q, heads, long_first):
    """`program_tile` maps the fine kernels' 1-D grid onto (query tile, head): every pair exactly once; with
    LONG_FIRST the dense query tiles (all n key tiles each) of every head come first, then the video tiles head by
    head; without it head by head, query tiles fastest. Odd counts, no dense tile, all dense, one head."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("CPU Triton needs TRITON_INTERPRET=1")
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    out = torch.full((num_tiles * heads, 2), -1, dtype=torch.int32, device=device)
    _order_kernel[(num_tiles * heads,)](out, num_tiles, dense_q, LONG_FIRST=long_first)
    got = [tuple(p) for p in out.cpu().tolist()]
    if long_first:
        want = [(t, h) for h in range(heads) for t in range(dense_q)]
        want += [(t, h) for h in range(heads) for t in range(dense_q, num_tiles)]
    else:
        want = [(t, h) for h in range(heads) for t in range(num_tiles)]
    assert got == want



@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_coarse_output_is_the_reference_within_tf32_and_restores_the_flag(device):
    """`coarse_output` runs the reference's GEMM in TF32 on CUDA only (`COARSE_TF32`), and leaves torch's TF32 switch
    as it found it: the CPU result is the reference's bit for bit, the CUDA one within TF32's 10-bit mantissa."""
    from h3render.kernels.vsa import coarse_output
    from h3render.kernels.vsa.naive import coarse_attention_naive

    g = torch.Generator().manual_seed(3)
    scores = (torch.randn(3, 37, 37, generator=g) * 4).to(device)
    v_pooled = torch.randn(3, 37, 64, generator=g).to(device)
    before = torch.backends.cuda.matmul.allow_tf32
    ours, ref = coarse_output(scores, v_pooled), coarse_attention_naive(scores, v_pooled)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    if device == "cpu":
        assert torch.equal(ours, ref)
    else:
        exact = torch.softmax(scores.double(), -1) @ v_pooled.double()
        assert float((ours.double() - exact).norm() / exact.norm()) < 2e-3


@pytest.mark.parametrize("heads_per_program", [None, 1, 2, 4, 8])
@pytest.mark.parametrize("heads", [1, 3, 5])
def test_pool_kernel_with_several_heads_per_program_is_the_reference(heads_per_program, heads):
    """The pool kernel's head groups (None = `POOL_HEADS`) on head counts they do not divide, a ragged tile grid
    with a prefix, head stride != D (a strided view of a wider tensor)."""
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton

    plan = tile_plan((70, 5), (5, 6, 9), FAST_DEVICE)
    g = torch.Generator().manual_seed(heads)
    wide = torch.randn(plan.seq_len, heads + 2, 32, generator=g).to(FAST_DEVICE)
    x = wide[:, 1:heads + 1]  # [S, H, D] with row stride (H + 2) * D
    ours = pool_tiles_triton(x, plan, heads_per_program=heads_per_program)
    torch.testing.assert_close(ours, pool_tiles_naive(x, plan), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- v in tile order (`v_tiles`, issue 26)


def _v_tiles(v, plan, pad=0.0):
    """v [S, H, D] -> its tile buffer [n * 64, H, D] as the DiT builds it (`empty_tiles`, rows written through
    `plan.slot`); `pad` overwrites the pad slots (NaN: shows a reader that they are never read)."""
    from h3render.kernels.vsa.tiles import empty_tiles

    vt = empty_tiles(plan, v.shape[1], v.shape[2], v.dtype, v.device)
    vt[plan.slot] = v
    if pad != 0.0:
        vt[plan.pad_slot] = pad
    return vt


def test_empty_tiles_zeroes_exactly_the_pad_slots(monkeypatch):
    from h3render.kernels.vsa.tiles import empty_tiles

    plan = tile_plan((70, 5), (5, 6, 9))  # partial prefix tiles (6, 5 rows) and ragged video tiles
    assert plan.pad_slot.dtype == torch.int64
    assert torch.equal(plan.pad_slot, (plan.row_of_slot < 0).nonzero().view(-1))
    assert plan.pad_slot.numel() == plan.padded_len - plan.seq_len > 0
    empty = torch.empty  # make "uninitialized" visible: every fresh buffer starts as NaN
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    buf = empty_tiles(plan, 3, 16, torch.bfloat16, "cpu")
    assert buf.shape == (plan.padded_len, 3, 16) and buf.dtype == torch.bfloat16 and buf.is_contiguous()
    assert bool((buf[plan.pad_slot] == 0).all())
    assert bool(buf[plan.slot].isnan().all())  # the valid slots are the caller's to write: left as allocated


@pytest.mark.parametrize("heads_per_program, heads", [(None, 3), (1, 3), (2, 5)])
def test_pool_kernel_reads_the_tile_buffer_like_the_packed_rows(heads_per_program, heads):
    """`pool_tiles_triton(tiled=True)` over v in tile order (NaN pad slots) is the packed rows' pooling, bit for
    bit: same values summed in the same slot order, pads never read. Partial prefix tiles, a grid not divisible by
    4, a head count the head groups do not divide."""
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton

    plan = tile_plan((70, 5), (5, 6, 9), FAST_DEVICE)
    g = torch.Generator().manual_seed(heads)
    x = torch.randn(plan.seq_len, heads, 32, generator=g).to(FAST_DEVICE)
    packed = pool_tiles_triton(x, plan, heads_per_program=heads_per_program)
    tiled = pool_tiles_triton(_v_tiles(x, plan, pad=float("nan")), plan, heads_per_program=heads_per_program,
                              tiled=True)
    torch.testing.assert_close(tiled, packed, rtol=1e-6, atol=1e-6)
    assert torch.equal(tiled, packed)
    with pytest.raises(ValueError, match="tile order"):
        pool_tiles_triton(x, plan, tiled=True)


# (fine, qk_int8, gate, dtype): both fine stages, int8 on and off, with and without the gated coarse branch.
V_TILES_CASES = [("triton", False, True, F32), ("triton", True, True, BF16), ("triton", False, False, BF16),
                 ("triton", True, False, F32), ("torch", False, True, F32), ("torch", True, True, F32)]


@pytest.mark.parametrize("fine, qk_int8, with_gate, dtype", V_TILES_CASES)
def test_vsa_attention_with_v_in_tile_order_is_the_packed_call(fine, qk_int8, with_gate, dtype):
    """`vsa_attention(v_tiles=True)` equals the call on packed v bit for bit: the Triton stages read the same
    values (pooled per tile, then the fine kernel's v tiles, whose pad slots get p = 0), the torch stages un-tile."""
    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=21, dtype=dtype)
    gate = g if with_gate else None
    ref = vsa_attention(q, k, v, gate, plan, sparsity, fine=fine, qk_int8=qk_int8)
    out = vsa_attention(q, k, _v_tiles(v, plan), gate, plan, sparsity, fine=fine, qk_int8=qk_int8, v_tiles=True)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="v_tiles"):
        vsa_attention(q, k, v, gate, plan, sparsity, fine=fine, v_tiles=True)  # packed v where tiles are due


@pytest.mark.parametrize("tma", [False, True])
def test_fine_kernels_take_v_in_tile_order(tma):
    """Both fine kernels (pointer, TMA) with `v_tiles`: the packed call's output, bit for bit."""
    from h3render.kernels.vsa.naive import coarse_attention_naive
    from h3render.kernels.vsa.triton_impl import fine_attention_triton

    prefix, grid, heads, dim, sparsity = ODD
    plan = tile_plan(prefix, grid, FAST_DEVICE)
    q, k, v, g = _rand(plan, heads, dim, seed=22, dtype=BF16)
    sc = tile_scores(pool_tiles_naive(q, plan), pool_tiles_naive(k, plan))
    coarse = coarse_attention_naive(sc, pool_tiles_naive(v, plan))
    sel = select_tiles(sc, plan, sparsity)
    ref = fine_attention_triton(q, k, v, plan, sel, g, coarse, tma=tma)
    out = fine_attention_triton(q, k, _v_tiles(v, plan), plan, sel, g, coarse, tma=tma, v_tiles=True)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="tile order"):
        fine_attention_triton(q, k, v, plan, sel, g, coarse, tma=tma, v_tiles=True)
