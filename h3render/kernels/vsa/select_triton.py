"""The VSA top-k tile selection as one Triton kernel: `select_tiles`'s torch path (`topk` over the video key tiles, then
a sort of the kept ids) in one launch.

At the released geometry (56 heads x 1,188 video query tiles, k = 119 of 1,188) the torch path is six kernels (the
radix top-k's digit counts, cumulative sums and gather, then `radixSortKVInPlace` of the ids): 4.0 ms of each VSA
layer's device time on an H200 (2026-12-02, `scripts/bench.py --stages prof --prof-dit fp8-vsa`,
docs/performance.md §21.1), 0.2 s of a 50-block forward; timed alone 3.70 ms, this kernel 1.55 ms with the same
kept sets (§21.2). Here one program per (head, video query tile) row:

1. maps each score to an int32 key whose signed order is the float order (negative values' magnitude bits flipped),
   so that NaN ranks above +inf as in `torch.topk`;
2. finds the k-th largest key exactly by a 32-step bitwise radix select (each step counts the keys at or above a
   candidate threshold: the sign first, then bits 30..0);
3. keeps every key above it and, of the keys equal to it, the lowest tile ids (the torch top-k leaves ties to its
   implementation: on distinct scores both keep the same set);
4. writes the kept ids in ascending order (a cumulative sum of the keep mask gives each id its slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting, next_power_of_2


@triton.jit
def _select_kernel(
    scores_ptr,  # [H, n, n] fp32 tile scores (any strides over H and query tiles, unit stride over key tiles)
    out_ptr,  # [H, V, k] int32 kept absolute key tile ids, ascending
    stride_h, stride_q,
    num_prefix, num_video, k,
    BLOCK: tl.constexpr,  # power of two >= num_video
):
    row = tl.program_id(0)  # h * V + video query tile
    h = row // num_video
    vq = row % num_video
    offs = tl.arange(0, BLOCK)
    valid = offs < num_video
    x = tl.load(scores_ptr + h.to(tl.int64) * stride_h + (num_prefix + vq).to(tl.int64) * stride_q + num_prefix + offs,
                mask=valid, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    # Float order as signed int32 order: a negative float's magnitude bits flipped (NaN above +inf, as torch.topk).
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(valid, key, -2147483648)  # pad lanes at INT_MIN: below every score but a negative NaN
    # The largest t with #(key >= t) >= k (the k-th largest key), built from the sign down: t >= 0 exactly when k
    # keys are >= 0; below it, adding bit b to t only ever moves it up (two's complement), so one comparison per bit.
    nonneg = tl.sum((key >= 0).to(tl.int32), axis=0)
    threshold = tl.where(nonneg >= k, 0, -2147483648)
    for b in tl.static_range(30, -1, -1):
        candidate = threshold + (1 << b)
        count = tl.sum((key >= candidate).to(tl.int32), axis=0)
        threshold = tl.where(count >= k, candidate, threshold)
    above = key > threshold
    tied = (key == threshold) & valid
    need = k - tl.sum(above.to(tl.int32), axis=0)  # >= 1: the threshold key itself is among the top k
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row.to(tl.int64) * k + slot, (offs + num_prefix).to(tl.int32), mask=keep)


# One program per row does 32 reductions over its row: with few warps each is a register + shuffle reduction with no
# cross-warp barrier. The autotuner picks per shape (the first call of each: the FastH3 warm-up forward).
SELECT_WARPS = (1, 2, 4, 8)
_select_tuned = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in SELECT_WARPS],
                                key=["num_video", "k", "BLOCK"], cache_results=True)(_select_kernel)


def select_tiles_triton(scores: torch.Tensor, num_prefix: int, k: int, *, num_warps: int | None = None) -> torch.Tensor:
    """Kept video key tiles of every video query tile: the top `k` of each row's video columns, ascending ids.

    Args:
        scores: `[H, n, n]` fp32 tile scores (`naive.tile_scores`), unit stride over the last dim.
        num_prefix: P prefix tiles (the first P rows and columns, not selected here).
        k: kept video tiles per query tile, 1 <= k <= V = n - P.
        num_warps: warps per row's program; None = on CUDA the autotuner's pick among `SELECT_WARPS` for this shape.
    Returns:
        `[H, V, k]` int32 absolute tile ids (P..n-1), ascending in each row: the set `torch.topk` keeps when the
        row's scores are distinct (ties at the k-th score keep the lowest ids).
    """
    heads, n, _ = scores.shape
    num_video = n - num_prefix
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"h3render/kernels/vsa/select_triton.py: scores must be fp32 with unit stride over key "
                         f"tiles, got {scores.dtype} strides {scores.stride()}")
    if not 1 <= k <= num_video:
        raise ValueError(f"h3render/kernels/vsa/select_triton.py: k = {k} outside 1..{num_video} (video tiles)")
    out = torch.empty(heads, num_video, k, dtype=torch.int32, device=scores.device)
    block = next_power_of_2(num_video)
    if num_warps is None and scores.is_cuda and not interpreting():
        kernel, launch = _select_tuned, {}
    else:
        kernel, launch = _select_kernel, {"num_warps": num_warps or 4}
    kernel[(heads * num_video,)](
        scores, out, scores.stride(0), scores.stride(1), num_prefix, num_video, k, BLOCK=block, **launch)
    return out
