"""The one-launch Triton tile selection (h3render/kernels/vsa/select_triton.py) against `select_tiles`' torch path
(`topk` + sort), under TRITON_INTERPRET=1 on CPU or compiled on a GPU (TRITON_INTERPRET=0)."""

from __future__ import annotations

import os

import pytest
import torch

from h3render.kernels.vsa import select_tiles, tile_plan, topk_budget
from h3render.kernels.vsa import select_triton
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
    with pytest.raises(ValueError, match="search"):
        select_tiles_triton(scores, num_prefix=2, k=1, search="sort")


def _stable_topk_ids(scores: torch.Tensor, num_prefix: int, k: int) -> torch.Tensor:
    """[H, V, k] ascending ids of each row's k largest video scores, ties to the lowest ids: a stable sort of the
    scores' int keys (float order, -0.0 below +0.0, NaN above +inf), integer work that the process's denormal
    setting cannot touch (`torch.set_flush_denormal(True)`, which the CPU runner sets, makes float compares treat
    subnormals as zero)."""
    bits = scores[:, num_prefix:, num_prefix:].cpu().contiguous().view(torch.int32).long()
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    order = keys.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return (order.sort(dim=-1).values + num_prefix).to(torch.int32)


def _rows(kind: str, rows: int, v: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, v, generator=g)
    if kind == "cauchy":  # heavy tails: the bracket's ends sit far from the cut
        return torch.tan(torch.pi * (torch.rand(rows, v, generator=g) - 0.5))
    if kind == "outliers":  # a few scores 1e4 times the bulk, on both sides
        x[:, ::9] *= 1e4
        return x
    if kind == "ties":  # few distinct values: the cut falls inside a run of equal scores
        return (x * 2).round()
    if kind == "equal":
        return torch.full((rows, v), -0.75)
    if kind == "tiny":  # subnormal scores of both signs, made from their bits (no float arithmetic to flush them)
        bits = torch.randint(1, 1 << 23, (rows, v), generator=g, dtype=torch.int32)
        return torch.where(x < 0, bits | -2147483648, bits).view(torch.float32)
    return x


@pytest.mark.parametrize("search", ["interpolate", "radix"])
@pytest.mark.parametrize("kind", ["normal", "cauchy", "outliers", "ties", "equal", "tiny"])
@pytest.mark.parametrize("k", [1, 5, 36, 37])
def test_both_searches_keep_the_k_largest_with_ties_to_the_lowest_ids(search, kind, k):
    """Each search against a stable descending sort on rows that stress it: heavy tails and far outliers (the
    interpolation's slow cases), runs of equal scores at the cut (its snap to a key), one value, subnormals; k from 1
    to V (37 video tiles, one prefix tile)."""
    g = torch.Generator().manual_seed(len(kind) * 100 + k)
    scores = torch.zeros(2, 38, 38)
    scores[:, 1:, 1:] = _rows(kind, 2 * 37, 37, g).view(2, 37, 37)
    out = select_tiles_triton(scores.to(DEVICE), num_prefix=1, k=k, search=search).cpu()
    assert torch.equal(out, _stable_topk_ids(scores, 1, k))


@pytest.mark.parametrize("guesses", [0, 1, 3])
def test_the_search_ends_exact_when_its_guesses_run_out(monkeypatch, guesses):
    """After MAX_GUESSES interpolation steps the search bisects in key space: exact whichever step it stops at."""
    monkeypatch.setattr(select_triton, "MAX_GUESSES", guesses)
    g = torch.Generator().manual_seed(guesses)
    scores = torch.zeros(1, 41, 41)
    scores[:, 1:, 1:] = torch.cat([_rows("cauchy", 20, 40, g), _rows("ties", 20, 40, g)]).view(1, 40, 40)
    out = select_tiles_triton(scores.to(DEVICE), num_prefix=1, k=7, search="interpolate").cpu()
    assert torch.equal(out, _stable_topk_ids(scores, 1, 7))
