"""Video VAE decode split across ranks by (temporal window x spatial tile) work items.

Every rank decodes its share of each window's items (round-robin inside the window, so all ranks stay busy on every
window), in full batches that run across windows; the raw tiles of a window are gathered to rank 0, which stitches, cross-fades and yields frames exactly as
the single-GPU `VideoVAE.decode_stream` does (same `stitch_window` / `assemble_frames`), so the blend is identical.
Window by window keeps the stream going into the H.264 encoder and bounds memory to one window of tiles.

Tile shapes follow from the plan (every item of a plan shares one shape), so the only per-window communication is
one gather of tile tensors: no shape exchange, no host round trip.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from h3render.models.vae_blend import assemble_frames, stitch_window
from h3render.parallel.groups import ParallelContext


def assign_items(num_items: int, rank: int, world_size: int) -> list[int]:
    """Positions (within one window's item list) that `rank` decodes: round-robin, so counts differ by <= 1."""
    return list(range(rank, num_items, world_size))


def items_on_rank(plan, rank: int, world_size: int) -> int:
    """How many of `plan`'s items `rank` decodes (`assign_items` in every window): the length of its queue in
    `_stitched_windows`, from which `VideoVAE.batch_for` picks its batch size."""
    return plan.num_windows * len(assign_items(plan.tiles_per_window, rank, world_size))


def item_shape(vae, plan) -> tuple[int, int, int, int]:
    """`[3, frames_per_item, tile_h_px, tile_w_px]`: the raw output of every item of `plan`."""
    it = plan.items[0]
    ratio = vae.config.spatial_ratio
    return (3, plan.geometry.frames_per_item, (it.latent_y[1] - it.latent_y[0]) * ratio,
            (it.latent_x[1] - it.latent_x[0]) * ratio)


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
        yield from ((first, vae.to_rgb(frames)) for first, frames in assemble_frames(plan, windows))
    else:
        for _ in windows:
            pass


@torch.no_grad()
def _stitched_windows(vae, latent, plan, ctx: ParallelContext, batch_size: int) -> Iterator[torch.Tensor | None]:
    """Each rank decodes its items of all windows in full batches that run across window boundaries (a window of 28
    items split over 2 ranks is 14 per rank: per-window batches of 8 would pad 14 to 16, 14% idle work); a window
    is gathered as soon as this rank's items of it are decoded. Every rank derives the same schedule from the
    plan, so the gathers are issued in the same order everywhere."""
    shape = item_shape(vae, plan)
    windows = [plan.window_items(w) for w in range(plan.num_windows)]
    shares = [[items[i] for i in assign_items(len(items), ctx.rank, ctx.world_size)] for items in windows]
    queue = [it for share in shares for it in share]  # this rank's items, window-major
    batch_size = vae.batch_for(len(queue), batch_size)
    decoded: dict[int, torch.Tensor] = {}
    position = 0
    for w, (items, share) in enumerate(zip(windows, shares)):
        while any(it.index not in decoded for it in share):
            batch = queue[position: position + batch_size]
            decoded.update(zip((it.index for it in batch), vae.decode_items(latent, batch, batch_size)))
            position += len(batch)
        tiles = _gather_tiles([decoded.pop(it.index) for it in share], len(items), shape, ctx)
        yield stitch_window(plan, {it.index: tiles[i] for i, it in enumerate(items)}, w) if ctx.is_main else None


def _gather_tiles(outs: list[torch.Tensor], num_items: int, shape, ctx: ParallelContext) -> list[torch.Tensor] | None:
    """All tiles of one window, in item order, on rank 0 (None elsewhere)."""
    world = ctx.world_size
    per_rank = -(-num_items // world)
    # Ranks with fewer items pad with zero tiles so every rank sends the same size.
    buf = torch.zeros((per_rank, *shape), dtype=torch.float32, device=ctx.device)
    for i, o in enumerate(outs):
        buf[i] = o
    parts = [torch.empty_like(buf) for _ in range(world)] if ctx.is_main else None
    dist.gather(buf, parts, dst=_global_rank(ctx, 0), group=ctx.group)
    if not ctx.is_main:
        return None
    tiles: list[torch.Tensor] = [None] * num_items  # type: ignore[list-item]
    for r in range(world):
        for j, pos in enumerate(assign_items(num_items, r, world)):
            tiles[pos] = parts[r][j]
    return tiles


def _global_rank(ctx: ParallelContext, group_rank: int) -> int:
    return dist.get_global_rank(ctx.group, group_rank) if ctx.group is not dist.group.WORLD else group_rank


def audio_rank(ctx: ParallelContext) -> int:
    """The rank that decodes the audio: the last one, which has no MP4 to write."""
    return ctx.world_size - 1


def share_waveform(waveform: torch.Tensor | None, samples_shape: tuple[int, int], ctx: ParallelContext,
                   seconds: float = 0.0) -> tuple[torch.Tensor | None, float]:
    """Send the audio rank's waveform `[2, samples]` float32 and the `seconds` its decode took to rank 0; returns
    both there, (None, `seconds`) elsewhere. The seconds go too so that rank 0's sidecar has a `vae_audio` stage."""
    src = audio_rank(ctx)
    if src == 0:
        return waveform, seconds
    timing = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    if ctx.rank == src:
        dist.send(waveform.contiguous(), dst=_global_rank(ctx, 0), group=ctx.group)
        dist.send(timing, dst=_global_rank(ctx, 0), group=ctx.group)
        return None, seconds
    if ctx.is_main:
        out = torch.empty(samples_shape, dtype=torch.float32, device=ctx.device)
        dist.recv(out, src=_global_rank(ctx, src), group=ctx.group)
        dist.recv(timing, src=_global_rank(ctx, src), group=ctx.group)
        return out, float(timing.item())
    return None, seconds
