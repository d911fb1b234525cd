"""The VSA top-k tile selection as one Triton kernel: `select_tiles`'s torch path (`topk` over the video key tiles, then
a sort of the kept ids) in one launch.

At the released geometry (56 heads x 1,188 video query tiles, k = 119 of 1,188) the torch path is six kernels (the
radix top-k's digit counts, cumulative sums and gather, then `radixSortKVInPlace` of the ids): 3.7 ms of each VSA
layer on an H200 (docs/performance.md §21.2). Here one program per (head, video query tile) row:

1. maps each score to an int32 key whose signed order is the float order (negative values' magnitude bits flipped),
   so that NaN ranks above +inf as in `torch.topk`;
2. finds a threshold t with #(key >= t) >= k > #(key > t): the k-th largest key, or any t that cuts exactly k;
3. keeps every key above it and, of the keys equal to it, the lowest tile ids (the torch top-k leaves ties to its
   implementation: on distinct scores both keep the same set);
4. writes the kept ids in ascending order (a cumulative sum of the keep mask gives each id its slot).

Step 2 is a count per candidate t, a reduction over the row, so the number of candidates is the cost.
`_select_kernel` (SEARCH = "radix") builds t bit by bit from the sign down: 32 counts whatever the row. The default
`_select_search_kernel` (SEARCH = "interpolate") brackets t between the row's smallest and largest key and guesses
by regula falsi on the counts in float value space (the Illinois variant, so a far outlier cannot stall one side);
when a guess lands on a count already known (ties at the cut) it snaps to the largest key below the bracket's top,
and when only one key is missing above the top that key is the threshold. On Gaussian rows of 1,188 with k = 119
this is ~11 reductions all told (min, max, counts, the final sums) against the radix's ~35; heavy tails or far
outliers ~23 (a numpy model of both). After `MAX_GUESSES` guesses it bisects in key space, so every row ends within
MAX_GUESSES + 32 counts. Measured on an H200 (2026-12-03, docs/performance.md §27.1), same kept sets: 1.54 -> 0.87 ms
a layer at 1344x768x243 (k = 119 of 1,188), 0.18 -> 0.15 ms at 960x544x124 (k = 40), autotuned both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting, next_power_of_2


@triton.jit
def _row_keys(scores_ptr, stride_h, stride_q, num_prefix, num_video, BLOCK: tl.constexpr):
    """This program's row (h * V + video query tile) of video scores as int32 keys: (row, offs [BLOCK], valid
    [BLOCK], key [BLOCK]). Float order as signed int32 order: a negative float's magnitude bits flipped (NaN above
    +inf, as torch.topk); pad lanes at INT_MIN, below every score but a negative NaN."""
    row = tl.program_id(0)
    h = row // num_video
    vq = row % num_video
    offs = tl.arange(0, BLOCK)
    valid = offs < num_video
    x = tl.load(scores_ptr + h.to(tl.int64) * stride_h + (num_prefix + vq).to(tl.int64) * stride_q + num_prefix + offs,
                mask=valid, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return row, offs, valid, tl.where(valid, key, -2147483648)


@triton.jit
def _store_kept(out_ptr, row, offs, valid, key, threshold, k, num_prefix):
    """Write the row's kept ids, ascending: every key above `threshold` and, of the keys equal to it, the lowest ids
    up to k in all (all of them when the cut is exact)."""
    above = key > threshold
    tied = (key == threshold) & valid
    need = k - tl.sum(above.to(tl.int32), axis=0)  # >= 0
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row.to(tl.int64) * k + slot, (offs + num_prefix).to(tl.int32), mask=keep)


@triton.jit
def _select_kernel(
    scores_ptr,  # [H, n, n] fp32 tile scores (any strides over H and query tiles, unit stride over key tiles)
    out_ptr,  # [H, V, k] int32 kept absolute key tile ids, ascending
    stride_h, stride_q,
    num_prefix, num_video, k,
    BLOCK: tl.constexpr,  # power of two >= num_video
):
    row, offs, valid, key = _row_keys(scores_ptr, stride_h, stride_q, num_prefix, num_video, BLOCK)
    # The largest t with #(key >= t) >= k (the k-th largest key), built from the sign down: t >= 0 exactly when k
    # keys are >= 0; below it, adding bit b to t only ever moves it up (two's complement), so one comparison per bit.
    nonneg = tl.sum((key >= 0).to(tl.int32), axis=0)
    threshold = tl.where(nonneg >= k, 0, -2147483648)
    for b in tl.static_range(30, -1, -1):
        candidate = threshold + (1 << b)
        count = tl.sum((key >= candidate).to(tl.int32), axis=0)
        threshold = tl.where(count >= k, candidate, threshold)
    _store_kept(out_ptr, row, offs, valid, key, threshold, k, num_prefix)


@triton.jit
def _value_of(key):
    """The fp32 value of an int32 key (the key mapping is its own inverse)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _select_search_kernel(
    scores_ptr, out_ptr,  # as `_select_kernel`
    stride_h, stride_q,
    num_prefix, num_video, k,
    BLOCK: tl.constexpr,  # power of two >= num_video
    MAX_GUESSES: tl.constexpr,  # interpolation steps before key-space bisection
):
    row, offs, valid, key = _row_keys(scores_ptr, stride_h, stride_q, num_prefix, num_video, BLOCK)
    # Bracket [lo, hi): #(key >= lo) = c_lo >= k > c_hi = #(key >= hi). Bounds in int64: hi may be INT_MAX + 1.
    # Every candidate lies in (lo, hi), above INT_MIN, so the pad lanes never count.
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64) + 1
    c_lo = num_video
    c_hi = tl.full((), 0, tl.int32)
    w_lo = tl.full((), 1.0, tl.float32)  # Illinois: a side kept twice in a row has its weight halved
    w_hi = tl.full((), 1.0, tl.float32)
    last = tl.full((), 0, tl.int32)  # +1: the last step moved lo; -1: it moved hi
    snap = tl.full((), 0, tl.int32)  # 1: the last guess counted what a bound already had (ties at the cut)
    steps = tl.full((), 0, tl.int32)
    while (hi - lo > 1) & (c_lo != k):
        top = (k - c_hi) == 1
        at_key = top | (snap != 0)
        if at_key:
            # The largest key below hi (>= lo, as the bracket holds a key): with one key missing above hi it is the
            # threshold; else counting it settles the cut there or drops one distinct value from the bracket.
            below = (key < tl.minimum(hi, 2147483647).to(tl.int32)) | (hi > 2147483647)
            mid = tl.max(tl.where(below, key, -2147483648), axis=0).to(tl.int64)
        elif steps < MAX_GUESSES:
            v_lo = _value_of(lo.to(tl.int32))
            v_hi = _value_of((hi - 1).to(tl.int32))
            f_lo = (c_lo - k + 0.5) * w_lo
            f_hi = (k - c_hi - 0.5) * w_hi
            guess = v_lo + (v_hi - v_lo) * (f_lo / (f_lo + f_hi))
            g = guess.to(tl.int32, bitcast=True)
            mid = (g ^ ((g >> 31) & 0x7FFFFFFF)).to(tl.int64)
            mid = tl.where(guess == guess, mid, lo + (hi - lo) // 2)  # NaN (from NaN or inf bounds): bisect
            mid = tl.minimum(tl.maximum(mid, lo + 1), hi - 1)
        else:
            mid = lo + (hi - lo) // 2
        if top:
            count = k  # #(key >= mid) = c_hi + #(key == mid) >= k
        else:
            count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        snap = ((~at_key) & ((count == c_lo) | (count == c_hi))).to(tl.int32)
        if count >= k:
            w_hi = tl.where(last == 1, w_hi * 0.5, 1.0)
            w_lo = 1.0
            last = 1
            lo = mid
            c_lo = count
            hi = tl.where(at_key, mid + 1, hi)  # no key lies in (mid, hi): mid is the k-th largest
        else:
            w_lo = tl.where(last == -1, w_lo * 0.5, 1.0)
            w_hi = 1.0
            last = -1
            hi = mid
            c_hi = count
        steps += 1
    _store_kept(out_ptr, row, offs, valid, key, lo.to(tl.int32), k, num_prefix)


# One program per row does its reductions over the row (32 counts for the radix search, ~11 reductions for the
# interpolation on Gaussian rows): with few warps each is a register + shuffle reduction with no cross-warp barrier.
# The autotuner picks per shape (the first call of each: the FastH3 warm-up forward).
SELECT_WARPS = (1, 2, 4, 8)
_select_tuned = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in SELECT_WARPS],
                                key=["num_video", "k", "BLOCK"], cache_results=True)(_select_kernel)
_search_tuned = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in SELECT_WARPS],
                                key=["num_video", "k", "BLOCK"], cache_results=True)(_select_search_kernel)
# The default search (module docstring); "radix" stays for the benchmark's before/after rows.
SEARCH = "interpolate"
MAX_GUESSES = 16


def select_tiles_triton(scores: torch.Tensor, num_prefix: int, k: int, *, num_warps: int | None = None,
                        search: str | None = None) -> torch.Tensor:
    """Kept video key tiles of every video query tile: the top `k` of each row's video columns, ascending ids.

    Args:
        scores: `[H, n, n]` fp32 tile scores (`naive.tile_scores`), unit stride over the last dim.
        num_prefix: P prefix tiles (the first P rows and columns, not selected here).
        k: kept video tiles per query tile, 1 <= k <= V = n - P.
        num_warps: warps per row's program; None = on CUDA the autotuner's pick among `SELECT_WARPS` for this shape.
        search: "interpolate" (`_select_search_kernel`) or "radix" (`_select_kernel`); None = `SEARCH`.
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
    search = SEARCH if search is None else search
    if search not in ("interpolate", "radix"):
        raise ValueError(f"h3render/kernels/vsa/select_triton.py: search must be 'interpolate' or 'radix', "
                         f"got {search!r}")
    tuned = num_warps is None and scores.is_cuda and not interpreting()
    if search == "radix":
        kernel, extra = (_select_tuned if tuned else _select_kernel), {}
    else:
        kernel, extra = (_search_tuned if tuned else _select_search_kernel), {"MAX_GUESSES": MAX_GUESSES}
    launch = {} if tuned else {"num_warps": num_warps or 4}
    kernel[(heads * num_video,)](
        scores, out, scores.stride(0), scores.stride(1), num_prefix, num_video, k, BLOCK=block, **extra, **launch)
    return out
