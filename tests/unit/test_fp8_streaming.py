"""`precision="fp8"` loading (issue #18 memory): the DiT's block linears are quantized while they stream and its AdaLN
projections go to host memory, so the bf16 DiT never exists whole on the device.

Each streamed DiT is compared with today's reference, the bf16 load quantized afterwards (`quantize_dit_fp8_`): every
tensor bit for bit and one forward equal, for the plain tiny model, a FastH3 adapter fused by the load hook, and a
VSA student whose gates come through the adapter's `.set_weight` path (`StudentHook.prepare` turns VSA on first).
"""

from __future__ import annotations

import re
import weakref

import pytest
import torch

from h3render.checkpoint.builtin import random_entries
from h3render.checkpoint.builtin import tiny_vl_tokenizer
from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_components
from h3render.checkpoint.load import _adaln_home, assemble_components
from h3render.checkpoint.releases import RELEASES
from h3render.checkpoint.students import plan_student
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.models.dit import AdaLNProj
from h3render.models.dit_config import DIT_TINY
from h3render.models.fp8 import DIT_BLOCK_LINEARS, Fp8Linear, empty_dit_fp8_, quantize_dit_fp8_
from tests.unit.test_vsa_dit import _forward

TINY = RELEASES["tiny"]
DTYPE = torch.bfloat16  # the release's load dtype: the FP8 weights are quantized from bf16 values
# Native names of the block-linear weights that become FP8 (VSA gate included).
_BLOCK_WEIGHT = re.compile(r"blocks\.\d+\.(" + "|".join(re.escape(p) for p in DIT_BLOCK_LINEARS) + r")\.weight")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {"adapter": write_synthetic_adapter(folder / "dense.safetensors", DIT_TINY, seed=3, rank=4),
            "vsa": write_synthetic_adapter(folder / "vsa.safetensors", DIT_TINY, seed=5, rank=4,
                                           with_set_weight=True)}


def _hook(case: str, adapters):
    """A fresh load hook per load (a hook checks that each target streams once): None, or the StudentHook that
    `Engine.load` passes."""
    if case == "plain":
        return None
    return plan_student("tiny", read_checkpoint_info("tiny"), adapters[case]).hook


def _load(precision: str, hook=None, *, adaln_device=None, source=None):
    """The tiny DiT through `assemble_components` (the path of checkpoints and built-in models), on CPU in bf16."""
    info = read_checkpoint_info("tiny")
    return assemble_components(info, source or (lambda part: random_entries(part, TINY, 0)),
                               where=lambda part: "<builtin tiny>",
                               tokenizer=lambda: tiny_vl_tokenizer(TINY.text_config.vocab_size), device="cpu",
                               dtype=DTYPE, parts=("dit",), tensor_hook=hook, precision=precision,
                               adaln_device=adaln_device).dit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tensors(module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by name."""
    return dict(module.named_parameters()) | dict(module.named_buffers())


def _assert_bitwise_equal(a, b, skip=lambda name: False) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        if skip(name):
            continue
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(_bits(ta[name]), _bits(tb[name])), name
    assert {n: type(m) for n, m in a.named_modules()} == {n: type(m) for n, m in b.named_modules()}


@pytest.mark.parametrize("case", ["plain", "adapter", "vsa"])
def test_streamed_fp8_dit_equals_quantize_after_load(case, adapters):
    reference = _load("bf16", _hook(case, adapters))
    quantize_dit_fp8_(reference)  # today's path: the whole bf16 DiT, then one linear at a time
    streamed = _load("fp8", _hook(case, adapters))
    per_block = 5 if case == "vsa" else 4
    fp8 = [m for m in streamed.blocks.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == per_block * DIT_TINY.num_layers and all(m.out_dtype == DTYPE for m in fp8)
    assert (streamed.vsa_sparsity is not None) == (case == "vsa")
    _assert_bitwise_equal(streamed, reference)
    if case != "plain":  # the hook changed what was quantized (else the comparison would not test the order)
        base = _load("bf16")
        quantize_dit_fp8_(base)
        assert not torch.equal(_bits(streamed.blocks[0].mlp.fc1.weight), _bits(base.blocks[0].mlp.fc1.weight))
    v, a = _forward(streamed)
    ref_v, ref_a = _forward(reference)
    assert torch.isfinite(v).all() and torch.equal(v, ref_v) and torch.equal(a, ref_a)


class _LiveBf16Weights:
    """A load hook (wrapping `inner`) that keeps a weak reference to the storage of every block-linear weight it
    hands on, and notes how many of the earlier ones are still alive when the next arrives."""

    def __init__(self, inner=None):
        self.inner = inner
        self.refs: list[weakref.ref] = []
        self.alive_on_arrival: list[int] = []

    def __getattr__(self, name):  # prepare / entries / finish of the wrapped StudentHook
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            tensor = self.inner(name, tensor)
        if _BLOCK_WEIGHT.fullmatch(name):
            # No gc.collect(): a weight held only by a reference cycle still occupies device memory until the
            # collector runs, so counting by reference alone is the stricter check.
            assert tensor.dtype == DTYPE  # the value the bf16 path would keep (stored bf16, fused in bf16)
            self.alive_on_arrival.append(sum(ref() is not None for ref in self.refs))
            self.refs.append(weakref.ref(tensor.untyped_storage()))
        return tensor


@pytest.mark.parametrize("case", ["plain", "adapter"])
def test_one_bf16_block_weight_alive_at_a_time(case, adapters):
    tracker = _LiveBf16Weights(_hook(case, adapters))
    dit = _load("fp8", tracker)
    assert len(tracker.refs) == 4 * DIT_TINY.num_layers
    # Quantize-after-load keeps every earlier bf16 weight in the DiT: [0, 1, ..., 7] here.
    assert tracker.alive_on_arrival == [0] * len(tracker.refs)
    assert all(ref() is None for ref in tracker.refs)
    assert isinstance(dit.blocks[0].attn.qkv_proj, Fp8Linear)


def test_adaln_projections_load_where_asked_and_nothing_else_moves():
    # Meta stands in for host memory here (CPU has one device): each AdaLN tensor leaves the stream for
    # `adaln_device`, everything else stays on `device`, identical to the default fp8 load.
    at_home = _load("fp8")
    away = _load("fp8", adaln_device="meta")
    adaln = {f"{n}.{leaf}" for n, m in away.named_modules() if isinstance(m, AdaLNProj)
             for leaf, _ in m.named_parameters()}
    assert len(adaln) == 2 * (DIT_TINY.num_layers + 1)
    tensors = _tensors(away)
    assert all(tensors[n].is_meta and tensors[n].dtype == DTYPE for n in adaln)
    assert not any(t.is_meta for n, t in tensors.items() if n not in adaln)
    _assert_bitwise_equal(away, at_home, skip=adaln.__contains__)
    plain = _load("bf16", adaln_device="meta")  # bf16 too, when asked: block linears stay nn.Linear
    assert plain.blocks[0].adaln_proj.linear.weight.is_meta and type(plain.blocks[0].mlp.fc1) is torch.nn.Linear


def test_adaln_home_defaults():
    assert _adaln_home(None, "fp8", "cuda") == torch.device("cpu")  # host memory under fp8
    assert _adaln_home(None, "bf16", "cuda") == torch.device("cpu")  # host memory on CUDA at bf16 too (issue 26)
    assert _adaln_home(None, "bf16", "cpu") == torch.device("cpu")
    assert _adaln_home("cuda:1", "fp8", "cuda:0") == torch.device("cuda", 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host vs device placement needs a GPU")
def test_adaln_on_host_tables_equal_on_cuda():
    fp8 = load_components("tiny", "cuda", DTYPE, parts=("dit",), precision="fp8").dit
    bf16 = load_components("tiny", "cuda", DTYPE, parts=("dit",)).dit
    assert fp8.blocks[0].adaln_proj.linear.weight.device.type == "cpu"
    assert fp8.blocks[0].attn.qkv_proj.weight.device.type == "cuda"
    t = torch.tensor([1.0, 0.75, 0.5])
    got, want = fp8.modulation_tables(t, device="cuda"), bf16.modulation_tables(t, device="cuda")
    assert all(torch.equal(g, w) for g, w in zip(got.blocks + (got.final,), want.blocks + (want.final,)))
    assert fp8.blocks[0].adaln_proj.linear.weight.device.type == "cpu"  # went back after its visit


def test_pre_quantized_scale_entry_and_misuse_are_refused():
    def source(part):
        entries = list(random_entries(part, TINY, 0))
        weight = next(e for e in entries if e.name == "blocks.0.mlp.fc1.weight")
        return entries + [weight._replace(name="blocks.0.mlp.fc1.weight_scale")]

    with pytest.raises(CheckpointError, match=r"'blocks\.0\.mlp\.fc1\.weight_scale'.*pre-quantized"):
        _load("fp8", source=source)
    loaded = _load("bf16")
    with pytest.raises(ValueError, match="already loaded; quantize a loaded DiT with quantize_dit_fp8_"):
        empty_dit_fp8_(loaded)
    streamed = _load("fp8")
    with pytest.raises(ValueError, match="enable VSA first"):
        streamed.enable_vsa(0.75)
