"""The DiT forward on several ranks: each rank embeds and runs its own window of packed rows, attention is Ulysses,
and only the output-head rows (96- and 32-wide) are gathered so every rank holds the full velocity for the Euler step.
"""

from __future__ import annotations

import torch

from h3render.parallel.groups import ParallelContext
from h3render.parallel.ulysses import RowShard, chunks_for, gather_rows, shard_rows, ulysses_qkv_attention


def _span_count(index: torch.Tensor, shard: RowShard) -> int:
    bounds = torch.searchsorted(index, torch.tensor([shard.start, shard.end], dtype=index.dtype, device=index.device))
    return int(bounds[1] - bounds[0])


class _UlyssesState:
    """Which (sequence length, head chunks) the DiT's attention wrappers were built for (rebuilt on change)."""

    key: tuple[int, int] | None = None


def install_ulysses(dit, base_attention, seq_len: int, ctx: ParallelContext, chunks: int | None = None) -> None:
    """Wrap every block's attention (not the token refiner's: it sees only the replicated text rows)."""
    state = getattr(dit, "_ulysses_state", None)
    if state is None:
        state = _UlyssesState()
        dit._ulysses_state = state
    local_heads = dit.cfg.num_attention_heads // ctx.world_size
    chunks = chunks_for(local_heads) if chunks is None else chunks
    if state.key != (seq_len, chunks):
        dit.set_qkv_attention(ulysses_qkv_attention(base_attention, seq_len, ctx.group, chunks))
        state.key = (seq_len, chunks)


def sharded_forward(dit, ctx: ParallelContext, video_rows, audio_rows, text, layout, tables, timestep_index, rope,
                    base_attention=None, chunks: int | None = None):
    """`dit(...)` computed across the ranks of `ctx`; returns the full `(video_velocity, audio_velocity)` on every rank.

    Every rank passes the same full inputs (the latents are small: 72,576 × 96 fp32 = 28 MB at release); each embeds
    only its own rows (`DiT.forward(window=...)`), so hidden states are never gathered. `chunks`: head groups per
    rank pipelined against attention (`ulysses_qkv_attention`; default `DEFAULT_CHUNKS` where it divides).
    """
    if base_attention is None:
        from h3render.models.attention import attention as base_attention
    install_ulysses(dit, base_attention, layout.seq_len, ctx, chunks)
    shards = [shard_rows(layout.seq_len, r, ctx.world_size) for r in range(ctx.world_size)]
    mine = shards[ctx.rank]
    video, audio = dit(video_rows, audio_rows, text, layout, tables, timestep_index, rope,
                       window=(mine.start, mine.end))
    video_counts = [_span_count(layout.video_index, s) for s in shards]
    audio_counts = [_span_count(layout.audio_index, s) for s in shards]
    return gather_rows(video, video_counts, ctx.group), gather_rows(audio, audio_counts, ctx.group)
