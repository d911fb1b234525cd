"""The blends of the released video-VAE decode (`h3render.models.vae_tiling` plans the work split): tiles of one
window stitched with linear ramps against the original neighbouring tiles, and consecutive windows cross-faded over
`frame_overlap` pixel frames, as diffusers 0.42.1 `AutoencoderKLMiniMaxH3._decode` does.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from h3render.models.vae_tiling import DecodePlan


def ramp_blend(a_tail: torch.Tensor, b_head: torch.Tensor, dim: int) -> torch.Tensor:
    """Linear cross-fade over `dim`: position p of n weighs `a` by 1 - p/n and `b` by p/n (so p=0 is pure `a`).

    Both inputs have the same shape; the ramp never reaches 1, as in the reference.
    """
    n = b_head.shape[dim]
    p = torch.arange(n, device=b_head.device, dtype=b_head.dtype)
    shape = [1] * b_head.ndim
    shape[dim] = n
    weight_b = (p / n).view(shape)
    weight_a = (1 - p / n).view(shape)
    return a_tail * weight_a + b_head * weight_b


def stitch_tiles(
    tiles: list[list[torch.Tensor]], row_overlaps: Iterable[int], col_overlaps: Iterable[int]
) -> torch.Tensor:
    """Blend a grid of overlapping tiles `[..., h, w]` into one `[..., H, W]` the released way.

    Tile (r, c) first blends its top `row_overlaps[r-1]` rows with the ORIGINAL tile above, then its left
    `col_overlaps[c-1]` columns with the ORIGINAL tile to its left (not the row-blended one), then drops its bottom
    and right overlaps, which the next tiles own. Used for decoder tiles (px overlaps) and encoder tiles (latent
    overlaps).
    """
    row_overlaps, col_overlaps = list(row_overlaps), list(col_overlaps)
    n_rows, n_cols = len(tiles), len(tiles[0])
    out_rows = []
    for r in range(n_rows):
        pieces = []
        for c in range(n_cols):
            tile = tiles[r][c]
            if r > 0:
                e = min(row_overlaps[r - 1], tile.shape[-2])
                above = tiles[r - 1][c]
                head = ramp_blend(above[..., above.shape[-2] - e :, :], tile[..., :e, :], dim=-2)
                tile = torch.cat([head, tile[..., e:, :]], dim=-2)
            if c > 0:
                e = min(col_overlaps[c - 1], tile.shape[-1])
                left = tiles[r][c - 1]
                head = ramp_blend(left[..., left.shape[-1] - e :], tile[..., :e], dim=-1)
                tile = torch.cat([head, tile[..., e:]], dim=-1)
            if r < n_rows - 1:
                tile = tile[..., : tile.shape[-2] - row_overlaps[r], :]
            if c < n_cols - 1:
                tile = tile[..., : tile.shape[-1] - col_overlaps[c]]
            pieces.append(tile)
        out_rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(out_rows, dim=-2)


def stitch_window(plan: DecodePlan, outputs: dict[int, torch.Tensor], window: int) -> torch.Tensor:
    """Stitch one window's item outputs (keyed by item index) into `[3, frames_per_item, H, W]`."""
    n_cols = len(plan.cols.starts)
    items = plan.window_items(window)
    grid = [[outputs[it.index] for it in items[r * n_cols : (r + 1) * n_cols]] for r in range(len(plan.rows.starts))]
    return stitch_tiles(grid, plan.rows.overlaps, plan.cols.overlaps)


def assemble_frames(plan: DecodePlan, windows: Iterable[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Cross-fade stitched windows (in order) and yield `(first_frame, frames [3, n, H, W])` as soon as final.

    Window w's clip frames are final once w is stitched: its first `tail_frames` are blended with window w-1's
    tail; its own tail waits for window w+1 (or is emitted as-is after the last window). Frames past
    `plan.num_frames` (from padding latents) are dropped.
    """
    g = plan.geometry
    clip = g.clip_length
    prev_tail = None
    for w, frames in enumerate(windows):
        head = frames[:, :clip]
        if prev_tail is not None and prev_tail.shape[1] > 0:
            e = min(prev_tail.shape[1], clip)
            head = torch.cat([ramp_blend(prev_tail[:, -e:], head[:, :e], dim=1), head[:, e:]], dim=1)
        prev_tail = frames[:, clip:]
        first, stop = w * clip, min((w + 1) * clip, plan.num_frames)
        if stop > first:
            yield first, head[:, : stop - first]
    if prev_tail is not None:
        first = plan.num_windows * clip
        stop = min(first + prev_tail.shape[1], plan.num_frames)
        if stop > first:
            yield first, prev_tail[:, : stop - first]
