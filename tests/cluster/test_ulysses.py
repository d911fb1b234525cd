"""Ulysses attention on 2 and 4 CPU ranks (gloo) equals single-device norm + RoPE + attention over the full sequence."""

from __future__ import annotations

import pytest
import torch

from h3render.models.dit import qk_norm_rope, sdpa_attention
from h3render.parallel.ulysses import chunks_for, shard_rows, ulysses_qkv_attention
from tests._spawn import cpu_rank, put_result, run_ranks

def _inputs(seq_len: int, heads: int, dim: int, rot: int):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(seq_len, heads, 3, dim, generator=g)
    angles = torch.rand(seq_len, rot // 2, generator=g) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], dim=1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=1)
    q_weight = 1 + 0.1 * torch.randn(dim, generator=g)
    k_weight = 1 + 0.1 * torch.randn(dim, generator=g)
    return qkv, cos, sin, q_weight, k_weight


def _reference(seq_len, heads, dim, rot):
    qkv, cos, sin, qw, kw = _inputs(seq_len, heads, dim, rot)
    q, k, v = qk_norm_rope(*qkv.unbind(2), qw, kw, cos, sin, 1e-5)
    return sdpa_attention(q[None], k[None], v[None])[0]  # [S, H, D]


def _worker(rank: int, port: int, seq_len: int, heads: int, chunks: int, world: int, queue) -> None:
    with cpu_rank(rank, port, world) as ctx:
        dim, rot = 16, 12
        qkv, cos, sin, qw, kw = _inputs(seq_len, heads, dim, rot)
        shard = shard_rows(seq_len, rank, world)
        pad = shard.end - shard.valid_end
        mine = torch.cat([qkv[shard.start:shard.valid_end], torch.zeros(pad, heads, 3, dim)])
        rope = tuple(torch.cat([t[shard.start:shard.valid_end], torch.ones(pad, rot)]) for t in (cos, sin))
        fn = ulysses_qkv_attention(sdpa_attention, seq_len, ctx.group, chunks)
        out = fn(mine, qw, kw, rope, 1e-5)
        put_result(queue, (rank, shard.start, shard.valid_end, out[: shard.valid_end - shard.start].clone()))


# 4 ranks x 2 heads each is also the multi-rank render's former 4-rank case (tests/cluster/test_parallel.py), here
# without 5 interpreters: the ranks fork from the preloaded server (tests/_spawn.py).
@pytest.mark.parametrize("seq_len, heads, chunks, world", [(10, 4, 1, 2), (9, 4, 2, 2), (9, 8, 4, 2), (11, 8, 2, 4)])
def test_ulysses_qkv_attention_matches_one_device(seq_len, heads, chunks, world):
    """Odd lengths put a pad row on the last rank: it must never act as a key (the result would change)."""
    parts = sorted(run_ranks(_worker, world, (seq_len, heads, chunks, world)), key=lambda part: part[0])
    ref = _reference(seq_len, heads, 16, 12)
    got = torch.cat([out for _, _, _, out in parts])
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_chunks_for_divides_local_heads():
    assert [chunks_for(h, 2) for h in (28, 7, 1, 14)] == [2, 1, 1, 2]
    assert chunks_for(28, 4) == 4 and chunks_for(14, 4) == 2
