"""The one Triton helper that reads a 64-slot tile of packed rows: the pool, key-quantization and fine kernels all
start with it (`triton_impl`, `quant`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile_rows(x_ptr, row_of_slot_ptr, t, h, stride_s, stride_h, TILE_ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """Tile `t` of head `h` from packed rows `x [S, H, D]` (unit stride over D): (x [TILE, D] in x's dtype, pad slots
    0; rows [TILE] int64, pad slots 0; valid [TILE] bool). `row_of_slot` is `TilePlan.row_of_slot` (-1 on pads)."""
    offs_m = tl.arange(0, TILE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = tl.load(row_of_slot_ptr + t * TILE_ROWS + offs_m)
    valid = rows >= 0
    rows = tl.where(valid, rows, 0).to(tl.int64)  # int64: S * H * D passes 2**31 at the released size
    x = tl.load(x_ptr + rows[:, None] * stride_s + h * stride_h + offs_d[None, :], mask=valid[:, None], other=0.0)
    return x, rows, valid
