"""Hopper variants of the VSA-H3 fine kernel: TMA loads of the kept key tiles, optionally two query tiles per program.

Same contract as `triton_impl.fine_attention_triton` (block-sparse fine attention over the kept 64-slot key tiles,
the gated coarse add fused in the epilogue, packed rows in and out); the differences:

* keys and values are read through tensor descriptors (`TensorDescriptor` over the tile-ordered copies viewed as
  `[n * 64, H * D]`, block `[64, D]` at `(tile * 64, h * D)`), so on sm_90 the pipeliner issues bulk tensor copies
  completing on mbarriers instead of 128 threads' cp.async addresses;
* `query_tiles=2`: one program takes two query tiles (a 128-row block, two warpgroups with 8 warps) and visits the
  ascending union of their kept key tiles once, masking, per 64-row half, the tiles that half did not keep. Each
  key tile then crosses L2 -> shared memory once for both tiles; the price is the union's extra tiles, computed and
  thrown away (`pair_union`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting
from h3render.kernels.vsa.tiles import TILE, TilePlan, gather_tiles

LOG2E = 1.4426950408889634


@triton.jit
def _fine_tma_kernel(
    q_ptr, o_ptr,  # [S, H, D] packed rows (any row/head strides, unit stride over D)
    desc_k, desc_v,  # TensorDescriptor over [n * TILE, H * D] tile-ordered keys / values, block [TILE, D]
    gate_ptr,  # [S, H, D] (GATE only)
    coarse_ptr,  # [H, n, D] fp32 coarse output per tile (GATE only)
    row_of_slot_ptr,  # [n * TILE] int32, -1 on a pad slot
    sizes_ptr,  # [n] int32 valid rows per tile
    keys_ptr,  # [H, G, L] int32 absolute video key tile ids per group of query tiles, ascending
    bits_ptr,  # [H, G, L] int8 which half keeps the key (bit 0: first tile, bit 1: second; QT == 2 only)
    count_ptr,  # [H, G] int32 valid entries of keys (QT == 2 only; QT == 1: topk)
    stride_qs, stride_qh, stride_os, stride_oh, stride_gs, stride_gh,
    num_tiles, num_prefix, num_video, topk, num_keys,  # num_keys = L
    scale_log2,  # log2(e) / sqrt(D)
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    QT: tl.constexpr,  # query tiles per program: 1 (64 rows) or 2 (128 rows)
    GATE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots (no TF32)
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, an fp32 dot of the same bf16 values is exact
    WS: tl.constexpr,  # warp-specialize the key loop (producer / consumer warps)
    KV_ONCE: tl.constexpr = False,  # diagnostic only (scripts/vsa_probe.py): one key tile loaded, reused: math only
):
    # Programs run head by head, query groups fastest: the programs in flight read one head's keys and values, which
    # stay in L2 (see triton_impl._fine_kernel).
    grp = tl.program_id(0)
    h = tl.program_id(1)
    BLOCK_M: tl.constexpr = TILE_ROWS * QT
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, TILE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    half = offs_m // TILE_ROWS  # which query tile of the group a row belongs to

    # Groups: ceil(P / QT) of prefix tiles (dense), then ceil(V / QT) of video tiles; a group's last tile may be
    # missing (odd count), its rows then hold no query.
    prefix_groups = (num_prefix + QT - 1) // QT
    dense = grp < prefix_groups
    is_video = grp >= prefix_groups
    vg = tl.maximum(grp - prefix_groups, 0)
    first = tl.where(dense, grp * QT, num_prefix + vg * QT)
    last = tl.where(dense, num_prefix, num_tiles)
    q_tile = first + half  # [BLOCK_M]
    tile_ok = q_tile < last
    q_rows = tl.load(row_of_slot_ptr + q_tile * TILE_ROWS + offs_m % TILE_ROWS, mask=tile_ok, other=-1)
    q_valid = q_rows >= 0
    q_rows = tl.where(q_valid, q_rows, 0).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qs + h * stride_qh + offs_d[None, :], mask=q_valid[:, None],
                other=0.0)

    # Running max starts finite: a row whose half has kept no tile yet then gets alpha = 1 and p = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if QT == 1:
        video_count = topk
    else:
        video_count = tl.load(count_ptr + h * tl.cdiv(num_video, QT) + vg, mask=is_video, other=0)
    count = tl.where(dense, num_tiles, num_prefix + video_count)
    list_row = (h.to(tl.int64) * tl.cdiv(num_video, QT) + vg) * num_keys
    col = h * HEAD_DIM
    if KV_ONCE:
        k0 = desc_k.load([num_prefix * TILE_ROWS, col])
        v0 = desc_v.load([num_prefix * TILE_ROWS, col])
    for j in tl.range(0, count, warp_specialize=WS):
        pick = tl.minimum(tl.maximum(j - num_prefix, 0), num_keys - 1)
        from_list = is_video & (j >= num_prefix)
        picked = tl.load(keys_ptr + list_row + pick, mask=from_list, other=0)
        kv = tl.where(from_list, picked, j)
        size = tl.load(sizes_ptr + kv)
        if KV_ONCE:
            k = k0
            v = v0
        else:
            k = desc_k.load([kv * TILE_ROWS, col])
            v = desc_v.load([kv * TILE_ROWS, col])
        if UPCAST:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        keep = offs_n[None, :] < size
        if QT == 2:
            bits = tl.load(bits_ptr + list_row + pick, mask=from_list, other=3).to(tl.int32)
            keep = keep & (((bits >> half) & 1) != 0)[:, None]
        qk = tl.where(keep, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
        elif IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    if GATE:
        c_tile = tl.where(tile_ok, q_tile, 0)
        c = tl.load(coarse_ptr + (h * num_tiles + c_tile[:, None]) * HEAD_DIM + offs_d[None, :])
        c = c.to(o_ptr.dtype.element_ty)
        g = tl.load(gate_ptr + q_rows[:, None] * stride_gs + h * stride_gh + offs_d[None, :], mask=q_valid[:, None],
                    other=0.0)
        cg = (c.to(tl.float32) * g.to(tl.float32)).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) + cg.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + q_rows[:, None] * stride_os + h * stride_oh + offs_d[None, :], out, mask=q_valid[:, None])


def pair_union(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ascending union of the kept key tiles of video query tiles (2i, 2i + 1).

    Merge by rank, no sort: with a, b the two ascending kept lists, a[i] lands at i + (b-only ids below it) and a
    b-only b[j] at (b-only ids before it) + (a ids below it); two searchsorted, one cumsum, two scatters.

    Args:
        sel: `[H, V, k]` int32 absolute key tile ids, ascending and distinct per row.
    Returns:
        keys `[H, ceil(V/2), 2k]` int32 (entries past count: unspecified, never read), bits `[H, ceil(V/2), 2k]`
        int8 (1: the first tile keeps it, 2: the second, 3: both), count `[H, ceil(V/2)]` int32. An odd V's last
        group has only its first tile: its keys are that tile's, bits 3.
    """
    heads, v, k = sel.shape
    if v % 2:
        sel = torch.cat([sel, sel[:, -1:]], dim=1)
    a, b = sel[:, 0::2].contiguous(), sel[:, 1::2].contiguous()  # [H, G, k]
    ia = torch.searchsorted(b, a)  # b ids below a[i]
    ib = torch.searchsorted(a, b)  # a ids below b[j]
    a_in_b = b.gather(-1, ia.clamp(max=k - 1)) == a
    b_only = a.gather(-1, ib.clamp(max=k - 1)) != b
    b_only_before = torch.cumsum(b_only, -1) - b_only.long()  # exclusive: b-only ids before b[j]
    b_only_below_a = torch.where(ia < k, b_only_before.gather(-1, ia.clamp(max=k - 1)), b_only.sum(-1, keepdim=True))
    pos_a = torch.arange(k, device=sel.device) + b_only_below_a
    pos_b = torch.where(b_only, b_only_before + ib, 2 * k - 1)  # shared ids: parked in the last slot, overwritten
    keys = torch.zeros(*a.shape[:-1], 2 * k, dtype=torch.int32, device=sel.device)
    bits = torch.zeros(*a.shape[:-1], 2 * k, dtype=torch.int8, device=sel.device)
    keys.scatter_(-1, pos_b, b)  # b first: a's scatter then overwrites the parked slot when the union fills it
    bits.scatter_(-1, pos_b, torch.full_like(bits[..., :k], 2))
    keys.scatter_(-1, pos_a, a)
    bits.scatter_(-1, pos_a, (1 + 2 * a_in_b).to(torch.int8))
    if v % 2:
        bits[:, -1] = 3
    count = k + b_only.sum(-1)
    return keys, bits, count.to(torch.int32)


def _descriptor(x_t: torch.Tensor, d: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = x_t.reshape(x_t.shape[0], -1)  # [n * 64, H * D], contiguous (to_tiles writes a fresh buffer)
    return TensorDescriptor.from_tensor(flat, [TILE, d])


def fine_attention_hopper(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TilePlan,
    sel: torch.Tensor | None,
    gate: torch.Tensor | None = None,
    coarse: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    query_tiles: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    warp_specialize: bool = False,
    _kv_once: bool = False,
) -> torch.Tensor:
    """Block-sparse fine attention with TMA key/value loads; same arguments and result as `fine_attention_triton`.

    Args:
        query_tiles: 1 (one 64-row query tile per program) or 2 (a 128-row pair over the union of its kept sets).
        num_warps, num_stages: None = 4 * query_tiles warps (one warpgroup per query tile), 3 stages on CUDA
            (1 in the interpreter).
        warp_specialize: producer/consumer warps on the key loop (Triton's automatic warp specialization).
    Returns:
        `[S, H, D]` in q's dtype.
    """
    s, heads, d = q.shape
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"kernels/vsa/triton_hopper.py: head dim {d} must be a power of two in [16, 256]")
    if query_tiles not in (1, 2):
        raise ValueError(f"kernels/vsa/triton_hopper.py: query_tiles must be 1 or 2, got {query_tiles}")
    if (gate is None) != (coarse is None):
        raise ValueError("kernels/vsa/triton_hopper.py: gate and coarse go together")
    if out is None:
        out = torch.empty_like(q)
    p_tiles, v_tiles = plan.num_prefix, plan.num_video
    if sel is None:  # every tile kept: all query tiles dense
        p_tiles, v_tiles = plan.num_tiles, 0
        keys = bits = count = plan.row_of_slot  # unused: any int tensor
        topk = num_keys = 1
    elif query_tiles == 1:
        keys, bits, count = sel, sel, sel
        topk = num_keys = sel.shape[-1]
    else:
        keys, bits, count = pair_union(sel)
        topk, num_keys = sel.shape[-1], keys.shape[-1]
    g = gate if gate is not None else q
    c = coarse if coarse is not None else q
    kt, vt = gather_tiles(k, plan), gather_tiles(v, plan)
    if num_warps is None:
        num_warps = 4 * query_tiles
    if num_stages is None:
        num_stages = 3 if q.is_cuda and not interpreting() else 1
    if q.is_cuda and not interpreting():
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    groups = -(-p_tiles // query_tiles) + -(-v_tiles // query_tiles)
    _fine_tma_kernel[(groups, heads)](
        q, out, _descriptor(kt, d), _descriptor(vt, d), g, c, plan.row_of_slot, plan.sizes, keys, bits, count,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), g.stride(0), g.stride(1),
        plan.num_tiles, p_tiles, v_tiles, topk, num_keys,
        LOG2E / math.sqrt(d),
        HEAD_DIM=d, TILE_ROWS=TILE, QT=query_tiles, GATE=gate is not None, IEEE=q.dtype == torch.float32,
        UPCAST=not q.is_cuda and interpreting(), WS=warp_specialize, KV_ONCE=_kv_once, num_warps=num_warps, num_stages=num_stages,
    )
    return out
