"""Triton side of the int8 QKᵀ of VSA (`quant.py` holds the scheme and its torch references): the per-row int8
rounding as a jit helper the fine kernels call on their query tile, and the one launch that gathers, smooths and
quantizes the keys into tile order. Apart from `quant.py` so that importing the references (the CPU path) never needs
Triton, which a CPU-only torch does not bring."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.vsa.tile_rows import load_tile_rows
from h3render.kernels.vsa.tiles import TILE, TilePlan


@triton.jit
def rows_int8(x):
    """`x [M, D]` fp32 -> (codes [M, D] int8, scale [M] fp32), the rounding of `rows_int8_naive`."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-20)  # AMAX_FLOOR
    inv = tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax)
    codes = tl.floor(x * inv[:, None] + 0.5)
    codes = tl.minimum(tl.maximum(codes, -127.0), 127.0).to(tl.int8)
    return codes, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def _key_tiles_int8_kernel(
    k_ptr,  # [S, H, D] packed rows
    mean_ptr,  # [H, D] fp32
    out_ptr,  # [n * TILE, H, D] int8, contiguous
    scale_ptr,  # [H, n * TILE] fp32
    row_of_slot_ptr,  # [n * TILE] int32, -1 on pad slots
    stride_ks, stride_kh,
    heads, padded_len,
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tl.arange(0, TILE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    x, _, valid = load_tile_rows(k_ptr, row_of_slot_ptr, t, h, stride_ks, stride_kh, TILE_ROWS, HEAD_DIM)
    x = x.to(tl.float32) - tl.load(mean_ptr + h * HEAD_DIM + offs_d)[None, :]
    codes, scale = rows_int8(x)
    codes = tl.where(valid[:, None], codes, 0)
    slots = (t * TILE_ROWS + offs_m).to(tl.int64)
    tl.store(out_ptr + (slots[:, None] * heads + h) * HEAD_DIM + offs_d[None, :], codes)
    tl.store(scale_ptr + h.to(tl.int64) * padded_len + slots, tl.where(valid, scale, 0.0))


def key_tiles_int8(k: torch.Tensor, plan: TilePlan, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smoothed int8 keys in tile order for the fine kernels, one launch (gather + smooth + quantize).

    Args:
        k: `[S, H, D]` packed rows, unit stride over D (a Ulysses head slice is fine).
        mean: `[H, D]` fp32 mean key of each head (`vsa_attention` takes it from the pooled tile means).
    Returns:
        codes `[n * 64, H, D]` int8, contiguous (pad slots 0); scales `[H, n * 64]` fp32 (pad slots 0).
    """
    s, heads, d = k.shape
    if s != plan.seq_len or tuple(mean.shape) != (heads, d) or k.stride(-1) != 1:
        raise ValueError(f"h3render/kernels/vsa/quant.py: k {list(k.shape)} (unit stride over D) and mean "
                         f"{list(mean.shape)} do not fit a plan of {plan.seq_len} rows")
    out = torch.empty(plan.padded_len, heads, d, dtype=torch.int8, device=k.device)
    scales = torch.empty(heads, plan.padded_len, dtype=torch.float32, device=k.device)
    _key_tiles_int8_kernel[(plan.num_tiles, heads)](
        k, mean.float().contiguous(), out, scales, plan.row_of_slot, k.stride(0), k.stride(1), heads,
        plan.padded_len, HEAD_DIM=d, TILE_ROWS=TILE, num_warps=4,
    )
    return out, scales
