"""Plain-torch reference of one VSA-H3 attention call (FastVideo 0.2.1 `video_sparse_attn_h3.py` semantics).

Order of operations and precisions follow docs research vsa.md §1.4/§5:

* pooled q, k (and v when a gate is given): fp32 sum over a tile's slots / its true size  -> `[H, n, D]`;
* tile scores `q̄ k̄ᵀ / sqrt(D)` in fp32                                                   -> `[H, n, n]`;
* budget `k = max(1, min(ceil((1 - s) * V), V))` in Python float64 (float32 gives 67 instead of 66 at V = 660);
* mask: every query tile keeps its top-k video key tiles, prefix key tiles always, prefix query tiles all tiles;
  all True when k == V;
* fine: token-level masked softmax attention over the valid rows of the kept tiles, fp32, cast to the input dtype;
* coarse (only with a gate): `softmax(scores over ALL tiles) @ v̄` in fp32, cast to the input dtype, broadcast to
  every row of its tile, times the gate, added to the fine output (two roundings in bf16, as FastVideo).
"""

from __future__ import annotations

import math

import torch

from h3render.kernels.qk_norm_rope.naive import qk_norm_rope_naive
from h3render.kernels.vsa.tiles import TILE, TilePlan, to_tiles

# Elements of one fp32 score chunk in the fine stage: bounds the reference's memory (2**26 * 4 B = 256 MB).
_CHUNK_ELEMS = 1 << 26


def topk_budget(sparsity: float, num_video: int) -> int:
    """Video key tiles kept per query tile: `max(1, min(ceil((1 - sparsity) * V), V))`.

    Computed in Python float64, as FastVideo's `compute_topk`: at V = 660, s = 0.9 this is 66 (float32: 67).
    """
    return max(1, min(math.ceil((1 - float(sparsity)) * num_video), num_video))


def pool_tiles_naive(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """fp32 mean of every tile's valid rows.

    Args:
        x: `[S, H, D]` packed rows.
    Returns:
        `[H, n, D]` float32 (sum over the zero-padded 64 slots in fp32, divided by the true size).
    """
    x_t = to_tiles(x, plan).view(plan.num_tiles, TILE, *x.shape[1:])  # [n, 64, H, D]
    pooled = x_t.sum(dim=1, dtype=torch.float32) / plan.sizes.to(torch.float32)[:, None, None]
    return pooled.transpose(0, 1)  # [H, n, D]


def vsa_prep_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    plan: TilePlan,
) -> tuple[torch.Tensor, ...]:
    """Reference of `vsa_prep` (`prep_triton.py`): q, k normed and rotated, v in tile order, the three tile means.

    Args:
        q, k, v: `[S, H, D]` packed rows (views of the qkv projection are fine), S = plan.seq_len.
        q_weight, k_weight, cos, sin, eps: as in `kernels.qk_norm_rope`.
    Returns:
        (q_out, k_out `[S, H, D]` contiguous in q's dtype, v_tiles `[n * 64, H, D]` with zero pad slots, then the fp32
        tile means `[H, n, D]` of q_out, k_out (the values as stored, in q's dtype) and v).
    """
    q_out, k_out, _ = qk_norm_rope_naive(q, k, None, q_weight, k_weight, cos, sin, eps)
    return (q_out, k_out, to_tiles(v, plan), pool_tiles_naive(q_out, plan), pool_tiles_naive(k_out, plan),
            pool_tiles_naive(v, plan))


def tile_scores(q_pooled: torch.Tensor, k_pooled: torch.Tensor) -> torch.Tensor:
    """`q̄ k̄ᵀ / sqrt(D)` in fp32 (divide after the matmul, as FastVideo). `[H, n, D]` x2 -> `[H, n, n]`."""
    return torch.matmul(q_pooled.float(), k_pooled.float().transpose(-1, -2)) / (q_pooled.shape[-1] ** 0.5)


def block_mask(scores: torch.Tensor, num_prefix: int, sparsity: float) -> torch.Tensor:
    """Kept (query tile, key tile) pairs. `scores [H, n, n]` fp32 -> bool `[H, n, n]`.

    Top-k over the video columns for every query tile, prefix columns always kept, prefix query rows all kept.
    """
    n = scores.shape[-1]
    num_video = n - num_prefix
    k = topk_budget(sparsity, num_video)
    if k == num_video:
        return torch.ones_like(scores, dtype=torch.bool)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask.scatter_(-1, scores[..., num_prefix:].topk(k, dim=-1).indices + num_prefix, True)
    mask[..., :num_prefix] = True
    mask[:, :num_prefix, :] = True
    return mask


def fine_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, plan: TilePlan
) -> torch.Tensor:
    """Token-level masked softmax attention, fp32 math: each row attends to the valid rows of its tile's kept tiles.

    Args:
        q, k, v: `[S, H, D]` packed rows.
        mask: `[H, n, n]` bool, kept (query tile, key tile) pairs.
    Returns:
        `[S, H, D]` in q's dtype. Query rows are processed in chunks (memory), per head.
    """
    s, heads, d = q.shape
    k_t = to_tiles(k, plan).float()  # [n*64, H, D], pad slots zero
    v_t = to_tiles(v, plan).float()
    slot_tile = torch.arange(plan.padded_len, device=q.device) // TILE  # [n*64]
    slot_valid = torch.arange(TILE, device=q.device)[None, :] < plan.sizes[:, None].to(q.device)  # [n, 64]
    slot_valid = slot_valid.reshape(-1)
    out = torch.empty(s, heads, d, dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMS // plan.padded_len)
    scale = 1.0 / math.sqrt(d)
    for h in range(heads):
        for r0 in range(0, s, rows):
            r1 = min(s, r0 + rows)
            scores = q[r0:r1, h].float() @ k_t[:, h].T * scale  # [r, n*64]
            allow = mask[h][plan.tile_of_row[r0:r1]][:, slot_tile] & slot_valid[None, :]
            scores = scores.masked_fill(~allow, float("-inf"))
            out[r0:r1, h] = scores.softmax(-1) @ v_t[:, h]
    return out.to(q.dtype)


def coarse_attention_naive(scores: torch.Tensor, v_pooled: torch.Tensor) -> torch.Tensor:
    """`softmax(scores, -1) @ v̄` in fp32 over all tiles, no mask. `[H, n, n]`, `[H, n, D]` -> `[H, n, D]` fp32."""
    return torch.matmul(torch.softmax(scores.float(), dim=-1), v_pooled.float())


def add_gated_coarse(fine: torch.Tensor, coarse: torch.Tensor, gate: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """`fine + dtype(coarse)[tile_of_row] * gate`, every op at the rows' dtype (FastVideo's order and roundings).

    Args:
        fine, gate: `[S, H, D]`; coarse: `[H, n, D]` fp32.
    Returns:
        `[S, H, D]` in fine's dtype.
    """
    c = coarse.transpose(0, 1).to(fine.dtype)[plan.tile_of_row]  # [S, H, D]
    return fine + c * gate.to(fine.dtype)


def vsa_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    plan: TilePlan,
    sparsity: float,
) -> torch.Tensor:
    """One VSA-H3 attention call, plain torch (the test oracle).

    Args:
        q, k, v: `[S, H, D]` packed rows (post-norm, post-RoPE q and k), bf16 or fp32; S = plan.seq_len.
        gate: `[S, H, D]` output of the gate projection, or None / all zero (no coarse branch).
        plan: the layout's `TilePlan`.
        sparsity: s in [0, 1): fraction of video key tiles dropped per query tile.
    Returns:
        `[S, H, D]` in q's dtype.
    """
    qp, kp = pool_tiles_naive(q, plan), pool_tiles_naive(k, plan)
    scores = tile_scores(qp, kp)
    out = fine_attention_naive(q, k, v, block_mask(scores, plan.num_prefix, sparsity), plan)
    if gate is None or not bool(gate.any()):  # an all-zero gate adds exactly 0 (FastVideo skips the branch)
        return out
    return add_gated_coarse(out, coarse_attention_naive(scores, pool_tiles_naive(v, plan)), gate, plan)
