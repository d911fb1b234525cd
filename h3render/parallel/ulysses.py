"""Ulysses sequence parallelism for the DiT: rows sharded across ranks, heads sharded inside attention.

Each rank holds a contiguous window of the packed sequence (`RowShard`). Everything except attention is row-local,
so the only communication per block is inside attention: an all-to-all turns `[S/W rows, all H heads]` into
`[all S rows, H/W heads]`, attention runs over the full sequence for its heads, and a second all-to-all turns it back
(DeepSpeed-Ulysses, Jacobs et al. 2023).

Padding: the sequence is padded at its end to a multiple of the world size (at most W-1 rows, all on the last rank).
After the first all-to-all the pad rows sit at the end of the full sequence, so attention runs on the first S rows
only — pad rows never act as keys — and the output is padded back before the return all-to-all.

The transform replaces the block attention's norm + RoPE + attention step (`DiT.set_qkv_attention`), so the fused
norm kernel can write straight into the all-to-all's send layout; the model keeps one forward.

Video sparse attention (FastH3 VSA students) rides the same exchange: its gate `[S/W, H, D]` travels with q/k/v, and
since each rank then holds whole rows of its heads, tiles stay whole and the result equals one device (FastVideo's
`DistributedAttention_VSA` does the same).
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


# Head chunks per rank pipelined against attention (see `ulysses_qkv_attention`). Measured on 2xH200 (NVLink),
# 50-block forward at 1344x768x243: 1 chunk 8.147 s, 2 chunks 9.763 s, 4 chunks 9.808 s: NCCL's all-to-all kernels
# running beside FlashAttention-3 slow it far more than the ~3.7 ms per block they would hide (docs/performance.md
# §2). Kept as an option for links where communication dominates.
DEFAULT_CHUNKS = 1


def chunks_for(local_heads: int, wanted: int = DEFAULT_CHUNKS) -> int:
    """The largest chunk count <= `wanted` that divides a rank's `local_heads` (1 when nothing larger does)."""
    return max(c for c in range(1, max(1, wanted) + 1) if local_heads % c == 0)


def ulysses_qkv_attention(inner: AttentionFn, seq_len: int, group, chunks: int = 1):
    """QK norm + RoPE + attention for rows sharded over the ranks of `group` (a `DiT.set_qkv_attention` function).

    Takes this rank's qkv projection `[S/W, H, 3, D]` and returns its attention output `[S/W, H, D]`. The fused
    norm/RoPE kernel writes q, k and v straight into head-group-major send buffers `[W, S/W, H/W, D]`, so the
    all-to-all (`all_to_all_single`) needs no gather copy and what each rank receives is already the contiguous
    full sequence `[S_pad, H/W, D]` of its heads. With `chunks` > 1 a rank's heads are split into that many
    groups: the all-to-all of group g+1 runs while group g's attention computes, and group g's output travels
    home during group g+1's attention, so only the first group's inbound and the last group's outbound
    communication are exposed.

    Args:
        inner: single-device attention, `[1, S, h, D]` q/k/v in, `[1, S, h, D]` out.
        seq_len: real (unpadded) length of the packed sequence; pad rows never act as keys.
        group: process group; its size W must divide H, and `chunks` must divide H / W.
        chunks: head groups per rank (1 = no pipelining).
    Raises:
        ValueError: W does not divide the heads or `chunks` does not divide H / W.
    """

    def qkv_attention(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, rope, eps: float,
                      sparse=None, gate: torch.Tensor | None = None):
        # sparse: a `SparseAttention` over the full sequence replacing `inner`; gate: its `[S/W, H, D]` rows or None.
        from h3render.models.dit import qk_norm_rope

        rows, heads, _, dim = qkv.shape
        world = dist.get_world_size(group)
        if heads % world:
            raise ValueError(f"Ulysses needs the world size ({world}) to divide the head count ({heads})")
        local = heads // world
        if local % chunks:
            raise ValueError(f"{chunks} head chunks do not divide the {local} heads of a rank")
        width = local // chunks
        padded = rows * world
        cos, sin = rope if rope is not None else (None, None)

        parts = 3 if gate is None else 4
        inbound = []
        for g in range(chunks):
            send = qkv.new_empty(parts, world, rows, width, dim)  # q/k/v(/gate) x destination rank x my rows
            for w in range(world):
                heads_wg = slice(w * local + g * width, w * local + (g + 1) * width)
                part = qkv[:, heads_wg]  # [S/W, width, 3, D] view
                qk_norm_rope(part[:, :, 0], part[:, :, 1], part[:, :, 2], q_weight, k_weight, cos, sin, eps,
                             out=(send[0, w], send[1, w], send[2, w]))
                if gate is not None:
                    send[3, w].copy_(gate[:, heads_wg])
            recv = torch.empty_like(send)  # q/k/v(/gate) x source rank (= row window) x its rows
            works = [dist.all_to_all_single(recv[i], send[i], group=group, async_op=True) for i in range(parts)]
            inbound.append((recv, works))

        outbound = []
        for recv, works in inbound:
            for work in works:
                work.wait()
            q, k, v = (recv[i].view(padded, width, dim)[:seq_len] for i in range(3))
            if sparse is None:
                out = inner(q[None], k[None], v[None])[0]  # [S, width, D]
            else:
                out = sparse(q, k, v, None if gate is None else recv[3].view(padded, width, dim)[:seq_len])
            if padded > seq_len:
                out = torch.cat([out, out.new_zeros(padded - seq_len, width, dim)])
            back = out.new_empty(world, rows, width, dim)  # source head group x my rows
            outbound.append((back, dist.all_to_all_single(back, out.contiguous(), group=group, async_op=True)))

        result = qkv.new_empty(rows, world, chunks, width, dim)  # head = (w * chunks + g) * width + j
        for g, (back, work) in enumerate(outbound):
            work.wait()
            result[:, :, g].copy_(back.transpose(0, 1))
        return result.view(rows, heads, dim)

    return qkv_attention


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
