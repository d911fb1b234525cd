"""Video sparse attention of the FastH3 students (FastVideo 0.2.1 `VIDEO_SPARSE_ATTN_H3`, tile 64).

One call on the packed rows of one sequence (all heads or a Ulysses head shard):

1. coarse, torch + a Triton pool kernel on CUDA: fp32 tile means of q and k (or the caller's: `pooled`, which
   `vsa_prep` computes in the pass that writes q, k and v), fp32 tile scores `[H, n, n]`, the per-(head, query
   tile) top-k over video key tiles (`naive.topk_budget`);
2. fine: block-sparse attention of every 64-row query tile over its kept key tiles, by the Triton kernel
   (`fine="triton"`, default on CUDA), flex_attention (`fine="flex"`) or the token-level torch reference
   (`fine="torch"`, default elsewhere);
3. with a gate: `softmax(scores) @ v̄` (fp32, all tiles; its GEMM in TF32 on CUDA: `COARSE_TF32`) cast to the
   rows' dtype, times the gate, added to every row (fused into the Triton kernel's epilogue).

The reference of the whole call is `vsa_attention_naive` (naive.py); tile geometry is `tile_plan` (tiles.py).
"""

from __future__ import annotations

import torch

from h3render.kernels.qk_norm_rope import check_inputs
from h3render.kernels.utils import use_triton_for
from h3render.kernels.vsa.naive import (
    add_gated_coarse,
    block_mask,
    coarse_attention_naive,
    fine_attention_naive,
    pool_tiles_naive,
    tile_scores,
    topk_budget,
    vsa_attention_naive,
    vsa_prep_naive,
)
from h3render.kernels.vsa.quant import fine_attention_int8_naive, head_mean_from_pooled
from h3render.kernels.vsa.tiles import TILE, TilePlan, empty_tiles, tile_plan

__all__ = ["FINE_BACKENDS", "TILE", "TilePlan", "empty_tiles", "fine_backend", "select_tiles", "tile_plan",
           "topk_budget", "vsa_attention", "vsa_attention_naive", "vsa_prep", "vsa_prep_naive"]

FINE_BACKENDS = ("triton", "flex", "torch")
# The coarse output's GEMM (`softmax(scores) @ v̄`, [H, n, n] x [H, n, D]) in TF32 on CUDA: fp32 runs cuBLAS's FFMA
# kernel. Softmax + GEMM at the released geometry on an H200: 0.69 ms fp32, 0.43 ms TF32, rel. error 2.7e-4 against
# fp32 (docs/performance.md §27.1), below the bf16 rounding its result gets before the gate multiplies it. The scores
# stay fp32: they decide the kept sets, and ties there matter (sglang measured bf16 scores' ties costing 3.9 %).
COARSE_TF32 = True


def coarse_output(scores: torch.Tensor, v_pooled: torch.Tensor) -> torch.Tensor:
    """`naive.coarse_attention_naive` (`[H, n, n]`, `[H, n, D]` -> `[H, n, D]` fp32), its GEMM in TF32 on CUDA when
    `COARSE_TF32`."""
    if not (COARSE_TF32 and scores.is_cuda):
        return coarse_attention_naive(scores, v_pooled)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return coarse_attention_naive(scores, v_pooled)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def select_tiles(scores: torch.Tensor, plan: TilePlan, sparsity: float, *, use_triton: bool | None = None
                 ) -> torch.Tensor | None:
    """Kept video key tiles of every video query tile.

    Args:
        scores: `[H, n, n]` fp32 tile scores.
        use_triton: None = the one-launch Triton select (`select_triton.py`) on CUDA, torch `topk` + sort elsewhere;
            True / False force one (True on CPU tensors needs TRITON_INTERPRET=1).
    Returns:
        `[H, V, k]` int32 absolute tile ids (P..n-1), ascending; None when k == V (every tile kept).
    """
    p, v = plan.num_prefix, plan.num_video
    k = topk_budget(sparsity, v)
    if k == v:
        return None
    if use_triton_for(scores, use_triton):
        from h3render.kernels.vsa.select_triton import select_tiles_triton

        return select_tiles_triton(scores, p, k)
    idx = scores[:, p:, p:].topk(k, dim=-1, sorted=False).indices  # [H, V, k]
    return (idx.sort(dim=-1).values + p).to(torch.int32).contiguous()


def fine_backend(q: torch.Tensor, fine: str | None) -> str:
    """The fine stage `vsa_attention(..., fine=fine)` runs on tensors like `q`: `fine`, or for None "triton" on
    CUDA and "torch" elsewhere. Raises ValueError on an unknown name."""
    if fine is None:
        return "triton" if use_triton_for(q, None) else "torch"
    if fine not in FINE_BACKENDS:
        raise ValueError(f"h3render/kernels/vsa: unknown fine backend {fine!r}; "
                         f"choose one of {', '.join(FINE_BACKENDS)}")
    return fine


def _check_pooled(pooled, q: torch.Tensor, plan: TilePlan, need_v: bool) -> None:
    """`vsa_attention`'s `pooled`: three `[H, n, D]` fp32 tensors on q's device (v̄ may be None without a gate)."""
    want = (q.shape[1], plan.num_tiles, q.shape[2])
    if len(pooled) != 3 or any((p is None and (i < 2 or need_v)) or (p is not None and (
            tuple(p.shape) != want or p.dtype != torch.float32 or p.device != q.device)) for i, p in enumerate(pooled)):
        got = [None if p is None else (list(p.shape), p.dtype) for p in pooled]
        raise ValueError(f"h3render/kernels/vsa: pooled must be the tile means (q, k, v) of {list(want)} float32 on "
                         f"{q.device}{'' if need_v else ' (v may be None without a gate)'}, got {got}")


def vsa_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    plan: TilePlan,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    use_triton: bool | None = None,
    **launch,
) -> tuple[torch.Tensor, ...]:
    """One pass from the qkv projection to a VSA call's inputs: `qk_norm_rope` of q and k, v in tile order, and the
    fp32 tile means of all three (`vsa_attention(..., v_tiles=True, pooled=means)` then runs no pool).

    Args:
        q, k, v: `[S, H, D]` packed rows, S = plan.seq_len, one dtype (bf16 on GPU), any row/head strides, unit stride
            over D (the DiT: `qkv.view(S, H, 3, D).unbind(2)`); D a power of two, H any (a Ulysses head subset too).
        q_weight, k_weight, cos, sin, eps: as in `kernels.qk_norm_rope` (`[D]` weights or both None; `[S, R]` fp32
            tables, R even <= D, or both None).
        plan: the layout's `TilePlan`, on q's device.
        out: optional preallocated contiguous (q_out `[S, H, D]`, k_out `[S, H, D]`, v_tiles `[n * 64, H, D]`), q's
            dtype.
        use_triton: None = the Triton kernel (`prep_triton.py`) on CUDA tensors, the torch reference
            (`naive.vsa_prep_naive`) elsewhere; True / False force one.
        launch: the Triton kernel's `rows`, `block_h`, `num_warps`, `stages` (`prep_triton.vsa_prep_triton`; the
            bench's).
    Returns:
        (q_out, k_out, v_tiles, q_mean, k_mean, v_mean): q_out, k_out `[S, H, D]` contiguous, what `qk_norm_rope`
        writes (the reference calls its reference; the Triton kernel shares its math, `norm_rope`: the same bits in
        the interpreter, and compiled wherever both kernels spread a head's channels over the lanes alike, as for
        the released 128-channel heads at the launches of prep_triton.py's note; elsewhere within one rounding); v_tiles
        `[n * 64, H, D]` contiguous, v row s at slot `plan.slot[s]`, pad slots 0 (`empty_tiles` + the v_slot
        scatter); the means `[H, n, D]` fp32 of q_out, k_out (as stored) and v per tile: `pool_tiles_*` of those
        tensors up to fp32 summation order.
    Raises:
        ValueError: shapes, dtypes or strides that do not fit the above.
    """
    check_inputs(q, k, v, q_weight, k_weight, cos, sin)
    if v is None or q.ndim != 3 or q.shape[0] != plan.seq_len or q.shape[2] & (q.shape[2] - 1):
        raise ValueError(f"h3render/kernels/vsa: vsa_prep takes q, k, v [S={plan.seq_len}, H, D] with D a power of "
                         f"two, got {list(q.shape)} and v {'None' if v is None else list(v.shape)}")
    s, heads, d = q.shape
    if out is not None:
        shapes = ((s, heads, d), (s, heads, d), (plan.padded_len, heads, d))
        if len(out) != 3 or any(tuple(o.shape) != shape or o.dtype != q.dtype or o.device != q.device
                                or not o.is_contiguous() for o, shape in zip(out, shapes)):
            raise ValueError(f"h3render/kernels/vsa: vsa_prep's out must be contiguous {', '.join(map(str, shapes))} "
                             f"{q.dtype}")
    if use_triton_for(q, use_triton):
        from h3render.kernels.vsa.prep_triton import vsa_prep_triton

        return vsa_prep_triton(q, k, v, q_weight, k_weight, cos, sin, eps, plan, out=out, **launch)
    result = vsa_prep_naive(q, k, v, q_weight, k_weight, cos, sin, eps, plan)
    if out is not None:
        for dst, src in zip(out, result):
            dst.copy_(src)
        result = (*out, *result[3:])
    return result


def vsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor | None,
    plan: TilePlan,
    sparsity: float,
    *,
    fine: str | None = None,
    qk_int8: bool = False,
    v_tiles: bool = False,
    pooled: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """VSA-H3 attention over one packed sequence.

    Args:
        q, k, v: `[S, H, D]` packed rows (q, k post-norm, post-RoPE), one dtype (bf16 on GPU), unit stride over D;
            S = plan.seq_len (no pad rows); H any head subset (Ulysses); D a power of two for the Triton path.
        gate: `[S, H, D]` gate projection output (`gate_proj`, no activation) or None: no coarse branch.
        plan: `tile_plan(...)` of the layout, tensors on q's device.
        sparsity: s in [0, 1): k = max(1, min(ceil((1 - s) V), V)) video key tiles per query tile.
        fine: "triton" | "flex" | "torch"; None = Triton on CUDA tensors, the torch reference elsewhere.
        qk_int8: the Triton fine stage computes QKᵀ from int8 codes (`quant.py`: smoothed keys, per-row scales);
            the torch fine stage then runs its reference `fine_attention_int8_naive`; flex refuses it.
        v_tiles: v is `[plan.padded_len, H, D]` in tile order (`tiles.empty_tiles` written through `plan.slot`; pad
            slots finite) instead of packed rows: the Triton stages read it as is (no `gather_tiles` copy), the torch
            and flex ones take its valid rows back to packed order first (`v[plan.slot]`). Same result either way.
        pooled: the fp32 tile means `(q̄, k̄, v̄)`, `[H, n, D]` each (v̄ may be None without a gate), as `vsa_prep`
            returns them with q, k and v_tiles: the call then runs no pool of its own (three passes over q, k, v
            fewer). The result is the call without them wherever the means are bit-equal (`pool_tiles_*` of the
            same q, k, v); `vsa_prep`'s differ from the pools' in fp32 summation order only.
    Returns:
        `[S, H, D]` in q's dtype.
    Raises:
        ValueError: shapes that do not match the plan, or an unknown `fine`.
    """
    v_shape = (plan.padded_len, *q.shape[1:]) if v_tiles else q.shape
    if q.ndim != 3 or q.shape[0] != plan.seq_len or k.shape != q.shape or v.shape != v_shape:
        raise ValueError(f"h3render/kernels/vsa: q, k must be [{plan.seq_len}, H, D] for this plan and v "
                         f"{'[' + str(plan.padded_len) + ', H, D] (v_tiles)' if v_tiles else 'like q'}, got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"h3render/kernels/vsa: gate must be {list(q.shape)}, got {list(gate.shape)}")
    backend = fine_backend(q, fine)
    if qk_int8 and backend == "flex":
        raise ValueError("h3render/kernels/vsa: qk_int8 runs on the triton or torch fine stage, not flex")
    if v_tiles and backend != "triton":
        v, v_tiles = v[plan.slot], False  # the torch / flex stages take packed rows
    if pooled is not None:
        _check_pooled(pooled, q, plan, gate is not None)
    elif backend == "torch" and not q.is_cuda and not qk_int8:
        return vsa_attention_naive(q, k, v, gate, plan, sparsity)

    if pooled is not None:
        q_pooled, k_pooled, v_pooled = pooled
    else:
        if q.is_cuda or backend == "triton":
            from h3render.kernels.vsa.triton_impl import pool_tiles_triton as pool
        else:
            pool = pool_tiles_naive
        q_pooled, k_pooled = pool(q, plan), pool(k, plan)
        v_pooled = None if gate is None else pool(v, plan, tiled=True) if v_tiles else pool(v, plan)
    scores = tile_scores(q_pooled, k_pooled)  # [H, n, n] fp32
    coarse = None if gate is None else coarse_output(scores, v_pooled)  # [H, n, D] fp32
    k_mean = head_mean_from_pooled(k_pooled, plan) if qk_int8 else None

    if backend == "triton":
        from h3render.kernels.vsa.triton_impl import fine_attention_triton

        return fine_attention_triton(q, k, v, plan, select_tiles(scores, plan, sparsity), gate, coarse,
                                     qk_int8=qk_int8, k_mean=k_mean, v_tiles=v_tiles)
    if qk_int8:
        mask = block_mask(scores, plan.num_prefix, sparsity)
        out = fine_attention_int8_naive(q, k, v, mask, plan, k_mean)
    elif backend == "flex":
        from h3render.kernels.vsa.flex import fine_attention_flex

        out = fine_attention_flex(q, k, v, plan, select_tiles(scores, plan, sparsity))
    else:
        out = fine_attention_naive(q, k, v, block_mask(scores, plan.num_prefix, sparsity), plan)
    return out if gate is None else add_gated_coarse(out, coarse, gate, plan)
