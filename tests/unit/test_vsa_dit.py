"""The DiT with video sparse attention (`DiT.enable_vsa`): gate parameters only when enabled, sparsity 0 with zero
gates equals the dense model, the gate reads the attention's input, and Ulysses on 2 gloo ranks equals 1 rank."""

from __future__ import annotations

import pytest
import torch

from h3render.models.attention import SparseAttention
from h3render.models.dit import DiT
from h3render.models.dit_config import DIT_TINY
from h3render.packing import t2va_layout
from h3render.sampling import schedule_timesteps, sigma_schedule
from tests._diffusers_ref import random_dit
from tests._markers import interpreted
from tests._numerics import rel_err
from tests._spawn import cpu_rank, put_result, run_ranks

WORLD = 2


def _inputs():
    # grid (7, 4, 5): 4 video tiles of 4x4x4 (two ragged in w), prefix text 6 + audio 74 -> 3 tiles.
    layout = t2va_layout(text_len=6, height=128, width=160, frames=22)
    g = torch.Generator().manual_seed(3)
    video = torch.randn(layout.num_video_rows, DIT_TINY.video_patch_dim, generator=g)
    audio = torch.randn(layout.num_audio_rows, DIT_TINY.audio_in_channels, generator=g)
    text = torch.randn(layout.text_len, DIT_TINY.text_dim, generator=g)
    return layout, video, audio, text


def _tables(dit, layout):
    vs, as_ = sigma_schedule(5, 12.0), sigma_schedule(5, 3.0)
    tables = dit.modulation_tables(schedule_timesteps(vs, as_))
    return tables, layout.row_timestep_index(tables.index_of(1.0 - vs[1]), tables.index_of(1.0 - as_[1]))


def _vsa_dit(sparsity: float, gate_seed: int | None) -> DiT:
    dit = random_dit(DIT_TINY, seed=1)
    dit.enable_vsa(sparsity)
    if gate_seed is not None:
        g = torch.Generator().manual_seed(gate_seed)
        with torch.no_grad():
            for block in dit.blocks:
                w = block.attn.gate_proj.weight
                w.copy_(torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5)
    return dit


def _forward(dit, *, window_ctx=None):
    layout, video, audio, text = _inputs()
    tables, index = _tables(dit, layout)
    with torch.no_grad():
        if window_ctx is None:
            return dit(video, audio, text, layout, tables, index)
        from h3render.models.attention import sdpa_attention
        from h3render.parallel.dit import sharded_forward

        return sharded_forward(dit, window_ctx, video, audio, text, layout, tables, index,
                               dit.rope_tables(layout.positions), base_attention=sdpa_attention)


def test_gate_parameters_exist_only_with_vsa():
    dense = DiT(DIT_TINY)
    assert not any("gate_proj" in k for k in dense.state_dict())
    dense_keys = set(dense.state_dict())
    dense.enable_vsa(0.9)
    keys = set(dense.state_dict())
    added = keys - dense_keys
    assert added == {f"blocks.{i}.attn.gate_proj.weight" for i in range(DIT_TINY.num_layers)}
    heads, hd = DIT_TINY.num_attention_heads, DIT_TINY.attention_head_dim
    assert dense.state_dict()["blocks.0.attn.gate_proj.weight"].shape == (heads * hd, DIT_TINY.hidden_size)
    assert all(b.attn.gate_proj is None for b in dense.token_refiner.blocks)
    with pytest.raises(ValueError, match="sparsity"):
        dense.enable_vsa(1.0)
    with pytest.raises(ValueError, match="tile"):
        dense.enable_vsa(0.9, tile=256)


def test_sparsity_zero_zero_gates_equals_dense_model():
    dense_v, dense_a = _forward(random_dit(DIT_TINY, seed=1))
    v, a = _forward(_vsa_dit(0.0, gate_seed=None))
    assert rel_err(v, dense_v) <= 1e-5 and rel_err(a, dense_a) <= 1e-5


def test_sparse_and_gated_outputs_differ_from_dense():
    dense_v, _ = _forward(random_dit(DIT_TINY, seed=1))
    sparse_v, _ = _forward(_vsa_dit(0.75, gate_seed=None))
    gated_v, _ = _forward(_vsa_dit(0.75, gate_seed=2))
    assert rel_err(sparse_v, dense_v) > 1e-3  # 1 of 4 video tiles kept per query tile
    assert rel_err(gated_v, sparse_v) > 1e-3  # the coarse branch is added


def test_int8_qk_runs_in_every_vsa_block_close_to_bf16():
    """`DiT.vsa_qk_int8` (the Engine sets it with --precision fp8) reaches each block's VSA call: the output moves
    by the int8 rounding of q and k, and no further."""
    plain_v, _ = _forward(_vsa_dit(0.75, gate_seed=2))
    dit = _vsa_dit(0.75, gate_seed=2)
    dit.vsa_qk_int8 = True
    int8_v, _ = _forward(dit)
    assert 1e-5 < rel_err(int8_v, plain_v) < 2e-2


def test_gate_reads_the_modulated_attention_input():
    dit = _vsa_dit(0.75, gate_seed=2)
    seen = {}
    attn = dit.blocks[1].attn
    attn.qkv_proj.register_forward_hook(lambda m, i, o: seen.update(qkv=i[0]))
    attn.gate_proj.register_forward_hook(lambda m, i, o: seen.update(gate=i[0]))
    _forward(dit)
    assert seen["gate"] is seen["qkv"]


def test_plan_is_cached_per_layout_shape():
    layout = _inputs()[0]
    a = SparseAttention.for_layout(layout, 0.9, "cpu")
    b = SparseAttention.for_layout(t2va_layout(text_len=6, height=128, width=160, frames=22), 0.9, "cpu")
    assert a.plan is b.plan
    assert (a.plan.num_prefix, a.plan.num_video) == (3, 4)


def _worker(rank: int, port: int, queue) -> None:
    with cpu_rank(rank, port, WORLD) as ctx:
        v, a = _forward(_vsa_dit(0.75, gate_seed=2), window_ctx=ctx)
        if rank == 0:
            put_result(queue, (v.clone(), a.clone()))


def test_ulysses_two_ranks_equal_one():
    """Heads split over 2 ranks; each sees the whole sequence, so tiles, top-k and the gate's rows are whole."""
    [(v, a)] = run_ranks(_worker, WORLD, results=1)
    ref_v, ref_a = _forward(_vsa_dit(0.75, gate_seed=2))
    assert rel_err(v, ref_v) <= 1e-5 and rel_err(a, ref_a) <= 1e-5


@interpreted  # the Triton fine stage forced on CPU tensors: the interpreter only (a GPU run has no CPU Triton)
@pytest.mark.parametrize("triton_norm", [False, True])
def test_v_written_in_tile_order_equals_the_gathered_path(monkeypatch, triton_norm):
    """`Attention.vsa_v_tiles` (qk_norm_rope writes v straight into the fine kernel's tile buffer) against the old
    path (contiguous v, gathered into tile order by the kernel): the same output bit for bit, since both hand the
    kernels the same v values in the same slots, the pad slots (zero here, a copy of row 0 there) only ever meet
    p = 0 (their product is +-0 in the same place of the same sum), and the coarse pooling sums the same values in
    the same order. The Triton fine stage is forced on CPU (interpreter), with the reference qk_norm_rope (what a CPU
    run takes) and the Triton one. The tile means come from the pools on both sides (`Attention.vsa_fused_prep`
    off): `vsa_prep`'s sum in another fp32 order (tests/unit/test_vsa_prep.py)."""
    import functools

    from h3render import kernels
    from h3render.kernels.vsa import triton_impl
    from h3render.models import dit as dit_module

    monkeypatch.setattr(dit_module.Attention, "vsa_fused_prep", False)
    for_layout = SparseAttention.for_layout.__func__
    monkeypatch.setattr(SparseAttention, "for_layout",
                        classmethod(lambda cls, *a, **kw: for_layout(cls, *a, **{**kw, "fine": "triton"})))
    if triton_norm:
        monkeypatch.setattr(dit_module, "qk_norm_rope", functools.partial(kernels.qk_norm_rope, use_triton=True))
    gathers = []
    gather = triton_impl.gather_tiles
    monkeypatch.setattr(triton_impl, "gather_tiles", lambda x, plan: gathers.append(x.shape) or gather(x, plan))

    dit = _vsa_dit(0.75, gate_seed=2)  # the gate: v's tile means enter through the coarse branch
    tiled = _forward(dit)
    assert len(gathers) == DIT_TINY.num_layers  # k only: v never gathered
    monkeypatch.setattr(dit_module.Attention, "vsa_v_tiles", False)
    gathered = _forward(dit)
    assert len(gathers) == 3 * DIT_TINY.num_layers  # k and v
    assert torch.equal(tiled[0], gathered[0]) and torch.equal(tiled[1], gathered[1])
    assert rel_err(gathered[0], _forward(random_dit(DIT_TINY, seed=1))[0]) > 1e-3  # VSA and its gate did run
