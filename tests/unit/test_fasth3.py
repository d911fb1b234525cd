"""FastH3 adapter reading, fusion into native DiT weights, and the few-step schedules."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3render.checkpoint import adapter as fasth3
from h3render.checkpoint.adapter import AdapterFusion, read_adapter
from h3render.checkpoint.contract import fasth3_schedule, is_fasth3_v2
from h3render.checkpoint.errors import AdapterError, CheckpointError
from h3render.checkpoint.info import CheckpointInfo
from h3render.checkpoint.load import assemble_components
from h3render.checkpoint.releases import RELEASES
from h3render.checkpoint.stream import Entry
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.models.dit import DiT
from h3render.models.dit_config import DIT_TINY
from tests._numerics import rel_err

CFG = DIT_TINY
H, D = CFG.num_attention_heads, CFG.attention_head_dim
F = CFG.ffn_dim

# Test-local diffusers -> native map, written out independently of h3render.checkpoint.names' table.
MODEL_NAMES = {
    "proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj", "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in", "time_embedder.linear_2": "time_embedder.proj_out",
    "token_refiner.final_norm": "token_refiner.final_norm", "norm_out.norm": "final_layer.norm",
    "norm_out.linear": "final_layer.adaln_proj.linear", "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}
BLOCK_NAMES = {
    "norm1": "norm1", "norm2": "norm2", "attn.norm_q": "attn.q_norm", "attn.norm_k": "attn.k_norm",
    "attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
    "adaln_proj.linear": "adaln_proj.linear", "attn.to_gate_compress": "attn.gate_proj",
    "attn.to_q": "attn.qkv_proj", "attn.to_k": "attn.qkv_proj", "attn.to_v": "attn.qkv_proj",
}


def to_native(module):
    if module in MODEL_NAMES:
        return MODEL_NAMES[module]
    if module.startswith("token_refiner.refiner_blocks."):
        prefix, rest = "token_refiner.blocks.", module[len("token_refiner.refiner_blocks."):]
    else:
        prefix, rest = "blocks.", module[len("transformer_blocks."):]
    index, suffix = rest.split(".", 1)
    return f"{prefix}{index}.{BLOCK_NAMES[suffix]}"


def expected_fusion(base, raw):
    """W + B·A + diff in float64, q/k/v interleaved per head and [value; gate] swapped, by hand."""
    out = {name: t.double().clone() for name, t in base.items()}
    for key, t in raw.items():
        if key.endswith(".lora_B.weight"):
            continue
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            delta, param = raw[module + ".lora_B.weight"].double() @ t.double(), to_native(module) + ".weight"
        elif key.endswith(".diff_b"):
            module = key[: -len(".diff_b")]
            delta, param = t.double(), to_native(module) + ".bias"
        elif key.endswith(".diff"):
            module = key[: -len(".diff")]
            delta, param = t.double(), to_native(module) + ".weight"
        else:  # .set_weight
            out[to_native(key[: -len(".set_weight")]) + ".weight"] = t.double()
            continue
        if module.endswith((".attn.to_q", ".attn.to_k", ".attn.to_v")):
            slot = "qkv".index(module[-1])
            for h in range(H):
                out[param][h * 3 * D + slot * D: h * 3 * D + (slot + 1) * D] += delta[h * D:(h + 1) * D]
        elif module.endswith(".ff.net.0.proj"):
            out[param][:F] += delta[F:]  # native gate rows <- diffusers second half
            out[param][F:] += delta[:F]  # native value rows <- diffusers first half
        else:
            out[param] += delta
    return out


def fuse_by_loading(state, adapter, dtype=torch.float32):
    """The loader's own path: `state` streamed as checkpoint entries into an empty tiny DiT through the fusion hook,
    then `finish()`; returns the loaded DiT's state dict."""
    assert RELEASES["tiny"].dit == CFG
    info = CheckpointInfo(path="<test>", layout="builtin", release=RELEASES["tiny"])
    entries = [Entry("<test>", name, lambda t=tensor: t) for name, tensor in state.items()]
    dit = assemble_components(info, source=lambda part: entries, where=lambda part: "<test>", tokenizer=None,
                              dtype=dtype, parts=("dit",), tensor_hook=AdapterFusion(adapter, CFG, "cpu")).dit
    return dit.state_dict()


@pytest.fixture(scope="module")
def base_state():
    torch.manual_seed(0)
    model = DiT(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return {name: t.clone() for name, t in model.state_dict().items()}


@pytest.fixture
def adapter_path(tmp_path):
    return write_synthetic_adapter(tmp_path / "adapter_model.safetensors", CFG, seed=3, rank=4)


def rewrite(path, tensors_fn=None, meta_fn=None, recount=True):
    """Rewrite an adapter with edited tensors/metadata; recount keeps the stated counts true."""
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(path)
    if tensors_fn:
        tensors_fn(tensors)
    if recount:
        meta["low_rank_tensors"] = str(sum(k.endswith(("lora_A.weight", "lora_B.weight")) for k in tensors))
        meta["diff_tensors"] = str(sum(k.endswith((".diff", ".diff_b")) for k in tensors))
        meta["set_weight_tensors"] = str(sum(k.endswith(".set_weight") for k in tensors))
    if meta_fn:
        meta_fn(meta)
    save_file(tensors, path, metadata=meta)
    return path


def test_read_adapter_metadata_counts_and_sha(adapter_path):
    adapter = read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL)
    raw = load_file(adapter_path)
    assert adapter.rank == 4
    assert adapter.counts["low_rank_tensors"] == sum(k.endswith("weight") and ".lora_" in k for k in raw) > 0
    assert adapter.counts["set_weight_tensors"] == 0 and not adapter.requires_vsa
    assert adapter.sha256 == hashlib.sha256(adapter_path.read_bytes()).hexdigest()
    key = "transformer_blocks.1.attn.to_k.lora_B.weight"
    assert adapter.entries[key].shape == (H * D, 4)
    torch.testing.assert_close(adapter.tensor(key), raw[key], rtol=0, atol=0)


def test_fusion_while_loading_equals_hand_reconstruction(adapter_path, base_state):
    adapter = read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL)
    before = {n: t.clone() for n, t in base_state.items()}
    fused = fuse_by_loading(base_state, adapter)
    assert all(torch.equal(before[n], base_state[n]) for n in before), "fusion must not edit its input"
    expected = expected_fusion(base_state, load_file(adapter_path))
    assert set(fused) == set(expected)
    worst = max(rel_err(fused[name], expected[name]) for name in expected)
    print(f"fp32 fusion worst rel err {worst:.3e}")
    assert worst <= 1e-6
    changed = {n for n in base_state if not torch.equal(fused[n], base_state[n])}
    targeted = {n for n in expected if not torch.equal(expected[n].float(), base_state[n])}
    assert changed == targeted and "blocks.1.attn.qkv_proj.weight" in changed and "blocks.0.mlp.fc1.weight" in changed


def test_bf16_fusion_computes_in_fp32_and_keeps_dtype(adapter_path, base_state):
    adapter = read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL)
    base16 = {n: t.to(torch.bfloat16) for n, t in base_state.items()}
    fused = fuse_by_loading(base16, adapter, dtype=torch.bfloat16)
    expected = expected_fusion(base16, load_file(adapter_path))
    name = "blocks.0.mlp.fc1.weight"
    assert fused[name].dtype == torch.bfloat16
    # fp32 sum rounded once to bf16: equal to the exact sum rounded, up to rare rounding-boundary cases.
    exact = (fused[name] == expected[name].to(torch.bfloat16)).double().mean().item()
    print(f"bf16 fusion: {exact:.4%} entries equal the correctly rounded sum, "
          f"rel err {rel_err(fused[name], expected[name]):.3e}")
    assert exact >= 0.99
    # A naive bf16 add of the bf16-rounded delta rounds twice and lands elsewhere on some entries.
    delta = (expected[name] - base16[name].double()).to(torch.bfloat16)
    assert not torch.equal(base16[name] + delta, fused[name])


def test_streaming_hook_untouched_passthrough_duplicate_and_missing(adapter_path, base_state):
    adapter = read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL)
    fusion = AdapterFusion(adapter, CFG, "cpu")
    untouched = base_state["condition_proj.weight"]
    assert fusion("condition_proj.weight", untouched) is untouched
    for name, tensor in reversed(list(base_state.items())):
        if name != "blocks.1.adaln_proj.linear.weight":
            fusion(name, tensor)
    with pytest.raises(AdapterError, match="blocks.1.adaln_proj.linear.weight"):
        fusion.finish()
    with pytest.raises(AdapterError, match="twice"):
        fusion("blocks.0.norm1.weight", base_state["blocks.0.norm1.weight"])


def test_set_weight_gates_are_assigned(tmp_path, base_state):
    path = write_synthetic_adapter(tmp_path / "vsa.safetensors", CFG, seed=5, with_set_weight=True)
    adapter = read_adapter(path, base_model=fasth3.TINY_BASE_MODEL)
    assert adapter.requires_vsa and adapter.counts["set_weight_tensors"] == CFG.num_layers
    assert adapter.gate_blocks == tuple(range(CFG.num_layers))
    raw = load_file(path)
    # A checkpoint that streams the gates (in-place fusion of a DiT with VSA on): the hook assigns the adapter's.
    fusion = AdapterFusion(adapter, CFG)
    for name, tensor in base_state.items():
        fusion(name, tensor)
    for i in range(CFG.num_layers):
        gate = fusion(f"blocks.{i}.attn.gate_proj.weight", torch.zeros(H * D, CFG.hidden_size))
        torch.testing.assert_close(gate, raw[f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"],
                                   rtol=0, atol=0)
    fusion.finish()
    # A dense DiT has no gate to receive them: the gate entries the fusion adds are unexpected tensors.
    with pytest.raises(CheckpointError, match="unexpected tensor 'blocks.0.attn.gate_proj.weight'"):
        fuse_by_loading(base_state, adapter)


@pytest.mark.parametrize("case, match", [
    ("unknown_module", "unknown target"),
    ("unknown_suffix", "unknown suffix"),
    ("missing_count", "diff_tensors is missing"),
    ("count_mismatch", "low_rank_tensors=.* but the file holds"),
    ("format", "format='peft'"),
    ("rank", "rank=8"),
    ("unpaired", "to_v.lora_B.weight is missing"),
])
def test_read_adapter_rejects(adapter_path, case, match):
    def add(key, value):
        return lambda t: t.__setitem__(key, value)

    edits = {
        "unknown_module": dict(tensors_fn=add("transformer_blocks.0.attn.to_x.diff", torch.zeros(3))),
        "unknown_suffix": dict(tensors_fn=add("transformer_blocks.0.attn.to_q.magnitude", torch.ones(()))),
        "missing_count": dict(meta_fn=lambda m: m.pop("diff_tensors")),
        "count_mismatch": dict(tensors_fn=lambda t: [t.pop(k) for k in [k for k in t if "norm_out.linear.lora" in k]],
                               recount=False),
        "format": dict(meta_fn=lambda m: m.__setitem__("format", "peft")),
        "rank": dict(meta_fn=lambda m: m.__setitem__("rank", "8")),
        "unpaired": dict(tensors_fn=lambda t: t.pop("transformer_blocks.1.attn.to_v.lora_B.weight")),
    }
    rewrite(adapter_path, **edits[case])
    with pytest.raises(AdapterError, match=match):
        read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL)


def test_base_model_mismatch_names_both(adapter_path):
    with pytest.raises(AdapterError, match="h3render/tiny-random-h3.*MiniMaxAI/MiniMax-H3"):
        read_adapter(adapter_path)  # default: the released checkpoint


def test_fusion_rejects_block_beyond_config_and_untouched_block(adapter_path, tmp_path):
    rewrite(adapter_path, tensors_fn=lambda t: t.__setitem__("transformer_blocks.7.norm1.diff",
                                                             torch.zeros(CFG.hidden_size)))
    with pytest.raises(AdapterError, match="blocks.7.norm1.weight.*unknown target"):
        AdapterFusion(read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL), CFG)
    path = write_synthetic_adapter(tmp_path / "b.safetensors", CFG, seed=1)
    refiner_1 = "token_refiner.refiner_blocks.1."
    rewrite(path, tensors_fn=lambda t: [t.pop(k) for k in [k for k in t if k.startswith(refiner_1)]])
    with pytest.raises(AdapterError, match="token_refiner.blocks.1 untouched"):
        AdapterFusion(read_adapter(path, base_model=fasth3.TINY_BASE_MODEL), CFG)


def test_fusion_rejects_adapter_for_another_config(adapter_path):
    other = type(CFG)(**{**CFG.__dict__, "hidden_size": 96, "time_embed_hidden_dim": 96})
    with pytest.raises(AdapterError, match="does not fit"):
        AdapterFusion(read_adapter(adapter_path, base_model=fasth3.TINY_BASE_MODEL), other)


# Hand-computed with s·σ/(1+(s−1)·σ) in float64.
RELEASE_VIDEO = [0.9999165902, 0.9728325576, 0.9230769231, 0.8, 0.0]  # shift 12 on (0.999, 0.749, 0.5, 0.25, 0)
RELEASE_AUDIO = [0.9996664443, 0.8995196157, 0.75, 0.5, 0.0]  # shift 3
EXAMPLE_VIDEO = [1.0, 0.972972973, 0.9230769231, 0.8, 0.0]  # shift 12 on (1, 0.75, 0.5, 0.25, 0)
EXAMPLE_AUDIO = [1.0, 0.9, 0.75, 0.5, 0.0]
V2_VIDEO = [0.9998999099, 0.9857884051, 0.9675752487, 0.9431680774, 0.9090909091, 0.8571428571, 0.7692307692,
            0.5882352941, 0.0]  # shift 10 on the 9 V2 positions
V2_AUDIO = [0.9996664443, 0.9541484716, 0.8995196157, 0.8327402135, 0.75, 0.6428571429, 0.5, 0.3, 0.0]


def close(actual, literal):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), torch.tensor(literal, dtype=torch.float64), rtol=0, atol=1e-7)


def test_release_default_schedule():
    s = fasth3_schedule(None, 12.0, 3.0)
    assert s.source == "release default" and s.forwards == 4 and s.positions == (0.999, 0.749, 0.5, 0.25, 0.0)
    close(s.video, RELEASE_VIDEO)
    close(s.audio, RELEASE_AUDIO)


def test_named_fastvideo_example_schedule_matches_diffusers_scheduler():
    s = fasth3_schedule(None, 12.0, 3.0, positions="fastvideo-example")
    close(s.video, EXAMPLE_VIDEO)
    close(s.audio, EXAMPLE_AUDIO)
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    ref = MiniMaxH3Scheduler(shift=12.0)
    ref.set_timesteps(num_inference_steps=5)
    assert torch.equal(s.video, ref.sigmas.float())
    with pytest.raises(ValueError, match="unknown FastH3 position set"):
        fasth3_schedule(None, positions="linear")


def test_schedule_from_adapter_metadata(tmp_path):
    path = write_synthetic_adapter(tmp_path / "a.safetensors", CFG, seed=0, dmd_denoising_steps=[1000, 750, 500, 250])
    s = fasth3_schedule(read_adapter(path, base_model=fasth3.TINY_BASE_MODEL), 12.0, 3.0)
    assert s.source == "adapter metadata" and s.positions == (1.0, 0.75, 0.5, 0.25, 0.0)
    close(s.video, EXAMPLE_VIDEO)
    manifest = {"sampling": {"base_timesteps": [999, 749, 500, 250]}}
    close(fasth3_schedule(manifest, 12.0, 3.0).video, RELEASE_VIDEO)
    with pytest.raises(ValueError, match="dmd_denoising_steps"):
        fasth3_schedule({"dmd_denoising_steps": "[0.999, 0.749]"})


V2_CONTRACT = {
    "model_id": "FastVideo/FastVideo-FastH3-8-Step-V2", "schema_version": "fasth3-inference-contract-v1",
    "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "transformer_forwards": 8,
    "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0, "guidance_scale": 1.0,
    "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_sparsity": 0.8, "vsa_tile_size": 64, "task": "t2av",
}


def test_v2_schedule_from_its_contract():
    assert is_fasth3_v2(V2_CONTRACT) and not is_fasth3_v2({"dmd_denoising_steps": [999]})
    s = fasth3_schedule(json.loads(json.dumps(V2_CONTRACT)), video_shift=12.0, audio_shift=3.0)
    assert s.source == "FastH3 V2 contract" and s.forwards == 8 and len(s.video) == 9
    assert s.video_shift == 10.0
    close(s.video, V2_VIDEO)
    close(s.audio, V2_AUDIO)
    with pytest.raises(ValueError, match="transformer_forwards=4"):
        fasth3_schedule({**V2_CONTRACT, "transformer_forwards": 4})
