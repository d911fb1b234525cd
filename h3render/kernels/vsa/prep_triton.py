"""Triton kernel of VSA's prep pass: q/k norm + RoPE, v in tile order and the three fp32 tile means, in one pass.

Per layer the DiT's VSA path (`models.dit.Attention.forward` with the Triton fine stage) needs, from the qkv
projection's views q, k, v `[S, H, D]`: q and k normalized and rotated as packed rows (`kernels.qk_norm_rope`), v in
the fine kernel's tile order (`tiles.empty_tiles` written through `TilePlan.slot`), and the fp32 tile means of all
three (the tile scores, the coarse output and the int8 keys' smoothing mean: `vsa_attention`). Done apart, the three
means are three more passes over q, k and v (`triton_impl.pool_tiles_triton`, 0.30 ms each at 1344x768x243 on an
H200: ≈3.2 GB read a layer). Here one program per (block of heads, tile) walks the tile's valid slots
`64t .. 64t + sizes[t] - 1` (`row_of_slot` gives each slot's packed row), ROWS slots an iteration, loads those rows'
q, k, v for its heads, normalizes and rotates q and k with `qk_norm_rope`'s own math (`norm_rope`, so the stored q, k
are that kernel's bits), stores q and k at the packed rows and v at the slots, and adds the values as stored (rounded
to the output dtype) into fp32 sums held in registers; the tile's pad slots of v are written 0, and the sums divided
by the tile's true size are the means. They equal `pool_tiles_triton` of the written tensors up to fp32 summation
order (ROWS rows at a time here, one 64-slot reduction there).

ROWS rows an iteration: each program keeps ROWS rows' loads in flight, where a one-row loop would wait on every
row's load in turn; ROWS, BLOCK_H and num_warps are launch arguments so the bench (`scripts/bench_vsa_tune.py`,
`--stages vsa-tune`) can compare settings. The torch reference is `naive.vsa_prep_naive`, the checked entry point
`kernels.vsa.vsa_prep`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.qk_norm_rope.triton_impl import norm_rope
from h3render.kernels.utils import next_power_of_2
from h3render.kernels.vsa.tiles import TILE, TilePlan

# Default launch: 2 rows x 8 heads x 128 channels a block (a row's block 1,024 elements, as the pool kernel's 8 heads a
# program, `triton_impl.POOL_HEADS`), 8 warps, the row loop not software-pipelined. Measured on an H200
# (docs/performance.md §29.7, `--stages vsa-tune`, random bf16 qkv, median of 20), against the unfused qk_norm_rope +
# 3 pools at 3.028 ms (1344x768x243) / 0.935 ms (960x544x124): 2 x 8 x 8 warps 2.508 / 0.737 ms, the fastest of nine
# settings; the 4-warp form 3.138 / 0.906 (slower than unfused at 1344), with 2 pipeline stages 2.546 / 0.748; 1 x 16 x
# 8 2.774 / 0.830; 4 x 8 x 8 3.235 / 0.900. Every setting's q, k and v tiles were bit-equal to qk_norm_rope's there.
# Settings with fewer than 8 elements a thread (e.g. 1 row x 8 heads x 8 warps) would spread a head's 128 channels over
# the lanes otherwise than `_qk_norm_rope_kernel` does, so its norm's sum, and q and k, could differ from that
# kernel's in the last bit.
ROWS, BLOCK_H, NUM_WARPS, STAGES = 2, 8, 8, 1


@triton.jit
def _norm_rope_rows(x_ptr, out_ptr, rows, heads, dims, partner, stride_s, stride_h, w_ptr, cos, sin_signed, mask,
                    H, D, eps, HAS_WEIGHT: tl.constexpr):
    """q or k of ROWS packed rows x BLOCK_H heads: load (x at `rows` [ROWS, 1, 1] int64, any row/head strides),
    normalize + rotate (`norm_rope`; weight `w_ptr` [D] with HAS_WEIGHT), store at the same rows of the contiguous
    `[S, H, D]` output, and return the stored values in fp32, masked lanes 0 ([ROWS, BLOCK_H, BLOCK_D], for the tile
    sums)."""
    offs = rows * stride_s + heads[None, :, None] * stride_h
    x = tl.load(x_ptr + offs + dims[None, None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + offs + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)  # an L1 hit
    w = cos  # placeholders: `norm_rope` reads the weights only with HAS_WEIGHT
    wp = cos
    if HAS_WEIGHT:  # re-read every iteration (L1 hits): held across the loop they cost 28 registers a thread
        w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dims < D, other=0.0).to(tl.float32)
    out = norm_rope(x, xp, w, wp, cos, sin_signed, D, eps, HAS_WEIGHT).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * H * D + heads[None, :, None] * D + dims[None, None, :], out, mask=mask)
    # The sums are of the stored (rounded) values, as the pool kernel reads them back. Masked lanes would be 0
    # already unless eps = 0 (0 * rsqrt(0) is NaN), so they are zeroed explicitly.
    return tl.where(mask, out.to(tl.float32), 0.0)


@triton.jit
def _vsa_prep_kernel(
    q_ptr, k_ptr, v_ptr,  # [S, H, D] packed rows, strides (stride_*_s, stride_*_h, 1): views of the qkv projection
    q_out_ptr, k_out_ptr,  # [S, H, D] contiguous
    v_out_ptr,  # [n * TILE, H, D] contiguous, tile order (slot = tile * 64 + offset)
    q_mean_ptr, k_mean_ptr, v_mean_ptr,  # [H, n, D] fp32 tile means
    row_of_slot_ptr,  # [n * TILE] int32 packed row of each slot, -1 on a pad slot
    sizes_ptr,  # [n] int32 valid rows of each tile
    q_w_ptr, k_w_ptr,  # [D] RMSNorm weights (read only with HAS_WEIGHT)
    cos_ptr, sin_ptr,  # [S, R] fp32, strides (stride_cos_s, 1)
    stride_q_s, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_cos_s, stride_sin_s,
    num_tiles, H, D, R, eps,
    HAS_WEIGHT: tl.constexpr,
    TILE_ROWS: tl.constexpr,  # 64 (`tiles.TILE`)
    ROWS: tl.constexpr,  # slots an iteration (a power of two <= TILE_ROWS)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr,  # the row loop's software pipelining (`tl.range` num_stages; 1: none)
):
    # Head blocks fastest, as the pool kernel's groups: programs in flight together read whole rows.
    hb = tl.program_id(0)
    t = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    hd_mask = (heads[:, None] < H) & (dims[None, :] < D)  # [BLOCK_H, BLOCK_D]
    # RoPE constants as `_qk_norm_rope_kernel` builds them (its per-row cos/sin loads are per slot below).
    half = R // 2
    partner = tl.where(dims < half, dims + half, tl.where(dims < R, dims - half, dims))
    in_rot = dims < R

    size = tl.load(sizes_ptr + t)
    first_slot = t.to(tl.int64) * TILE_ROWS  # int64: n * 64 * H * D passes 2**31 at the released size
    offs_r = tl.arange(0, ROWS)
    v_dst = heads[None, :, None] * D + dims[None, None, :]  # [1, BLOCK_H, BLOCK_D] inside a contiguous [H, D] row
    hd_zero = v_dst * 0 + dims[None, None, :]  # [1, BLOCK_H, BLOCK_D]: channel d of every head (the cos/sin column)
    # The sums stay [ROWS, BLOCK_H, BLOCK_D] through the loop, one fp32 add per element and row, and are summed over
    # the ROWS axis once at the end: where a launch spreads the rows over warps (4 rows x 8 heads x 8 warps), a sum
    # over that axis every iteration crossed warps through shared memory, with barriers, three times an iteration.
    q_acc = tl.zeros([ROWS, BLOCK_H, BLOCK_D], tl.float32)
    k_acc = tl.zeros([ROWS, BLOCK_H, BLOCK_D], tl.float32)
    v_acc = tl.zeros([ROWS, BLOCK_H, BLOCK_D], tl.float32)
    # The slots' packed rows one iteration ahead: the row loads of an iteration then wait on memory once, not twice.
    row_next = tl.load(row_of_slot_ptr + first_slot + offs_r)
    for r0 in tl.range(0, size, ROWS, num_stages=STAGES):  # the valid slots (the last iteration may reach the pad)
        slot = first_slot + r0 + offs_r  # [ROWS]
        row = row_next
        ahead = r0 + ROWS + offs_r
        row_next = tl.load(row_of_slot_ptr + first_slot + ahead, mask=ahead < TILE_ROWS, other=-1)
        valid = row >= 0  # slot offset < size
        row = tl.where(valid, row, 0).to(tl.int64)  # int64: S * H * D passes 2**31 at the released size
        rows = row[:, None, None]
        mask = valid[:, None, None] & hd_mask[None, :, :]  # [ROWS, BLOCK_H, BLOCK_D]
        # cos/sin at the block's full shape (each head's lanes re-read the row's table: L1 hits), so they arrive in
        # the layout of q and k; a [ROWS, BLOCK_D] load broadcast over heads took a layout conversion each.
        rot = mask & in_rot[None, None, :]
        cos = tl.load(cos_ptr + rows * stride_cos_s + hd_zero, mask=rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + rows * stride_sin_s + hd_zero, mask=rot, other=0.0).to(tl.float32)
        sin_signed = tl.where(dims[None, None, :] < half, -sin, sin)
        q_acc += _norm_rope_rows(q_ptr, q_out_ptr, rows, heads, dims, partner, stride_q_s, stride_q_h, q_w_ptr,
                                 cos, sin_signed, mask, H, D, eps, HAS_WEIGHT)
        k_acc += _norm_rope_rows(k_ptr, k_out_ptr, rows, heads, dims, partner, stride_k_s, stride_k_h, k_w_ptr,
                                 cos, sin_signed, mask, H, D, eps, HAS_WEIGHT)
        v = tl.load(v_ptr + rows * stride_v_s + heads[None, :, None] * stride_v_h + dims[None, None, :], mask=mask,
                    other=0.0)
        # Every slot of the iteration is written: a pad slot past the valid ones gets v's `other`, 0.
        tl.store(v_out_ptr + slot[:, None, None] * H * D + v_dst, v, mask=(offs_r[:, None, None] >= 0) & hd_mask)
        v_acc += v.to(tl.float32)
    # The pad slots the loop did not reach: zero (a fine kernel gives a pad key p = 0, and 0 * NaN would be NaN).
    zeros = tl.zeros([ROWS, BLOCK_H, BLOCK_D], v_out_ptr.dtype.element_ty)
    for r0 in range(tl.cdiv(size, ROWS) * ROWS, TILE_ROWS, ROWS):
        slot = first_slot + r0 + offs_r
        tl.store(v_out_ptr + slot[:, None, None] * H * D + v_dst, zeros, mask=(offs_r[:, None, None] >= 0) & hd_mask)

    mean_off = (heads[:, None].to(tl.int64) * num_tiles + t) * D + dims[None, :]  # [H, n, D]
    count = size.to(tl.float32)  # the tile's true size, as the pool kernel divides
    tl.store(q_mean_ptr + mean_off, tl.sum(q_acc, axis=0) / count, mask=hd_mask)
    tl.store(k_mean_ptr + mean_off, tl.sum(k_acc, axis=0) / count, mask=hd_mask)
    tl.store(v_mean_ptr + mean_off, tl.sum(v_acc, axis=0) / count, mask=hd_mask)


def vsa_prep_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    plan: TilePlan,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rows: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    stages: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the prep kernel. Arguments as in `kernels.vsa.vsa_prep`, already validated there.

    Args:
        q, k, v: `[S, H, D]`, S = plan.seq_len, unit stride over D; D a power of two.
        q_weight, k_weight: `[D]` or both None; cos, sin: `[S, R]` fp32 (unit stride over R) or both None; eps.
        plan: the layout's `TilePlan` on q's device.
        out: optional contiguous (q_out `[S, H, D]`, k_out `[S, H, D]`, v_tiles `[n * 64, H, D]`) of q's dtype.
        rows: slots a program handles an iteration (a power of two <= 64; None = `ROWS`).
        block_h: heads a program handles (a power of two; None = `BLOCK_H`, fewer when H is smaller).
        num_warps: warps a program (None = `NUM_WARPS`).
        stages: software pipelining of the row loop (`tl.range(num_stages=)`; None = `STAGES`, 1 = none).

    Returns:
        (q_out, k_out, v_tiles, q_mean, k_mean, v_mean): q_out, k_out `[S, H, D]`, v_tiles `[n * 64, H, D]` (pad
        slots 0), the means `[H, n, D]` fp32.
    """
    s, heads, d = q.shape
    rows = ROWS if rows is None else int(rows)
    block_h = min(BLOCK_H, next_power_of_2(heads)) if block_h is None else int(block_h)
    for name, value, most in (("rows", rows, TILE), ("block_h", block_h, 1 << 10)):
        if value < 1 or value > most or value & (value - 1):
            raise ValueError(f"h3render/kernels/vsa/prep_triton.py: {name}={value} must be a power of two <= {most}")
    n = plan.num_tiles
    if out is None:
        out = (torch.empty_like(q, memory_format=torch.contiguous_format),
               torch.empty_like(k, memory_format=torch.contiguous_format),
               torch.empty(plan.padded_len, heads, d, dtype=v.dtype, device=v.device))
    q_out, k_out, v_out = out
    means = [torch.empty(heads, n, d, dtype=torch.float32, device=q.device) for _ in range(3)]
    has_weight = q_weight is not None
    q_w, k_w = (q_weight, k_weight) if has_weight else (q, q)  # placeholder pointers; never read without weights
    R = 0 if cos is None else cos.shape[1]
    if cos is None:  # R = 0: every cos/sin load is masked, any pointer will do
        cos = sin = q.new_zeros((1, 1), dtype=torch.float32)
    _vsa_prep_kernel[(triton.cdiv(heads, block_h), n)](
        q, k, v, q_out, k_out, v_out, *means, plan.row_of_slot, plan.sizes, q_w, k_w, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        n, heads, d, R, eps,
        HAS_WEIGHT=has_weight, TILE_ROWS=TILE, ROWS=rows, BLOCK_H=block_h, BLOCK_D=next_power_of_2(d),
        STAGES=STAGES if stages is None else int(stages), num_warps=NUM_WARPS if num_warps is None else int(num_warps),
    )
    return (q_out, k_out, v_out, *means)
