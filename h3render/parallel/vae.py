"""Video VAE decode split across ranks by (temporal window x spatial tile) work items.

Every rank decodes its share of each window's items (round-robin inside the window, so all ranks stay busy on every
window); the raw tiles of the window are gathered to every rank and rank 0 stitches, cross-fades and yields frames
exactly as the single-GPU `VideoVAE.decode_stream` does (same `stitch_window` / `assemble_frames`), so the blend is
identical. Window by window keeps the stream going into the H.264 encoder and bounds memory to one window of tiles.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from h3render.models.vae_tiling import assemble_frames, stitch_window
from h3render.parallel.groups import ParallelContext


def assign_items(num_items: int, rank: int, world_size: int) -> list[int]:
    """Positions (within one window's item list) that `rank` decodes: round-robin, so counts differ by <= 1."""
    return list(range(rank, num_items, world_size))


def decode_stream_split(vae, latent: torch.Tensor, ctx: ParallelContext, batch_size: int
                        ) -> Iterator[tuple[int, torch.Tensor]]:
    """Rank 0 yields `(first_frame, frames [3, n, H, W] float32 in [0, 1])` in order; other ranks yield nothing but
    must iterate to the end (they take part in every window's gather).

    Args:
        vae: `h3render.models.video_vae.VideoVAE` (replicated on every rank).
        latent: `[24, T, h, w]` normalized latent, identical on every rank.
        ctx: the ranks taking part.
        batch_size: items per decoder forward.
    """
    plan = vae.plan_decode(*latent.shape[1:])
    windows = _stitched_windows(vae, latent, plan, ctx, batch_size)
    if ctx.is_main:
        yield from ((first, vae._to_rgb(frames)) for first, frames in assemble_frames(plan, windows))
    else:
        for _ in windows:
            pass


@torch.no_grad()
def _stitched_windows(vae, latent, plan, ctx: ParallelContext, batch_size: int) -> Iterator[torch.Tensor]:
    for w in range(plan.num_windows):
        items = plan.window_items(w)
        mine = [items[i] for i in assign_items(len(items), ctx.rank, ctx.world_size)]
        outs = vae.decode_items(latent, mine, batch_size) if mine else []
        gathered = _gather_tiles(outs, len(items), ctx)
        if ctx.is_main:
            yield stitch_window(plan, {it.index: gathered[i] for i, it in enumerate(items)}, w)
        else:
            yield None


def _gather_tiles(outs: list[torch.Tensor], num_items: int, ctx: ParallelContext) -> list[torch.Tensor] | None:
    """All tiles of one window, in item order, on rank 0. All tiles of a plan share one shape."""
    world = ctx.world_size
    per_rank = -(-num_items // world)
    shape = outs[0].shape if outs else None
    # Ranks with fewer items pad with a zero tile so all_gather sees equal sizes; the shape is the plan's.
    shapes = [None] * world
    dist.all_gather_object(shapes, tuple(shape) if shape is not None else None, group=ctx.group)
    shape = next(s for s in shapes if s is not None)
    buf = torch.zeros((per_rank, *shape), dtype=torch.float32, device=ctx.device)
    for i, o in enumerate(outs):
        buf[i] = o
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=ctx.group)
    if not ctx.is_main:
        return None
    tiles: list[torch.Tensor] = [None] * num_items  # type: ignore[list-item]
    for r in range(world):
        for j, pos in enumerate(assign_items(num_items, r, world)):
            tiles[pos] = parts[r][j]
    return tiles
