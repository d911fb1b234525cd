"""The on-disk AdaLN table cache (`h3render.adaln_cache`, issue 26): a hit returns the built tables bit for bit
without running a projection; a corrupt or foreign file is rejected and rebuilt; the key follows the weights, the
timesteps, the adapter and the checkpoint files; the engine reads it back across engines (a second run)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from h3render import adaln_cache
from h3render.models.dit import DiT
from h3render.models.dit_config import DIT_TINY

TS = torch.tensor([0.25, 0.5, 0.999], dtype=torch.float32)
IDENT = {"path": "tiny", "layout": "builtin", "config": "c0", "adapter": None}


@pytest.fixture()
def dit():
    torch.manual_seed(0)
    model = DiT(DIT_TINY).eval()
    for p in model.parameters():  # non-zero biases: a table slot that is all zeros would hide a swapped slot
        torch.nn.init.normal_(p, std=0.05)
    return model


def _same(a, b) -> bool:
    return (torch.equal(a.timesteps, b.timesteps) and torch.equal(a.final, b.final)
            and len(a.blocks) == len(b.blocks) and all(torch.equal(x, y) for x, y in zip(a.blocks, b.blocks)))


def test_hit_is_the_built_tables_without_running_a_projection(dit, tmp_path, monkeypatch):
    built, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    assert rec["cache"] == "built" and _same(built, dit.modulation_tables(TS))
    files = list(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".safetensors"]  # no temp file left beside it
    with safe_open(str(files[0]), "pt") as f:
        assert json.loads(f.metadata()["h3render_adaln_key"])["timesteps"] == TS.tolist()

    def boom(*a, **k):
        raise AssertionError("a hit must not run the projections")

    monkeypatch.setattr(dit, "modulation_tables", boom)
    hit, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    assert rec["cache"] == "hit" and _same(hit, built)
    # Another key misses: other timesteps, another adapter, another weight file.
    for ts, ident in ((TS[:2], IDENT), (TS, dict(IDENT, adapter="ab12")), (TS, dict(IDENT, transformer=[["a", 1, 2]]))):
        with pytest.raises(AssertionError, match="must not run"):
            adaln_cache.cached_tables(dit, ts, "cpu", ident, root=tmp_path)


def test_changed_weights_or_a_corrupt_file_are_recomputed_never_trusted(dit, tmp_path, capsys):
    first, _ = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    (path,) = tmp_path.iterdir()
    # A fused student (same files, same key otherwise): the weight fingerprint tells it apart.
    weight = dit.blocks[1].adaln_proj.linear.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(0.01)
    changed, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    assert rec["cache"] == "built" and not torch.equal(changed.blocks[1], first.blocks[1])
    assert len(list(tmp_path.iterdir())) == 2
    # Flip one byte of the tensor data (the end of the file): the stored sha256 no longer matches.
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with torch.no_grad():
        weight.copy_(saved)
    again, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    assert rec["cache"] == "rejected" and "sha256" in rec["why"] and _same(again, first)
    assert "recomputing" in capsys.readouterr().err
    assert adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)[1]["cache"] == "hit"  # rewritten
    # A truncated file (a crash of a writer that did not rename) is unreadable: rebuilt as well.
    path.write_bytes(path.read_bytes()[:100])
    again, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path)
    assert rec["cache"] == "rejected" and "unreadable" in rec["why"] and _same(again, first)


def test_off_and_the_default_folder(dit, tmp_path, monkeypatch):
    monkeypatch.setenv(adaln_cache.ENV, "off")
    assert adaln_cache.cache_root() is None
    assert adaln_cache.cached_tables(dit, TS, "cpu", IDENT)[1] == {"cache": "off"}
    monkeypatch.delenv(adaln_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert adaln_cache.cache_root() == tmp_path / "h3render" / "adaln"
    # A folder that cannot be made (a file is in the way) costs the cache, not the run.
    (tmp_path / "file").write_text("x")
    tables, rec = adaln_cache.cached_tables(dit, TS, "cpu", IDENT, root=tmp_path / "file" / "adaln")
    assert rec["cache"] == "built" and "not written" in rec["why"] and _same(tables, dit.modulation_tables(TS))


def test_engine_reads_the_tables_back_in_a_second_run(dit, tmp_path, monkeypatch):
    """`Engine.tables` (its state set by hand: a loaded engine costs seconds): a second run's engine hits; the key
    names the checkpoint, and the adapter only once it is fused into the weights."""
    from types import SimpleNamespace

    from h3render.checkpoint.info import read_checkpoint_info
    from h3render.engine import Engine
    from h3render.sampling import Schedule

    monkeypatch.setenv(adaln_cache.ENV, str(tmp_path))
    schedule = Schedule.base(3, 5.0, 3.0)

    def engine(adapter=None, deferred=None):
        e = Engine.__new__(Engine)
        e.c = SimpleNamespace(dit=dit, info=read_checkpoint_info("tiny"))
        e.device, e.transformer, e.adapter, e._deferred_fusion = torch.device("cpu"), None, adapter, deferred
        e._tables, e.warmup = {}, {}
        e.dits, e._active = {"transformer": dit}, "transformer"  # the base partition, resident (`Engine.dit_of`)
        e.loras = SimpleNamespace(tables_key=())  # no LoRA set (`lora_apply.LoraState`)
        return e

    first, second = engine(), engine()
    built = first.tables(schedule)
    monkeypatch.setattr(dit, "modulation_tables", None)  # a hit never calls it
    hit = second.tables(schedule)
    assert first.warmup["adaln_cache"][0]["cache"] == "built" and second.warmup["adaln_cache"][0]["cache"] == "hit"
    assert _same(built, hit) and json.loads(_key_of(tmp_path))["identity"]["path"] == "tiny"
    # A student adapter not yet fused (a mixed queue's base jobs): the base tables; fused: another key.
    assert engine({"sha256": "ab"}, deferred=object()).tables(schedule) is not None
    with pytest.raises(TypeError):
        engine({"sha256": "ab"}).tables(schedule)  # a miss: it would run the (patched-away) projections


def _key_of(folder) -> str:
    (path,) = folder.glob("*.safetensors")
    with safe_open(str(path), "pt") as f:
        return f.metadata()["h3render_adaln_key"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tables_from_host_projections_equal_the_device_ones():
    """`DiT.modulation_tables` with the projections in host memory (after `offload_adaln_`, the fp8 load) copies each
    one to the device for its block alone: the same tables as with the projections on the device, and the modules
    stay on the host."""
    torch.manual_seed(0)
    model = DiT(DIT_TINY).cuda().bfloat16().eval()
    on_device = model.modulation_tables(TS, device="cuda")
    model.offload_adaln_("cpu")
    from_host = model.modulation_tables(TS, device="cuda")
    assert _same(on_device, from_host) and model.blocks[0].adaln_proj.linear.weight.device.type == "cpu"
