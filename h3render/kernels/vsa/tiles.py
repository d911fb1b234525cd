"""Tile geometry of video sparse attention (VSA-H3): which 64-slot tile every packed row belongs to.

The packed sequence is `[prefix segment 0 | prefix segment 1 | ... | generated video | (pad rows)]`. FastVideo 0.2.1
`video_sparse_attn_h3.py` (`_h3_tile_geometry`) cuts it so:

* each prefix segment (text, condition, audio rows, in packed order; zero-length ones dropped) on its own into 1-D
  chunks of 64 rows plus one remainder chunk: a tile never straddles a segment boundary;
* the video rows, a `(T, H, W)` grid with W fastest, into 4x4x4 boxes enumerated t-box, h-box, w-box; inside a box
  rows keep raster (t, h, w) order, and a box at a ragged edge holds `min(4, T-4a) * min(4, H-4b) * min(4, W-4c)` rows.

Tile `j` owns slots `64*j .. 64*j + sizes[j] - 1` of the padded tile buffer `[n*64, ...]`; its remaining slots are
padding. Rows past the prefix and video (structural pad) never enter a tile.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

# Rows per tile: the FastH3 students' trained geometry (FastVideo `--vsa-tile-size 64`). This is the one home of the
# VSA tile size (h3render.spec points here): the kernels are the lowest layer and import nothing of h3render above
# them, and the fact is theirs, since the Triton constexpr TILE_ROWS, VIDEO_TILE_SHAPE and the slot arithmetic are
# all built on it. The DiT, the student loader and the contract checks import it from `h3render.kernels.vsa`.
TILE = 64
VIDEO_TILE_SHAPE = (4, 4, 4)  # (t, h, w) box of a 64-row video tile (FastVideo `VSA_H3_TILE_SHAPES[64]`)


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Where every packed row sits in the padded tile buffer.

    Attributes:
        sizes: `[n]` int32, valid rows of each tile (1..64), prefix tiles first then video tiles.
        slot: `[S]` int64, packed row -> `tile * 64 + offset` (S = prefix rows + video rows; no pad rows).
        row_of_slot: `[n * 64]` int32, the inverse: slot -> packed row, -1 on a pad slot.
        tile_of_row: `[S]` int64, `slot // 64`.
        pad_slot: `[n * 64 - S]` int64, the pad slots (where `row_of_slot == -1`), ascending: `empty_tiles` zero-fills
            them without a host sync.
        num_prefix: P, prefix tiles (text/condition/audio chunks).
        num_video: V, video tiles.
        prefix: the prefix segment lengths used (zero-length dropped).
        grid: the video grid `(T, H, W)`.
    """

    sizes: torch.Tensor
    slot: torch.Tensor
    row_of_slot: torch.Tensor
    tile_of_row: torch.Tensor
    pad_slot: torch.Tensor
    num_prefix: int
    num_video: int
    prefix: tuple[int, ...]
    grid: tuple[int, int, int]

    @property
    def num_tiles(self) -> int:
        return self.num_prefix + self.num_video

    @property
    def seq_len(self) -> int:
        """Rows that enter a tile: sum(prefix) + T*H*W."""
        return self.slot.numel()

    @property
    def padded_len(self) -> int:
        return self.num_tiles * TILE


def _prefix_tiles(prefix: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """Sizes of the 1-D prefix chunks and the slot of every prefix row."""
    sizes: list[int] = []
    slots = []
    for length in prefix:
        first = len(sizes)
        full, rem = divmod(length, TILE)
        sizes.extend([TILE] * full + ([rem] if rem else []))
        r = torch.arange(length, dtype=torch.int64)
        slots.append((first + r // TILE) * TILE + r % TILE)  # chunk-local raster order
    return sizes, torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)


def _video_tiles(grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sizes `[V]` of the 4x4x4 video tiles and the (tile, offset) of every video row (raster t, h, w order)."""
    t, h, w = grid
    bt, bh, bw = VIDEO_TILE_SHAPE
    nt, nh, nw = math.ceil(t / bt), math.ceil(h / bh), math.ceil(w / bw)
    # Clipped box extent along each axis: full boxes, then the ragged last one.
    ext_t = torch.clamp(t - bt * torch.arange(nt), max=bt)  # [nt]
    ext_h = torch.clamp(h - bh * torch.arange(nh), max=bh)
    ext_w = torch.clamp(w - bw * torch.arange(nw), max=bw)
    sizes = (ext_t[:, None, None] * ext_h[None, :, None] * ext_w[None, None, :]).reshape(-1)  # [V], t-h-w order

    row = torch.arange(t * h * w, dtype=torch.int64)
    rt, rh, rw = row // (h * w), (row // w) % h, row % w  # W fastest in the packed video rows
    tile = (rt // bt * nh + rh // bh) * nw + rw // bw
    # Raster offset inside the clipped box: its h and w extents, not the nominal 4, set the strides.
    eh, ew = ext_h[rh // bh], ext_w[rw // bw]
    offset = (rt % bt) * eh * ew + (rh % bh) * ew + rw % bw
    return sizes, tile * TILE + offset


@functools.lru_cache(maxsize=16)
def tile_plan(prefix: tuple[int, ...], grid: tuple[int, int, int], device: str = "cpu") -> TilePlan:
    """The tile plan of a packed sequence `[prefix segments | video]`, cached by shape (built once per layout).

    Args:
        prefix: prefix segment row counts in packed order (text, condition, audio); zero-length entries dropped.
        grid: generated-video grid `(T, H, W)` after patching (released 243 frames at 1344x768: (72, 24, 42)).
        device: device of the plan's tensors (a string so the cache key is hashable).
    Returns:
        `TilePlan`; at (300, 810) + (72, 24, 42): P = 5 + 13 = 18, V = 18*6*11 = 1188.
    Raises:
        ValueError: a negative segment, an empty grid, or a geometry that fails the bijection check.
    """
    prefix = tuple(int(p) for p in prefix if int(p) != 0)
    grid = tuple(int(g) for g in grid)
    if any(p < 0 for p in prefix) or len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"h3render/kernels/vsa/tiles.py: tile_plan: bad prefix {prefix} or video grid {grid}")
    prefix_sizes, prefix_slot = _prefix_tiles(prefix)
    video_sizes, video_slot = _video_tiles(grid)
    num_prefix = len(prefix_sizes)
    sizes = torch.cat([torch.tensor(prefix_sizes, dtype=torch.int64), video_sizes])
    slot = torch.cat([prefix_slot, video_slot + num_prefix * TILE])
    _check(sizes, slot, prefix, grid)
    row_of_slot = torch.full((sizes.numel() * TILE,), -1, dtype=torch.int32)
    row_of_slot[slot] = torch.arange(slot.numel(), dtype=torch.int32)
    return TilePlan(
        sizes=sizes.to(torch.int32).to(device),
        slot=slot.to(device),
        row_of_slot=row_of_slot.to(device),
        tile_of_row=(slot // TILE).to(device),
        pad_slot=(row_of_slot < 0).nonzero().view(-1).to(device),  # built on the CPU: no sync at call time
        num_prefix=num_prefix,
        num_video=int(video_sizes.numel()),
        prefix=prefix,
        grid=grid,
    )


def _check(sizes: torch.Tensor, slot: torch.Tensor, prefix: tuple[int, ...], grid: tuple[int, int, int]) -> None:
    """Sizes in [1, 64] summing to S, and `slot` injective into the valid slots (what the kernels trust)."""
    total = sum(prefix) + math.prod(grid)
    where = f"h3render/kernels/vsa/tiles.py: tile_plan(prefix={prefix}, grid={grid})"
    if int(sizes.min()) < 1 or int(sizes.max()) > TILE or int(sizes.sum()) != total or slot.numel() != total:
        raise ValueError(f"{where}: tile sizes out of bounds (min {int(sizes.min())}, max {int(sizes.max())}, "
                         f"sum {int(sizes.sum())}, rows {total})")
    offset, tile = slot % TILE, slot // TILE
    if bool((offset >= sizes[tile]).any()) or torch.unique(slot).numel() != total:
        raise ValueError(f"{where}: the slot map is not a bijection onto the valid slots")


def to_tiles(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """Scatter packed rows into the zero-padded tile buffer.

    Args:
        x: `[S, ...]` packed rows (S = plan.seq_len).
    Returns:
        `[n * 64, ...]`, same dtype; pad slots are zero.
    """
    if x.shape[0] != plan.seq_len:
        raise ValueError(f"h3render/kernels/vsa/tiles.py: to_tiles: {x.shape[0]} rows, the plan tiles {plan.seq_len}")
    out = x.new_zeros(plan.padded_len, *x.shape[1:])
    out.index_copy_(0, plan.slot, x)  # a row scatter: one contiguous H*D row per packed row
    return out


def gather_tiles(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """Packed rows in tile order for the fine kernels: one gather, no zero fill.

    Args:
        x: `[S, ...]` packed rows (S = plan.seq_len).
    Returns:
        `[n * 64, ...]`, same dtype, contiguous; a pad slot holds a copy of row 0 (finite: the fine kernels give pad
        keys -inf scores, so their p is 0 and a finite pad value adds 0 to P·V). `to_tiles` zero-fills the pad and
        scatters: a memset plus a scatter, 3.8 against 1.2 ms a layer (docs/performance.md §19).
    """
    if x.shape[0] != plan.seq_len:
        raise ValueError(f"h3render/kernels/vsa/tiles.py: gather_tiles: {x.shape[0]} rows, "
                         f"the plan tiles {plan.seq_len}")
    return x.index_select(0, plan.row_of_slot.clamp(min=0))


def empty_tiles(plan: TilePlan, heads: int, dim: int, dtype: torch.dtype, device: torch.device | str
                ) -> torch.Tensor:
    """An uninitialized tile buffer for the fine kernels' values whose pad slots alone are zeroed.

    Its valid slots are meant to be written by the caller (`qk_norm_rope(..., v_slot=plan.slot)` writes v straight
    into them); the pad slots must be finite, since a fine kernel gives a pad key p = 0 and 0 * NaN is NaN. Zeroing
    only them writes `padded_len - seq_len` rows instead of the whole buffer (`to_tiles`' memset).

    Args:
        plan: the layout's plan (its `pad_slot` on `device`).
        heads, dim: H and D of the buffer (any head subset).
        dtype, device: the buffer's.
    Returns:
        `[plan.padded_len, heads, dim]` contiguous; pad slots 0, valid slots uninitialized.
    """
    out = torch.empty(plan.padded_len, heads, dim, dtype=dtype, device=device)
    return out.index_fill_(0, plan.pad_slot, 0)


def from_tiles(x_t: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """Inverse of `to_tiles`: `[n * 64, ...]` -> `[S, ...]` in packed row order."""
    return x_t[plan.slot]
