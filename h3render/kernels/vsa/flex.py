"""The fine stage of VSA-H3 through PyTorch's `flex_attention` with a 64x64 `BlockMask` (the checked alternative to
the Triton kernel in `triton_impl.py`).

q/k/v are scattered into the zero-padded tile buffer `[1, H, n*64, D]` so that flex blocks are tiles. Per
(head, query tile) the kept key tiles are split into full blocks (tile of 64 rows: no mask work) and partial blocks
(ragged tiles: `mask_mod` drops the empty slots). Measured by the issue on an H200 (torch 2.11): 0.0539 s per layer
at the real geometry; 64-row query blocks need `kernel_options` (flex's default block sizes reject them).
"""

from __future__ import annotations

import math

import torch

from h3render.kernels.vsa.tiles import TILE, TilePlan, from_tiles, to_tiles

_compiled = None


def _flex():
    """flex_attention, compiled once on first CUDA use (eager flex is the slow reference path)."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def kept_tiles(plan: TilePlan, sel: torch.Tensor | None, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query tile's kept key tiles, ascending, padded to n columns.

    Args:
        sel: `[H, V, K]` int32 selected video tiles (absolute ids) or None (all tiles kept).
    Returns:
        `(index [H, n, n] int32, count [H, n] int32)`: row (h, i) keeps `index[h, i, :count[h, i]]`.
    """
    n, p, dev = plan.num_tiles, plan.num_prefix, plan.sizes.device
    index = torch.arange(n, dtype=torch.int32, device=dev).expand(heads, n, n).clone()
    count = torch.full((heads, n), n, dtype=torch.int32, device=dev)
    if sel is not None:
        k = sel.shape[-1]
        index[:, p:, p:p + k] = sel
        index[:, p:, p + k:] = 0
        count[:, p:] = p + k
    return index, count


def _split_full(index: torch.Tensor, count: torch.Tensor, sizes: torch.Tensor):
    """(partial_num, partial_index, full_num, full_index) of flex's block mask: full = a 64-row key tile."""
    valid = torch.arange(index.shape[-1], device=index.device) < count[..., None]
    full = (sizes[index.long()] == TILE) & valid
    partial = ~full & valid
    # Stable sorts keep each kind in ascending tile order, ahead of the padding entries.
    full_first = torch.argsort((~full).to(torch.int8) + (~valid).to(torch.int8), dim=-1, stable=True)
    partial_first = torch.argsort((~partial).to(torch.int8) + (~valid).to(torch.int8), dim=-1, stable=True)
    return (partial.sum(-1, dtype=torch.int32), torch.gather(index, -1, partial_first),
            full.sum(-1, dtype=torch.int32), torch.gather(index, -1, full_first))


def fine_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TilePlan, sel: torch.Tensor | None
) -> torch.Tensor:
    """Block-sparse fine attention via flex_attention.

    Args:
        q, k, v: `[S, H, D]` packed rows; sel: `[H, V, K]` int32 or None (see `kept_tiles`).
    Returns:
        `[S, H, D]` in q's dtype (packed row order).
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    heads, d = q.shape[1], q.shape[2]
    index, count = kept_tiles(plan, sel, heads)
    part_num, part_idx, full_num, full_idx = _split_full(index, count, plan.sizes)
    slot_valid = plan.row_of_slot >= 0  # [n*64]
    # The mask_mod must state the whole mask: eager flex evaluates it everywhere, ignoring the block lists, while
    # the compiled kernel evaluates it only inside partial blocks.
    keep = torch.zeros(heads, plan.num_tiles, plan.num_tiles + 1, dtype=torch.bool, device=q.device)
    cols = torch.where(torch.arange(index.shape[-1], device=q.device) < count[..., None], index.long(),
                       plan.num_tiles)  # padding entries land in the extra column
    keep = keep.scatter_(-1, cols, True)[..., :-1]  # [H, n, n]

    def key_slot_filled(b, h, q_idx, kv_idx):
        return keep[h, q_idx // TILE, kv_idx // TILE] & slot_valid[kv_idx]

    kwargs = dict(full_kv_num_blocks=full_num[None], full_kv_indices=full_idx[None], BLOCK_SIZE=TILE,
                  mask_mod=key_slot_filled, seq_lengths=(plan.padded_len, plan.padded_len))
    try:
        block_mask = BlockMask.from_kv_blocks(part_num[None], part_idx[None], compute_q_blocks=False, **kwargs)
    except TypeError:  # torch without `compute_q_blocks`
        block_mask = BlockMask.from_kv_blocks(part_num[None], part_idx[None], **kwargs)
    q_t, k_t, v_t = (to_tiles(x, plan).transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n*64, D]
    if q.is_cuda:
        out = _flex()(q_t, k_t, v_t, block_mask=block_mask, scale=1.0 / math.sqrt(d),
                      kernel_options={"BLOCK_M": TILE, "BLOCK_N": TILE})
    else:
        out = flex_attention(q_t, k_t, v_t, block_mask=block_mask, scale=1.0 / math.sqrt(d))
    return from_tiles(out[0].transpose(0, 1), plan)  # [S, H, D]
