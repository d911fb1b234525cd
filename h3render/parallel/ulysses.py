"""Ulysses sequence parallelism for the DiT: rows sharded across ranks, heads sharded inside attention.

Each rank holds a contiguous window of the packed sequence (`RowShard`). Everything except attention is row-local,
so the only communication per block is inside attention: an all-to-all turns `[S/W rows, all H heads]` into
`[all S rows, H/W heads]`, attention runs over the full sequence for its heads, and a second all-to-all turns it back
(DeepSpeed-Ulysses, Jacobs et al. 2023). The transform wraps only the attention call (`DiT.set_attention`), so the
model keeps one forward.

Padding: the sequence is padded at its end to a multiple of the world size (at most W-1 rows, all on the last rank).
After the first all-to-all the pad rows sit at the end of the full sequence, so attention runs on the first S rows
only — pad rows never act as keys — and the output is padded back before the return all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RowShard:
    """One rank's window `[start, end)` of a packed sequence of `seq_len` rows padded to `padded_len`.

    `end - start == padded_len // world_size` on every rank; rows at or past `seq_len` are padding.
    """

    start: int
    end: int
    seq_len: int
    padded_len: int

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def valid_end(self) -> int:
        """End of the real (non-pad) rows of this window."""
        return min(self.end, self.seq_len)


def shard_rows(seq_len: int, rank: int, world_size: int) -> RowShard:
    """Even contiguous windows with the least padding (ceil(S/W) rows each).

    Raises:
        ValueError: rank outside [0, world_size) or seq_len < world_size.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if seq_len < world_size:
        raise ValueError(f"packed sequence of {seq_len} rows cannot be split over {world_size} ranks")
    per = -(-seq_len // world_size)
    return RowShard(rank * per, (rank + 1) * per, seq_len, per * world_size)


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split `x` into W chunks along `scatter_dim`, send chunk i to rank i, concatenate received along `gather_dim`."""
    world = dist.get_world_size(group)
    inputs = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


def ulysses_attention(inner: AttentionFn, seq_len: int, group) -> AttentionFn:
    """Wrap `inner(q, k, v)` (`[B, S, H, D]`) for rows sharded over the ranks of `group`.

    Args:
        inner: the single-device attention (FA3 / cuDNN SDPA / SDPA), `[B, S, H, D]` in and out.
        seq_len: real (unpadded) length of the packed sequence.
        group: process group; its size must divide the number of heads.
    Returns:
        fn(q, k, v) taking this rank's rows `[B, S/W, H, D]` and returning `[B, S/W, H, D]`.
    """

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads = q.shape[2]
        world = dist.get_world_size(group)
        if heads % world:
            raise ValueError(f"Ulysses needs the world size ({world}) to divide the head count ({heads})")
        # [B, S/W, H, D] -> [B, S_pad, H/W, D]
        q, k, v = (_all_to_all(t, scatter_dim=2, gather_dim=1, group=group) for t in (q, k, v))
        padded = q.shape[1]
        out = inner(q[:, :seq_len], k[:, :seq_len], v[:, :seq_len])
        if padded > seq_len:
            out = torch.cat([out, out.new_zeros(out.shape[0], padded - seq_len, *out.shape[2:])], dim=1)
        # [B, S_pad, H/W, D] -> [B, S/W, H, D]
        return _all_to_all(out, scatter_dim=1, gather_dim=2, group=group)

    return attention


def gather_rows(local: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Concatenate every rank's `local` `[n_r, C]` rows in rank order (n_r = counts[r]) on all ranks.

    Only output-head rows (96- or 32-wide) travel this way; hidden states never do.
    """
    width = local.shape[1]
    most = max(counts)
    padded = local.new_zeros(most, width)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])
