"""Triton kernels of VSA-H3: tile pooling and the fine block-sparse forward with the gated coarse add fused in.

The pool kernel and the fine kernel's queries read the packed rows `[S, H, D]` through the plan's `row_of_slot`
(slot -> row, -1 on a pad slot); the fine kernel's keys and values come from tile-ordered copies `[n * 64, H, D]`
(`tiles.gather_tiles`, or for v a buffer the caller wrote in tile order: `v_tiles`, which the pool kernel reads as
well with `tiled`), so every key tile it visits is 64 consecutive slots at an address affine in the tile id,
which the Triton pipeliner can prefetch (per-row index loads measured 0.090 s per layer at 1344x768x243 on an H200,
2026-12-01). The output is written in packed row order. On sm_90+ `fine_attention_triton` launches the
same algorithm with TMA key/value loads by default (`triton_hopper.py`, 5 % faster on an H200; `TMA_BY_DEFAULT`).

Fine kernel, one program per (head, 64-row query tile), query tiles fastest, head by head:
* query tiles below `dense_q` (the prefix tiles; all tiles when k == V) visit key tiles 0..n-1;
* the others visit the P prefix tiles, then their k selected video tiles `sel[h, qt - P, :]` (ascending, so the
  accumulation order is ascending tile order, as FastVideo's kernel);
* online softmax in fp32 with exp2; P is cast to v's dtype before P·V (as FlashAttention and FastVideo's kernel);
  key slots that hold no row (-1) get -inf.
With GATE the epilogue adds `dtype(dtype(coarse[h, qt]) * gate)` to `dtype(out)`, rounding like the torch order
`fine + coarse.to(dtype) * gate` (each bf16 op is an fp32 op rounded once).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting
from h3render.kernels.vsa.quant_triton import key_tiles_int8, rows_int8
from h3render.kernels.vsa.tile_rows import load_tile_rows
from h3render.kernels.vsa.tiles import TILE, TilePlan, gather_tiles

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))


@triton.jit
def _pool_kernel(
    x_ptr,  # [S, H, D] packed rows, or with TILED [n * TILE, H, D] in tile order
    out_ptr,  # [H, n, D] fp32 tile means
    row_of_slot_ptr,  # [n * TILE] int32, -1 on pad slots (unused with TILED)
    sizes_ptr,  # [n] int32 valid rows per tile
    stride_xs, stride_xh,
    num_tiles, num_heads,
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program (a power of two)
    TILED: tl.constexpr,  # x is the tile buffer: tile t's rows are slots t * TILE + 0 .. sizes[t] - 1
):
    # One program per (tile, group of HEADS heads), groups fastest: a program reads HEADS x 256 B of each of its 64
    # rows, so fewer, longer reads per row gather than one head at a time (`POOL_HEADS`).
    g = tl.program_id(0)
    t = tl.program_id(1)
    offs_m = tl.arange(0, TILE_ROWS)
    offs_c = tl.arange(0, HEADS * HEAD_DIM)
    h = g * HEADS + offs_c // HEAD_DIM  # [HEADS * D] head of each column
    d = offs_c % HEAD_DIM
    size = tl.load(sizes_ptr + t)
    if TILED:  # the same values in the same slot order as the gather below: the same sums, bit for bit
        valid = offs_m < size
        rows = t.to(tl.int64) * TILE_ROWS + offs_m
    else:
        rows = tl.load(row_of_slot_ptr + t * TILE_ROWS + offs_m)
        valid = rows >= 0
        rows = tl.where(valid, rows, 0).to(tl.int64)  # int64: S * H * D passes 2**31 at the released size
    cols = h < num_heads
    x = tl.load(x_ptr + rows[:, None] * stride_xs + (h * stride_xh + d)[None, :], mask=valid[:, None] & cols[None, :],
                other=0.0)
    total = tl.sum(x.to(tl.float32), axis=0)  # [HEADS * D]
    tl.store(out_ptr + (h.to(tl.int64) * num_tiles + t) * HEAD_DIM + d, total / size.to(tl.float32), mask=cols)


# Heads per program. One head per program was the only form until 2026-12-03: on an H200 (docs/performance.md §27.1)
# 0.44 ms a call at the released geometry, 0.43 / 0.30 / 0.30 ms with 2 / 4 / 8 heads (4 warps); 960x544: 0.20 ->
# 0.12 ms with 8. An autotuner over (1, 2, 4, 8) x (4, 8 warps) picked slower settings than 8 heads (0.32, 0.16 ms):
# its short timings cannot tell them apart, so the best measured setting is fixed.
POOL_HEADS = 8


# The fine kernels' shared steps (`_fine_kernel` here, `triton_hopper._fine_tma_kernel`): they differ only in how a
# key/value tile reaches the program, so the prologue, the online-softmax step and the epilogue live once, below.

@triton.jit
def program_tile(num_tiles, dense_q, LONG_FIRST: tl.constexpr):
    """This program's (query tile, head) on the fine kernels' 1-D grid of num_tiles x heads programs: head by head,
    query tiles fastest (the L2 order, see `_fine_kernel`). With LONG_FIRST the dense query tiles of every head go
    first: each visits all n key tiles, a video tile only P + k (≈ 8x fewer at 1344x768x243), so in head order the
    last head's long programs started in the last waves and ran on alone (a tail)."""
    pid = tl.program_id(0)
    if LONG_FIRST:
        first = dense_q * (tl.num_programs(0) // num_tiles)
        if pid < first:
            qt = pid % dense_q
            h = pid // dense_q
        else:
            rest = num_tiles - dense_q
            qt = dense_q + (pid - first) % rest
            h = (pid - first) // rest
    else:
        qt = pid % num_tiles
        h = pid // num_tiles
    return qt, h


@triton.jit
def fine_prologue(q_ptr, row_of_slot_ptr, sel_ptr, stride_qs, stride_qh, qt, h, num_tiles, num_prefix, num_video,
                  dense_q, topk, scale_log2, TILE_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, QK_INT8: tl.constexpr):
    """The query tile `qt` of head `h` from the packed rows and its loop state: (q [TILE, D] (int8 codes with
    QK_INT8), its rows' factor from raw dot to log2 units [TILE] fp32 (`scale_log2`, times the row scales with
    QK_INT8), its rows int64 [TILE], valid [TILE], running max m_i (raw dot units), sum l_i, acc [TILE, D] fp32, key
    tiles to visit, its row of `sel`)."""
    q, q_rows, q_valid = load_tile_rows(q_ptr, row_of_slot_ptr, qt, h, stride_qs, stride_qh, TILE_ROWS, HEAD_DIM)
    if QK_INT8:
        q, q_scale = rows_int8(q.to(tl.float32))  # per-row codes: quantized once here, not per key tile
        q_scale = q_scale * scale_log2
    else:
        q_scale = tl.full([TILE_ROWS], scale_log2, tl.float32)
    m_i = tl.full([TILE_ROWS], -1.0e30, dtype=tl.float32)  # finite start: exp2(m_i - m_new) is 0, never NaN
    l_i = tl.zeros([TILE_ROWS], dtype=tl.float32)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM], dtype=tl.float32)
    count = tl.where(qt < dense_q, num_tiles, num_prefix + topk)
    sel_row = sel_ptr + (h.to(tl.int64) * num_video + tl.maximum(qt - num_prefix, 0)) * topk
    return q, q_scale, q_rows, q_valid, m_i, l_i, acc, count, sel_row


@triton.jit
def key_tile(j, qt, sel_row, sizes_ptr, dense_q, num_prefix, topk):
    """The j-th key tile a query tile visits and its valid rows: every tile below `dense_q` (prefix query tiles),
    else the P prefix tiles, then the kept video tiles `sel_row[0..topk)`."""
    dense = qt < dense_q
    pick = tl.minimum(tl.maximum(j - num_prefix, 0), topk - 1)
    picked = tl.load(sel_row + pick, mask=qt >= dense_q, other=0)
    kv = tl.where(dense | (j < num_prefix), j, picked)
    return kv, tl.load(sizes_ptr + kv)


@triton.jit
def key_scales(ks_ptr, kv, h, num_tiles, TILE_ROWS: tl.constexpr, QK_INT8: tl.constexpr):
    """The row scales [TILE] fp32 of key tile `kv` of head `h` with QK_INT8 (`[H, n * TILE]`: 256 contiguous
    bytes), else an unused constant."""
    offs_m = tl.arange(0, TILE_ROWS)
    if QK_INT8:
        return tl.load(ks_ptr + (h.to(tl.int64) * num_tiles + kv) * TILE_ROWS + offs_m)
    return tl.full([TILE_ROWS], 1.0, tl.float32)


@triton.jit
def online_softmax_step(q, k, v, m_i, l_i, acc, size, q_scale, k_scale, TILE_ROWS: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, QK_INT8: tl.constexpr):
    """One key tile `k, v [TILE, D]` (`size` valid rows) into the running (max m_i, sum l_i, acc) of `q`.

    The scores stay in raw dot units (the bf16 / fp32 dot, or with QK_INT8 the int32 dot of the codes times the key
    rows' scales `k_scale [TILE]`), and so does m_i; `q_scale [TILE]` is each query row's factor to log2 units
    (log2(e) / sqrt(D), times the row's int8 scale with QK_INT8), positive, so the max is the same row's max. It
    enters once, in the FMA before exp2 (as FlashAttention does): one multiply per score fewer than scaling the
    scores first, which with the register cap of TMA_CONFIGS made the int8 kernel 9 % faster at the released shape
    (docs/performance.md §24.1)."""
    offs_m = tl.arange(0, TILE_ROWS)
    if QK_INT8:
        if UPCAST:  # interpreter: an fp32 dot of the codes is exact (|sum| <= 128 * 127^2 < 2^24)
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        qk = qk * k_scale[None, :]
    elif UPCAST:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(offs_m[None, :] < size, qk, float("-inf"))  # pad key slots: p = 0
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: every tile holds >= 1 row
    alpha = tl.exp2((m_i - m_new) * q_scale)
    p = tl.exp2(qk * q_scale[:, None] - (m_new * q_scale)[:, None])  # one FMA, then exp2
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]  # the rescale rides in the MMA's accumulator operand
    if UPCAST:
        acc = acc + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    elif IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def fine_epilogue(acc, l_i, o_ptr, gate_ptr, coarse_ptr, q_rows, q_valid, qt, h, num_tiles, stride_os, stride_oh,
                   stride_gs, stride_gh, HEAD_DIM: tl.constexpr, GATE: tl.constexpr):
    """Normalize, add `dtype(dtype(coarse[h, qt]) * gate)` with GATE, store in packed row order."""
    offs_d = tl.arange(0, HEAD_DIM)
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    if GATE:
        c = tl.load(coarse_ptr + (h * num_tiles + qt) * HEAD_DIM + offs_d).to(o_ptr.dtype.element_ty)  # [D]
        g = tl.load(gate_ptr + q_rows[:, None] * stride_gs + h * stride_gh + offs_d[None, :], mask=q_valid[:, None],
                    other=0.0)
        cg = (c.to(tl.float32)[None, :] * g.to(tl.float32)).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) + cg.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + q_rows[:, None] * stride_os + h * stride_oh + offs_d[None, :], out, mask=q_valid[:, None])


@triton.jit
def _fine_kernel(
    q_ptr, o_ptr,  # [S, H, D] packed rows (any row/head strides, unit stride over D)
    kt_ptr, vt_ptr,  # [n * TILE, H, D] keys / values in tile order (slot = tile * 64 + offset); pad slots finite
    ks_ptr,  # [H, n * TILE] fp32 key row scales (QK_INT8 only: kt holds int8 codes, `quant.key_tiles_int8`)
    gate_ptr,  # [S, H, D] (GATE only)
    coarse_ptr,  # [H, n, D] fp32 coarse output per tile (GATE only)
    row_of_slot_ptr,  # [n * TILE] int32, -1 on a pad slot
    sizes_ptr,  # [n] int32 valid rows per tile
    sel_ptr,  # [H, V, topk] int32 absolute key tile ids, ascending (unused when dense_q == n)
    stride_qs, stride_qh, stride_os, stride_oh, stride_ts, stride_th, stride_gs, stride_gh,
    num_tiles, num_prefix, num_video, dense_q, topk,
    scale_log2,  # log2(e) / sqrt(D)
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    GATE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots (no TF32)
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, an fp32 dot of the same bf16 values is exact
    QK_INT8: tl.constexpr,  # int8 QK^T (h3render/kernels/vsa/quant.py)
    LONG_FIRST: tl.constexpr,  # `program_tile`
):
    # Programs run head by head (query tile fastest): those in flight at once read one head's keys and values (38 MB
    # at 1344x768x243), which stay in the 50 MB L2. Head-fastest order spread them over all 56 heads (2.1 GB), so
    # every selected key tile came from HBM: 0.086 against 0.062 s per layer on an H200 (2026-12-01).
    qt, h = program_tile(num_tiles, dense_q, LONG_FIRST)
    q, q_scale, q_rows, q_valid, m_i, l_i, acc, count, sel_row = fine_prologue(
        q_ptr, row_of_slot_ptr, sel_ptr, stride_qs, stride_qh, qt, h, num_tiles, num_prefix, num_video, dense_q, topk,
        scale_log2, TILE_ROWS, HEAD_DIM, QK_INT8)
    # A key tile is TILE consecutive slots of the tile-ordered buffers: its address is affine in the tile id.
    # (Two key tiles per iteration, one 64 x 128 score block, measured slower: 0.072 vs 0.062 s per layer.)
    kv_offs = tl.arange(0, TILE_ROWS)[:, None] * stride_ts + h * stride_th + tl.arange(0, HEAD_DIM)[None, :]
    for j in range(0, count):
        kv, size = key_tile(j, qt, sel_row, sizes_ptr, dense_q, num_prefix, topk)
        base = kv.to(tl.int64) * TILE_ROWS * stride_ts
        k = tl.load(kt_ptr + base + kv_offs)
        v = tl.load(vt_ptr + base + kv_offs)
        k_scale = key_scales(ks_ptr, kv, h, num_tiles, TILE_ROWS, QK_INT8)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, size, q_scale, k_scale, TILE_ROWS, IEEE, UPCAST,
                                            QK_INT8)
    fine_epilogue(acc, l_i, o_ptr, gate_ptr, coarse_ptr, q_rows, q_valid, qt, h, num_tiles, stride_os, stride_oh,
                   stride_gs, stride_gh, HEAD_DIM, GATE)


# Launch settings the fine kernel's autotuner tries on the first call of each shape (keyed on the tile counts and
# the kept-set size; Triton adds the tensors' dtypes). 4 warps / 2 stages was the fixed choice of issue 14; at
# 1344x768x243, s = 0.9 on an H200 (2026-12-02, one call, docs/performance.md §11): 4/2 0.0648 s, 4/3 0.0627, 4/4
# 0.0633, 4/1 0.0750, 8/2 0.1292, 8/3 0.1241; autotuned (it picked 4/3) 0.0617. The 1-stage and 8-warp settings
# never won and each costs a compile on every new shape, so the autotuner tries the three below.
FINE_CONFIGS = ((4, 2), (4, 3), (4, 4))
# The fine kernels' program order (`program_tile`): the dense query tiles of every head first. 1x H200, TMA kernel,
# int8 QK^T (docs/performance.md §25.3): 0.0452 -> 0.0446 s at 1344x768x243, 0.0066 -> 0.0061 s at 960x544x124.
LONG_FIRST = True
_fine_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=st) for w, st in FINE_CONFIGS],
    # QK_INT8 and GATE are in the key: with fp32 inputs (the tests) nothing else tells those variants apart.
    key=["num_tiles", "num_prefix", "topk", "dense_q", "QK_INT8", "GATE"],
    # The pick is kept in Triton's cache folder (keyed by the kernel source, the GPU target and the shape key), so a
    # second process (the next SLURM array task) does not time the configurations again in its warm-up.
    cache_results=True,
)(_fine_kernel)


# The TMA kernel (h3render/kernels/vsa/triton_hopper.py) on sm_90+: 0.0562-0.0578 s against 0.0595-0.0606 s per
# layer for the pointer kernel at 1344x768x243, s = 0.9 on an H200 (docs/performance.md §19); its shipped form:
# 0.0583-0.0592 s against 0.0603-0.0612 s, CUDA cases passed (§21.2).
TMA_BY_DEFAULT = True


def tuned_fine_config(shape_key: tuple | None = None, tma: bool = False) -> tuple[int, int, int | None] | None:
    """(num_warps, num_stages, register cap or None) the autotuner (of the TMA kernel with `tma`) picked for the last
    tuned shape (or `shape_key`), None before."""
    from h3render.kernels.vsa.triton_hopper import _fine_tma_tuned

    cache = getattr(_fine_tma_tuned if tma else _fine_tuned, "cache", {})
    if not cache:
        return None
    config = cache[shape_key] if shape_key is not None else list(cache.values())[-1]
    return config.num_warps, config.num_stages, config.maxnreg


def _check_head_dim(d: int) -> None:
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"h3render/kernels/vsa/triton_impl.py: head dim {d} must be a power of two in [16, 256]")


def pool_tiles_triton(x: torch.Tensor, plan: TilePlan, *, heads_per_program: int | None = None,
                      tiled: bool = False) -> torch.Tensor:
    """fp32 tile means. `x [S, H, D]` (unit stride over D) -> `[H, n, D]` float32.

    heads_per_program: heads a program sums (a power of two); None = `POOL_HEADS`.
    tiled: x is `[n * 64, H, D]` in tile order (`tiles.empty_tiles` written through `TilePlan.slot`); tile j's rows
        are its slots 64j .. 64j + sizes[j] - 1, the pad slots are not read. Bit-identical to pooling the packed
        rows (the same values summed in the same slot order)."""
    rows, heads, d = x.shape
    _check_head_dim(d)
    want = plan.padded_len if tiled else plan.seq_len
    if rows != want:
        raise ValueError(f"h3render/kernels/vsa/triton_impl.py: pool_tiles_triton: {rows} rows, the plan wants {want}"
                         f" ({'tile order' if tiled else 'packed rows'})")
    out = torch.empty(heads, plan.num_tiles, d, dtype=torch.float32, device=x.device)
    hb = heads_per_program or POOL_HEADS
    _pool_kernel[(triton.cdiv(heads, hb), plan.num_tiles)](
        x, out, plan.row_of_slot, plan.sizes, x.stride(0), x.stride(1), plan.num_tiles, heads,
        HEAD_DIM=d, TILE_ROWS=TILE, HEADS=hb, TILED=tiled, num_warps=4,
    )
    return out


def fine_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TilePlan,
    sel: torch.Tensor | None,
    gate: torch.Tensor | None = None,
    coarse: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    tma: bool | None = None,
    qk_int8: bool = False,
    k_mean: torch.Tensor | None = None,
    v_tiles: bool = False,
) -> torch.Tensor:
    """Block-sparse fine attention (plus the gated coarse add when `gate` is given), packed rows in and out.

    Args:
        q, k, v: `[S, H, D]`, one dtype, unit stride over D; D a power of two in [16, 256] (128 released). With
            `v_tiles` v is `[n * 64, H, D]` in tile order instead (pad slots finite, e.g. `tiles.empty_tiles`).
        plan: the layout's `TilePlan` (its tensors on q's device).
        sel: `[H, V, K]` int32, absolute key tile ids (P..n-1) each video query tile keeps, ascending; None keeps
            every tile (k == V: all query tiles dense).
        gate: `[S, H, D]` or None; coarse: `[H, n, D]` fp32 coarse output, required with `gate`.
        out: optional `[S, H, D]` output buffer.
        num_warps, num_stages: launch settings (4 warps = one Hopper warpgroup per 64-row tile); None (both) = on
            CUDA the autotuner's pick among `FINE_CONFIGS` (`triton_hopper.TMA_CONFIGS` with TMA) for this shape
            (timed once, on the shape's first call), in the interpreter 4 and 1.
        maxnreg: a register cap per thread with explicit launch settings (None: Triton's choice).
        tma: read keys / values through tensor descriptors (`triton_hopper`, bulk tensor copies on sm_90; 5 %
            faster on an H200, docs/performance.md §19); None = `TMA_BY_DEFAULT` on CUDA GPUs of compute capability
            >= 9.0, else the pointer kernel here. True runs it in the interpreter too.
        qk_int8: QK^T from int8 codes (`quant.py`: keys smoothed by `k_mean` and quantized per row in one pass,
            queries per row in the kernel); P·V stays in v's dtype.
        k_mean: `[H, D]` fp32 mean key per head for the smoothing (None: no smoothing); qk_int8 only.
        v_tiles: v is already the tile-ordered value buffer (the DiT has `qk_norm_rope` write it so, `v_slot`):
            its `gather_tiles` copy is skipped (0.64 ms of a ~105 ms layer at 1344x768x243 on an H200).
    Returns:
        `[S, H, D]` in q's dtype.
    """
    s, heads, d = q.shape
    _check_head_dim(d)
    v_rows = plan.padded_len if v_tiles else s
    if k.shape != q.shape or v.shape != (v_rows, heads, d) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"h3render/kernels/vsa/triton_impl.py: k must be {list(q.shape)} and v "
                         f"[{v_rows}, {heads}, {d}] ({'tile order' if v_tiles else 'packed rows'}), of q's dtype; "
                         f"got {list(k.shape)} {k.dtype}, {list(v.shape)} {v.dtype}")
    if (gate is None) != (coarse is None):
        raise ValueError("h3render/kernels/vsa/triton_impl.py: gate and coarse go together")
    if out is None:
        out = torch.empty_like(q)
    if sel is None:
        dense_q, topk, sel = plan.num_tiles, 1, plan.row_of_slot  # sel unused: any int32 tensor
    else:
        dense_q, topk = plan.num_prefix, sel.shape[-1]
        if sel.dtype != torch.int32 or not sel.is_contiguous() or tuple(sel.shape) != (heads, plan.num_video, topk):
            raise ValueError(f"h3render/kernels/vsa/triton_impl.py: sel must be contiguous int32 "
                             f"[{heads}, {plan.num_video}, K], got {sel.dtype} {list(sel.shape)}")
    g = gate if gate is not None else q
    c = coarse if coarse is not None else q
    # one row gather each (≈1 GB at 1344x768x243): key/value loads at addresses affine in the tile id
    if qk_int8:
        mean = k_mean if k_mean is not None else torch.zeros(heads, d, device=k.device)
        kt, ks = key_tiles_int8(k, plan, mean)
    else:
        kt = ks = gather_tiles(k, plan)  # ks unused
    # The kernels read v at k's tile strides (and the TMA kernel views it as [n * 64, H * D]): contiguous, as
    # `empty_tiles` makes it (a no-op then).
    vt = v.contiguous() if v_tiles else gather_tiles(v, plan)
    launch: dict | None = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        launch["maxnreg"] = maxnreg
    compiled = q.is_cuda and not interpreting()
    if num_warps is None and num_stages is None:
        launch = None if compiled else {"num_warps": 4, "num_stages": 1}  # None: autotune
    elif num_warps is None or num_stages is None:
        raise ValueError("h3render/kernels/vsa/triton_impl.py: give num_warps and num_stages together "
                         "(or neither: autotune)")
    from h3render.kernels.vsa import triton_hopper

    use_tma = tma if tma is not None else compiled and TMA_BY_DEFAULT and triton_hopper.tma_supported(q)
    if use_tma:
        triton_hopper.launch_fine_tma(q, out, kt, vt, ks, g, c, plan, sel, dense_q, topk, gate=gate is not None,
                                      upcast=not q.is_cuda and interpreting(), launch=launch, qk_int8=qk_int8)
        return out
    kernel = _fine_tuned if launch is None else _fine_kernel
    kernel[(plan.num_tiles * heads,)](
        q, out, kt, vt, ks, g, c, plan.row_of_slot, plan.sizes, sel,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kt.stride(0), kt.stride(1), g.stride(0), g.stride(1),
        plan.num_tiles, plan.num_prefix, plan.num_video, dense_q, topk,
        LOG2E / math.sqrt(d),
        HEAD_DIM=d, TILE_ROWS=TILE, GATE=gate is not None, IEEE=q.dtype == torch.float32,
        UPCAST=not q.is_cuda and interpreting(), QK_INT8=qk_int8, LONG_FIRST=LONG_FIRST, **(launch or {}),
    )
    return out
