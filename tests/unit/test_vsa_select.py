"""The one-launch Triton tile selection (h3render/kernels/vsa/select_triton.py) against `select_tiles`' torch path
(`topk` + sort), under TRITON_INTERPRET=1 on CPU or compiled on a GPU (TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

import pytest
import torch

from h3render.kernels.vsa import select_tiles, tile_plan, topk_budget
from h3render.kernels.vsa.select_triton import select_tiles_triton

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _scores(heads: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, n, generator=g).to(DEVICE)


# (prefix, grid, heads, sparsity): 36, 60 and 20 video tiles (ragged grids), k = 1, k = V - 1, the released s = 0.9.
# Sizes kept small: each program is one interpreted row on the CI's CPU (2-5 s a case).
CASES = [((70, 5, 130), (9, 10, 13), 2, 0.9), ((70, 5, 130), (9, 10, 13), 2, 0.04),
         ((1,), (9, 10, 13), 1, 0.99), ((300, 810), (13, 9, 19), 1, 0.9), ((65, 3), (8, 8, 20), 3, 0.5)]


@pytest.mark.parametrize("prefix, grid, heads, sparsity", CASES)
def test_triton_select_keeps_the_torch_topk_set_in_ascending_order(prefix, grid, heads, sparsity):
    plan = tile_plan(prefix, grid, DEVICE)
    scores = _scores(heads, plan.num_tiles, seed=len(CASES) + heads)
    scores[0, plan.num_prefix:, plan.num_prefix + 3] = float("-inf")  # never kept unless k forces it
    scores[-1, -1, plan.num_prefix] = -1e-30  # a negative subnormal: the bit-order mapping's edge
    ours = select_tiles(scores, plan, sparsity, use_triton=True)
    ref = select_tiles(scores, plan, sparsity, use_triton=False)
    k = topk_budget(sparsity, plan.num_video)
    assert ours.shape == ref.shape == (heads, plan.num_video, k) and ours.dtype == torch.int32
    assert torch.equal(ours.cpu(), ref.cpu())  # distinct scores: the same set, both ascending


def test_ties_keep_the_lowest_ids_and_exactly_k():
    """Eight equal scores at the cut, two above it: k = 5 keeps the two and the three lowest tied ids."""
    scores = torch.full((1, 12, 12), -3.0)
    scores[0, 2:, [4, 6, 7, 8, 9, 10, 11, 5]] = 1.5  # tied (columns 4..11)
    scores[0, 2:, 3] = 2.0
    scores[0, 2:, 2] = 7.0
    out = select_tiles_triton(scores.to(DEVICE), num_prefix=2, k=5).cpu()
    assert out.tolist() == [[[2, 3, 4, 5, 6]] * 10]


def test_nan_ranks_first_and_infinities_order_as_floats():
    """torch.topk ranks NaN above +inf; the key mapping must keep that and float order at the extremes."""
    row = torch.tensor([0.5, float("nan"), -float("inf"), float("inf"), -0.0, 3.0e38, -3.0e38, 1e-45])
    scores = torch.zeros(1, 8, 8)
    scores[0, :, :] = row
    out = select_tiles_triton(scores.to(DEVICE), num_prefix=0, k=4).cpu()
    assert out[0, 0].tolist() == [0, 1, 3, 5]  # NaN, +inf, 3e38, 0.5


def test_bad_arguments_are_refused():
    scores = torch.zeros(1, 6, 6)
    with pytest.raises(ValueError, match="outside 1..4"):
        select_tiles_triton(scores, num_prefix=2, k=5)
    with pytest.raises(ValueError, match="fp32"):
        select_tiles_triton(scores.double(), num_prefix=2, k=1)
