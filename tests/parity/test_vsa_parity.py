"""VSA-H3 against FastVideo 0.2.1's own code: golden tensors made by scripts/vsa_golden.py (FastVideo's
`MiniMaxH3VSAImpl.forward` with its CPU oracle `reference_sparse_attention` as the fine stage, fp32, top-k without
near-ties). Regenerate with `python scripts/vsa_golden.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3render.kernels.vsa import tile_plan, vsa_attention, vsa_attention_naive

GOLDEN = torch.load(Path(__file__).parents[1] / "data" / "vsa_golden.pt")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_geometry_equals_fastvideo(name):
    case = GOLDEN[name]
    plan = tile_plan(case["prefix"], case["grid"])
    assert plan.num_prefix == case["num_prefix"]
    assert torch.equal(plan.sizes.long(), case["sizes"].long())
    assert torch.equal(plan.slot, case["slot"].long())  # FastVideo's untile_combined_index


@pytest.mark.parametrize("name", sorted(GOLDEN))
@pytest.mark.parametrize("with_gate", [True, False])
def test_reference_equals_fastvideo(name, with_gate):
    case = GOLDEN[name]
    plan = tile_plan(case["prefix"], case["grid"])
    gate = case["gate"] if with_gate else None
    want = case["out"] if with_gate else case["out_no_gate"]
    got = vsa_attention_naive(case["q"], case["k"], case["v"], gate, plan, case["sparsity"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_triton_equals_fastvideo():
    from tests.unit.test_vsa import FAST_DEVICE  # the GPU under TRITON_INTERPRET=0, else the interpreter on CPU

    case = GOLDEN["empty_cond"]  # head dim 16: the smallest the Triton dot takes
    plan = tile_plan(case["prefix"], case["grid"], FAST_DEVICE)
    q, k, v, gate = (case[x].to(FAST_DEVICE) for x in ("q", "k", "v", "gate"))
    got = vsa_attention(q, k, v, gate, plan, case["sparsity"], fine="triton")
    # fp32 on a GPU: tl.dot's IEEE path, still another summation order than FastVideo's CPU oracle
    torch.testing.assert_close(got.cpu(), case["out"], rtol=1e-5, atol=1e-5)


def test_golden_cases_are_sparse_and_gated():
    """The golden data exercises what it claims: the gate changes the output, sparsity changes video rows."""
    for name in ("ragged", "empty_cond"):
        case = GOLDEN[name]
        assert case["sparsity"] > 0
        assert (case["out"] - case["out_no_gate"]).abs().max() > 1e-2
