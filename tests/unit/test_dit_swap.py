"""DiT partition swaps (`h3render.dit_swap`): two DiTs trade places through the incoming one's host buffers, each
keeping its values, parameter objects and AdaLN projections; on CUDA the engine's mixed queue swaps with no second
DiT copy on either side and renders what an engine holding both resident renders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_partition_dit
from h3render import pinned
from h3render.dit_swap import exchange, move_dit

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pair():
    info = read_checkpoint_info("tiny")
    return load_partition_dit(info, "transformer"), load_partition_dit(info, "transformer_ref")


def _values(dit) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in dit.state_dict().items()}


def test_exchange_trades_storage_and_keeps_each_dits_values():
    base, ref = _pair()
    base.register_buffer("only_in_base", torch.arange(5.0))  # a tensor without a partner moves alone
    want_base, want_ref = _values(base), _values(ref)
    params = {n: p for n, p in base.named_parameters()}
    where = {n: p.data_ptr() for n, p in ref.named_parameters() if "adaln_proj" not in n}
    adaln = {n: p.data_ptr() for n, p in base.named_parameters() if "adaln_proj" in n}
    assert where and adaln

    moved = exchange(base, ref)

    # the unpaired buffer was in host memory already: it stays
    assert moved == sum(t.numel() * t.element_size() for n, t in want_base.items()
                        if "adaln_proj" not in n and n != "only_in_base")
    for dit, want in ((base, want_base), (ref, want_ref)):
        got = _values(dit)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # base now lives in the buffers ref left (no new host memory), its parameter objects the same ones
    assert {n: p.data_ptr() for n, p in base.named_parameters() if n in where} == where
    assert all(p is params[n] for n, p in base.named_parameters())
    assert {n: p.data_ptr() for n, p in base.named_parameters() if "adaln_proj" in n} == adaln  # never moved
    assert not base.blocks[0].attn.qkv_proj.weight.data_ptr() == ref.blocks[0].attn.qkv_proj.weight.data_ptr()


def test_move_dit_leaves_the_adaln_projections_and_counts_its_bytes():
    """A swap must not copy the AdaLN projections, which `DiT.offload_adaln_` put in host memory (≈26 GB at release):
    meta stands in for the device."""
    base, _ = _pair()
    moved = move_dit(base, "meta")
    assert moved == sum(p.numel() * p.element_size() for n, p in base.named_parameters() if "adaln_proj" not in n)
    assert all(p.device.type == "cpu" for n, p in base.named_parameters() if "adaln_proj" in n)
    assert all(p.device.type == "meta" for n, p in base.named_parameters() if "adaln_proj" not in n)
    assert move_dit(base, "meta") == 0  # nothing left to move


def test_the_arena_carves_tensors_first_fit_out_of_slabs(monkeypatch):
    """torch rounds each pinned allocation up to a power of two; the arena's slabs are one, and hold the tensors
    back to back (aligned), first fit, with its own allocation only for a tensor larger than a slab."""
    monkeypatch.setattr(pinned, "SLAB_BYTES", 4096)
    arena = pinned.PinnedArena(pin=False)  # pageable slabs: the carving is the same
    sources = [torch.randn(250), torch.randn(3, 256).bfloat16(), torch.randn(500),
               torch.randn(7).to(torch.float8_e4m3fn), torch.randn(1100)]
    got = [arena.copy(t) for t in sources]
    for t, h in zip(sources, got):
        assert h.dtype == t.dtype and h.shape == t.shape and h.is_contiguous()
        assert torch.equal(h.float(), t.float())
    slab0, slab1 = (s.data_ptr() for s in arena.slabs)
    # 1000 B -> [0, 1024); 1536 B -> [1024, 2560); 2000 B fits nowhere else -> slab 1; 7 B -> slab 0 at 2560
    assert [h.data_ptr() for h in got[:4]] == [slab0, slab0 + 1024, slab1, slab0 + 2560]
    assert got[4].untyped_storage().nbytes() == 4400  # larger than a slab: its own allocation
    assert arena.used == [3072, 2048] and arena.held_bytes == 2 * 4096


@CUDA
def test_exchange_on_cuda_moves_each_dit_across_without_a_second_copy():
    base, ref = _pair()
    base.to("cuda")
    ref.to("cuda")
    move_dit(ref, "cpu", pin=True)  # as `Engine.hold_partition` parks a partition: from the device, pinned
    want_base, want_ref = _values(base), _values(ref)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    largest = max(p.numel() * p.element_size() for p in base.parameters())
    torch.cuda.reset_peak_memory_stats()

    exchange(base, ref)

    assert all(p.device.type == "cpu" and p.is_pinned() for n, p in base.named_parameters() if "adaln_proj" not in n)
    assert all(p.device.type == "cuda" for n, p in ref.named_parameters() if "adaln_proj" not in n)
    assert torch.cuda.memory_allocated() == before  # ref's tensors in base's place, byte for byte
    assert torch.cuda.max_memory_allocated() <= before + largest  # one tensor in flight at a time
    for dit, want in ((base, want_base), (ref, want_ref)):
        got = _values(dit)
        assert all(torch.equal(got[k], want[k]) for k in want)


@CUDA
def test_a_mixed_queue_that_swaps_renders_what_a_resident_engine_renders(tmp_path, monkeypatch):
    """t2va, ref2va, t2va on one CUDA engine that believes its device full (every partition change swaps), against
    an engine keeping both DiTs resident: equal latents, two swaps recorded, the base DiT back on the device."""
    from h3render.engine import Engine
    from h3render.job_references import read_reference
    from h3render.jobs import Job
    from h3render.parallel.groups import ParallelContext
    from h3render.settings import RunSettings
    from tests._media import png

    png(tmp_path / "r.png", (64, 40), seed=0)
    plain = Job(id="a", prompt="A red fox", width=128, height=64, frames=22, seed=5, steps=2, mode="t2va", output="a")
    ref = Job(id="b", prompt="A red fox", width=128, height=64, frames=22, seed=5, steps=2, mode="t2va", output="b",
              references=(read_reference("r.png", tmp_path),))
    ctx = ParallelContext(0, 1, 0, torch.device("cuda"))
    # One attention backend for both engines, named: the latents are compared bit for bit, and until 2026-12-03 the
    # automatic choice was timed and once differed between the two under a loaded GPU (with fa3-fwd installed).
    settings = RunSettings(progress=False, save_latents=True, device="cuda", dtype="bf16", compile_vae=False,
                           graph_audio=False, attention="sdpa")

    def render(engine, folder: Path) -> dict:
        folder.mkdir()
        got = {}
        for name, job in (("first", plain), ("ref", ref), ("again", plain)):
            engine.render(job, folder / f"{name}.mp4", folder / f"{name}.json")
            got[name] = torch.load(folder / f"{name}.latents.pt")["video"]
        return got

    want = render(Engine.load(settings, ctx), tmp_path / "resident")
    free, total = torch.cuda.mem_get_info()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, total))
    engine = Engine.load(settings, ctx)
    got = render(engine, tmp_path / "swapped")
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert [s["to"] for s in engine.warmup["partition_swaps"]] == ["transformer"]  # ref2va loaded, then swapped back
    assert engine.warmup["dit_partitions"] == {"transformer": "resident", "transformer_ref": "host"}
    assert all(p.device.type == "cpu" and p.is_pinned() for n, p in engine.dits["transformer_ref"].named_parameters()
               if "adaln_proj" not in n)
    engine.dit_of("transformer_ref")  # and once more the other way: now through `exchange`
    assert engine.warmup["dit_partitions"] == {"transformer": "host", "transformer_ref": "resident"}
    assert all(p.device.type == "cuda" for n, p in engine.dits["transformer_ref"].named_parameters()
               if "adaln_proj" not in n)
