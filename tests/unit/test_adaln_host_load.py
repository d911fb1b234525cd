"""The DiT's AdaLN projections load into host memory on a CUDA device at every precision (issue 26 item 4), read
there straight from the safetensors file (`Entry.host`), never through the device: before, a bf16 load put them on
the GPU and `Engine.prepare` copied 26 GB back at ≈1 GB/s (docs/performance.md §11.2).

CPU machines have no second device: "meta" stands in for the GPU (everything else streams there), and each AdaLN
entry's device loader is replaced by one that fails, so only the host loader can have read it.
"""

from __future__ import annotations

import pytest
import torch

from h3render.checkpoint import load
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.layouts import dit_entries
from h3render.checkpoint.load import _adaln_home, assemble_components, load_components
from h3render.checkpoint.stream import Entry
from h3render.make_checkpoint.writer import make_checkpoint
from h3render.models.dit import AdaLNProj

DTYPE = torch.bfloat16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="host vs device placement needs a GPU")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaln-host")
    return {"official": make_checkpoint(root / "official", "tiny", "official", seed=0),
            "diffusers": make_checkpoint(root / "diffusers", "tiny", "diffusers", seed=0),
            "single-file": make_checkpoint(root / "single.safetensors", "tiny", "single-file", seed=0)}


def _adaln_names(dit) -> set[str]:
    return {f"{n}.{leaf}" for n, m in dit.named_modules() if isinstance(m, AdaLNProj)
            for leaf, _ in m.named_parameters()}


def _device_reads_refused(entries, names: set[str]):
    """`entries` with each AdaLN tensor's device loader failing: the load must take its host loader."""
    def refuse(entry: Entry):
        raise AssertionError(f"{entry.name} was read through the device loader")

    for entry in entries:
        yield entry._replace(load=lambda e=entry: refuse(e)) if entry.name in names else entry


def test_home_is_host_memory_on_cuda_at_every_precision_and_the_dit_device_elsewhere():
    for precision in ("bf16", "fp8"):
        assert _adaln_home(None, precision, "cuda") == torch.device("cpu")
        assert _adaln_home(None, precision, torch.device("cuda", 1)) == torch.device("cpu")
        assert _adaln_home(None, precision, "cpu") == torch.device("cpu")  # the CPU path: with the DiT
    assert _adaln_home(None, "bf16", "meta") == torch.device("meta")  # bf16 off CUDA: where the DiT goes
    assert _adaln_home("cuda:1", "bf16", "cuda:0") == torch.device("cuda", 1)  # asked for: as asked


@pytest.mark.parametrize("layout", ["official", "diffusers", "single-file"])
def test_every_layout_reads_the_projections_into_host_memory_directly(ckpts, layout):
    info = read_checkpoint_info(ckpts[layout])
    want = load_components(ckpts[layout], "cpu", DTYPE, parts=("dit",)).dit
    names = _adaln_names(want)
    assert len(names) == 2 * (info.release.dit.num_layers + 1)
    dit = assemble_components(info, lambda part: _device_reads_refused(dit_entries(info, "cpu"), names),
                              where=lambda part: str(ckpts[layout]), tokenizer=lambda: None, device="meta",
                              dtype=DTYPE, parts=("dit",), adaln_device="cpu").dit
    got, expected = dict(dit.named_parameters()), dict(want.named_parameters())
    for name in names:
        assert got[name].device.type == "cpu" and got[name].dtype == expected[name].dtype
        assert torch.equal(got[name], expected[name]), name
    assert all(t.is_meta for n, t in got.items() if n not in names)


@CUDA
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_a_cuda_load_of_a_checkpoint_keeps_the_projections_off_the_gpu(ckpts, monkeypatch, precision):
    folder = ckpts["official"]
    want = load_components(folder, "cpu", DTYPE, parts=("dit",)).dit
    names = _adaln_names(want)
    monkeypatch.setattr(load, "dit_entries",
                        lambda info, device="cpu": _device_reads_refused(dit_entries(info, device), names))
    dit = load_components(folder, "cuda", DTYPE, parts=("dit",), precision=precision).dit
    got, expected = dict(dit.named_parameters()), dict(want.named_parameters())
    assert all(got[n].device.type == "cpu" and torch.equal(got[n], expected[n]) for n in names)
    assert all(t.device.type == "cuda" for n, t in got.items() if n not in names)


@CUDA
def test_a_bf16_cuda_load_of_a_builtin_model_puts_the_projections_in_host_memory():
    # Random weights are made on the device (no host loader): they cross once, in the load, one tensor at a time.
    dit = load_components("tiny", "cuda", DTYPE, parts=("dit",)).dit
    names = _adaln_names(dit)
    assert all(p.device.type == ("cpu" if n in names else "cuda") for n, p in dit.named_parameters())
    t = torch.tensor([1.0, 0.5])
    tables = dit.modulation_tables(t, device="cuda")
    assert tables.final.device.type == "cuda" and dit.final_layer.adaln_proj.linear.weight.device.type == "cpu"
