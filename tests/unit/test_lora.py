"""Per-job LoRAs (issue #25): every published layout read by `checkpoint.lora` and merged by
`checkpoint.lora_apply` equals diffusers 0.42.1's own conversion merged by hand; stacking, strength 0, unfusing,
the side path (bf16 and beside FP8 linears) and the refusals, each naming the file and key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3render.checkpoint.lora import FORMATS, LoraError, read_lora
from h3render.checkpoint.lora_apply import LoraState, resolve_mode
from h3render.checkpoint.names import dit_state_dict_to_diffusers
from h3render.make_checkpoint.synthetic_lora import write_synthetic_lora
from h3render.models.dit import DiT
from h3render.models.dit_config import DIT_TINY

# head_dim 128: diffusers de-interleaves DiffSynth's fused qkv assuming the released 128-wide heads.
CFG = replace(DIT_TINY, num_attention_heads=2, attention_head_dim=128)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    model = DiT(CFG).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def diffusers_merged(base_native, path, strength=1.0, header_alpha=None):
    """The oracle: diffusers' `MiniMaxH3LoraLoaderMixin.lora_state_dict` conversion, merged into the base weights
    under diffusers names by hand (W + strength * B @ A; a header alpha, which diffusers passes to PEFT rather than
    folding, applied as alpha / rank)."""
    from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin

    raw = load_file(str(path))
    if any(k.startswith("base_model.model.") for k in raw) or not any(
            k.startswith(("transformer.", "diffusion_model.", "blocks.", "token_refiner.", "final_layer.", "lora_unet_"))
            for k in raw):
        # PEFT's prefix and bare diffusers names (FastVideo) are not the mixin's business: name them as diffusers does.
        raw = {"transformer." + k.removeprefix("base_model.model."): v for k, v in raw.items()}
    state = MiniMaxH3LoraLoaderMixin.lora_state_dict(raw)
    merged = {k: v.double() for k, v in dit_state_dict_to_diffusers(base_native, CFG).items()}
    for key, down in state.items():
        if ".lora_A." not in key:
            continue
        up = state[key.replace(".lora_A.", ".lora_B.")]
        scale = strength * (header_alpha / down.shape[0] if header_alpha else 1.0)
        module = key.removeprefix("transformer.").split(".lora_A.")[0]
        merged[f"{module}.weight"] += scale * up.double() @ down.double()
    return merged


def assert_merged_equal(model, reference, tol=1e-6):
    ours = dit_state_dict_to_diffusers(snapshot(model), CFG)
    worst = max(float((ours[k].double() - reference[k]).abs().max()) for k in reference)
    assert worst <= tol, worst


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_equals_the_diffusers_merge_and_unfuses_bit_for_bit(tmp_path, dit, fmt):
    base = snapshot(dit)
    path = write_synthetic_lora(tmp_path / f"{fmt}.safetensors", CFG, fmt, seed=1, rank=4, adaln_rank=2,
                                alpha=8.0 if fmt == "kohya" else None)
    lora = read_lora(path)
    assert lora.format == fmt
    assert "blocks.0.attn.qkv_proj" in lora.modules and "final_layer.adaln_proj.linear" in lora.modules
    state = LoraState(dit, CFG, "fuse")
    assert state.switch([(lora, 0.75)])
    changed = [k for k in base if not torch.equal(base[k], dit.state_dict()[k])]
    assert "blocks.1.mlp.fc1.weight" in changed and "blocks.0.adaln_proj.linear.weight" in changed
    assert_merged_equal(dit, diffusers_merged(base, path, strength=0.75))
    state.clear()
    assert all(torch.equal(base[k], v) for k, v in dit.state_dict().items())  # unfused: the base, bit-for-bit


def test_header_alpha_stacking_and_strength_zero(tmp_path, dit):
    base = snapshot(dit)
    a = read_lora(write_synthetic_lora(tmp_path / "a.safetensors", CFG, "diffusers", seed=2, header_alpha=8.0))
    b = read_lora(write_synthetic_lora(tmp_path / "b.safetensors", CFG, "ai-toolkit", seed=3))
    assert a.scales[0] in (8.0 / 4, 8.0 / 2)  # alpha / rank, per pair (mixed ranks)
    state = LoraState(dit, CFG, "fuse")
    state.switch([(a, 1.0)])
    assert_merged_equal(dit, diffusers_merged(base, a.path, header_alpha=8.0))
    delta = {}
    for lora, s in ((a, 0.5), (b, -1.25)):
        state.switch([(lora, s)])
        delta[lora.path] = {k: v.double() - base[k].double() for k, v in dit.state_dict().items()}
    state.switch([(a, 0.5), (b, -1.25)])
    stacked = dit.state_dict()
    worst = max(float((stacked[k].double() - base[k].double() - delta[a.path][k] - delta[b.path][k]).abs().max())
                for k in base)
    assert 0 < max(float(d.abs().max()) for d in delta[b.path].values()) and worst <= 1e-6
    # strength 0 changes nothing, bit for bit: the set of (b, 0) is the empty set.
    state.switch([])
    assert not state.switch([(b, 0.0)])
    assert all(torch.equal(base[k], v) for k, v in dit.state_dict().items())


def test_side_path_equals_fused_weights(tmp_path, dit):
    lora = read_lora(write_synthetic_lora(tmp_path / "k.safetensors", CFG, "kohya", seed=4))
    x = torch.randn(5, CFG.hidden_size)
    modules = (dit.blocks[1].attn.qkv_proj, dit.blocks[0].mlp.fc1, dit.token_refiner.blocks[0].attn.out_proj)
    base_out = [m(x if m.in_features == CFG.hidden_size else torch.randn(5, m.in_features)) for m in modules]
    xs = [x if m.in_features == CFG.hidden_size else torch.randn(5, m.in_features) for m in modules]
    fuse = LoraState(dit, CFG, "fuse")
    fuse.switch([(lora, 0.6)])
    fused = [m(xi) for m, xi in zip(modules, xs)]
    fuse.clear()
    side = LoraState(dit, CFG, "side")
    side.switch([(lora, 0.6)])
    sided = [m(xi) for m, xi in zip(modules, xs)]
    for f, s in zip(fused, sided):
        assert float((f - s).abs().max()) <= 1e-5 * float(f.abs().max())
    side.clear()
    assert float((modules[0](xs[0]) - fused[0]).abs().max()) > 1e-4  # hooks gone: the base again
    assert base_out  # (the base outputs were computed before any LoRA)


def test_side_path_beside_fp8_linears_error_measured(tmp_path):
    """With --precision fp8 the LoRA runs as a bf16 side path beside the FP8 GEMM. Its error against the exact
    fp32 merged linear is the FP8 error of the base GEMM, not more: measured on the tiny shape (CPU)."""
    from h3render.models.fp8 import quantize_dit_fp8_

    torch.manual_seed(5)
    model = DiT(CFG).float()
    lora = read_lora(write_synthetic_lora(tmp_path / "t.safetensors", CFG, "comfy", seed=5, std=0.5))
    x = torch.randn(64, CFG.hidden_size)
    exact = LoraState(model, CFG, "fuse")
    exact.switch([(lora, 1.0)])
    reference = model.blocks[0].attn.qkv_proj(x).double()
    exact.clear()
    base_ref = model.blocks[0].attn.qkv_proj(x).double()
    model.to(torch.bfloat16)
    quantize_dit_fp8_(model)
    fp8_base = model.blocks[0].attn.qkv_proj(x.bfloat16()).double()
    side = LoraState(model, CFG, resolve_mode("auto", "fp8"))
    assert side.mode == "side"
    side.switch([(lora, 1.0)])
    fp8_lora = model.blocks[0].attn.qkv_proj(x.bfloat16()).double()
    rel = float((fp8_lora - reference).norm() / reference.norm())
    rel_base = float((fp8_base - base_ref).norm() / base_ref.norm())
    lora_share = float((reference - base_ref).norm() / reference.norm())
    assert lora_share > 0.05  # the LoRA matters at this strength
    assert rel < 1.5 * rel_base + 1e-3, (rel, rel_base)  # measured: rel 0.027 vs rel_base 0.035 (docs/lora.md)
    with pytest.raises(ValueError, match="fp8"):
        resolve_mode("fuse", "fp8")


def rewrite(path, out, edit=None, metadata=None):
    tensors = load_file(str(path))
    if edit:
        edit(tensors)
    save_file(tensors, str(out), metadata=metadata)
    return out


@pytest.mark.parametrize("case, match", [
    ("gate", "VSA gate attn.to_gate_compress"),
    ("norm", "no linear weight"),
    ("unknown_module", "names no MiniMax-H3 DiT module"),
    ("unpaired", "unpaired LoRA factor"),
    ("ref", "transformer_ref"),
    ("dora", "DoRA"),
    ("diff", "full-rank FastH3 adapter payload"),
    ("suffix", "not a LoRA tensor"),
    ("twice", "both change"),
    ("bad_alpha", "positive finite"),
    ("int_factor", "floating point"),
])
def test_refusals_name_file_and_key(tmp_path, case, match):
    src = write_synthetic_lora(tmp_path / "src.safetensors", CFG, "diffusers", seed=6)
    t = "transformer.transformer_blocks.0"

    def edit(d):
        pair = (torch.zeros(2, CFG.hidden_size), torch.zeros(256, 2))
        if case == "gate":
            d[f"{t}.attn.to_gate_compress.lora_A.weight"], d[f"{t}.attn.to_gate_compress.lora_B.weight"] = pair
        elif case == "norm":
            d[f"{t}.norm1.lora_A.weight"], d[f"{t}.norm1.lora_B.weight"] = pair
        elif case == "unknown_module":
            d[f"{t}.attn.to_x.lora_A.weight"], d[f"{t}.attn.to_x.lora_B.weight"] = pair
        elif case == "unpaired":
            del d[f"{t}.attn.to_out.0.lora_B.weight"]
        elif case == "ref":
            d["transformer_ref.transformer_blocks.0.attn.to_q.lora_A.weight"] = pair[0]
        elif case == "dora":
            d[f"{t}.attn.to_q.dora_scale"] = torch.ones(1, 256)
        elif case == "diff":
            d[f"{t}.norm1.diff"] = torch.zeros(CFG.hidden_size)
        elif case == "suffix":
            d[f"{t}.attn.to_q.weight"] = torch.zeros(256, CFG.hidden_size)
        elif case == "twice":  # a native fused-qkv pair beside the diffusers to_q pair of the same weight
            d["blocks.0.attn.qkv_proj.lora_A.weight"], d["blocks.0.attn.qkv_proj.lora_B.weight"] = (
                torch.zeros(2, CFG.hidden_size), torch.zeros(768, 2))
        elif case == "bad_alpha":
            d[f"{t}.attn.to_q.alpha"] = torch.tensor(-1.0)
        elif case == "int_factor":
            d[f"{t}.attn.to_q.lora_A.weight"] = d[f"{t}.attn.to_q.lora_A.weight"].to(torch.int32)

    bad = rewrite(src, tmp_path / "bad.safetensors", edit)
    with pytest.raises(LoraError, match=match) as info:
        read_lora(bad)
    assert "bad.safetensors" in str(info.value)


def test_unreadable_missing_shape_and_fastvideo_unwrapped(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(LoraError, match="garbage.safetensors: not a readable safetensors"):
        read_lora(garbage)
    with pytest.raises(LoraError, match="not found"):
        read_lora(tmp_path / "absent.safetensors")
    fv = write_synthetic_lora(tmp_path / "fv.safetensors", CFG, "fastvideo", seed=7)
    bad = rewrite(fv, tmp_path / "fv_bad.safetensors",
                  lambda d: d.update({"proj_in.lora_A.weight": torch.zeros(2, 4), "proj_in.lora_B.weight":
                                      torch.zeros(CFG.hidden_size, 2)}), metadata={"format": "fastvideo-lora-v2"})
    with pytest.raises(LoraError, match="FastVideo never wraps"):
        read_lora(bad)
    # The same file under another config: its factors do not fit, named at factors().
    other = read_lora(write_synthetic_lora(tmp_path / "small.safetensors", DIT_TINY, "comfy", seed=8))
    with pytest.raises(LoraError, match="does not fit"):
        other.factors(CFG)


def test_fasth3_adapter_edge_cases_of_fastvideo_merge(tmp_path):
    """Issue #25 item 5, found against FastVideo 0.2.1's merge: a LoRA pair on the VSA gate is the "never wraps"
    error (it was "both assigned and patched" at fusion), and a .set_weight on a weight the base has names the
    key and both shapes (it was a size mismatch later)."""
    from h3render.checkpoint.adapter import AdapterFusion, read_adapter
    from h3render.checkpoint.errors import AdapterError
    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    src = write_synthetic_adapter(tmp_path / "ad.safetensors", DIT_TINY, seed=1, with_set_weight=True)
    meta = dict(__import__("safetensors").safe_open(str(src), "pt").metadata())
    inner = DIT_TINY.num_attention_heads * DIT_TINY.attention_head_dim

    def gate_pair(d):
        d["transformer_blocks.0.attn.to_gate_compress.lora_A.weight"] = torch.zeros(4, DIT_TINY.hidden_size)
        d["transformer_blocks.0.attn.to_gate_compress.lora_B.weight"] = torch.zeros(inner, 4)

    meta_gate = dict(meta, low_rank_tensors=str(int(meta["low_rank_tensors"]) + 2))
    with pytest.raises(AdapterError, match="FastVideo never wraps.*to_gate_compress"):
        read_adapter(rewrite(src, tmp_path / "gate.safetensors", gate_pair, meta_gate),
                     base_model=meta["base_model"])
    meta_q = dict(meta, set_weight_tensors=str(int(meta["set_weight_tensors"]) + 1))
    bad = rewrite(src, tmp_path / "setq.safetensors",
                  lambda d: d.update({"transformer_blocks.1.attn.to_q.set_weight": torch.zeros(inner, 8)}), meta_q)
    adapter = read_adapter(bad, base_model=meta["base_model"])
    with pytest.raises(AdapterError, match=r"'transformer_blocks.1.attn.to_q.set_weight' \[128, 8\] assigns "
                                           r"blocks.1.attn.qkv_proj.weight \[384, 64\], a weight the base model has"):
        AdapterFusion(adapter, DIT_TINY)


def test_queue_render_order_groups_lora_sets_after_base_before_student():
    from h3render.job_loras import LoraRef
    from h3render.jobs import Job
    from h3render.runner import render_order

    def ref(name, strength=1.0):
        return LoraRef(name, f"/l/{name}", strength, "0" * 64, "comfy", 1)

    base = Job(id=None, prompt="p", width=128, height=64, frames=22, seed=0, steps=2, mode="t2va", output="o")
    x, y = (ref("x"),), (ref("y"), ref("x", 0.5))
    jobs = [Job(**{**base.__dict__, "output": f"j{i}", "loras": s, "mode": m, "steps": None if m == "fasth3" else 2})
            for i, (s, m) in enumerate([(x, "t2va"), (y, "t2va"), ((), "fasth3"), (x, "t2va"), ((ref("x", 0),), "t2va"),
                                        (y, "t2va"), (x, "fasth3")])]
    # Sets ranked by first appearance in the manifest: x (j0), y (j1), none (j2; j4's only LoRA has strength 0).
    # t2va first: x x y y none; then fasth3: x (j6) before none (j2).
    assert render_order(jobs) == [0, 3, 1, 5, 4, 6, 2]


def test_a_failing_switch_leaves_the_base_weights(tmp_path, dit):
    """A LoRA whose product overflows one weight fails at the switch after earlier weights were fused: the DiT goes
    back to the base weights (bit for bit) and the state says it holds no set."""
    from h3render.checkpoint.errors import AdapterError

    base = snapshot(dit)
    good = read_lora(write_synthetic_lora(tmp_path / "g.safetensors", CFG, "comfy", seed=9))
    path = write_synthetic_lora(tmp_path / "b.safetensors", CFG, "comfy", seed=9)
    tensors = load_file(str(path))
    # Each factor within bounds, their product far beyond fp16's range; fused after the blocks' weights (name order).
    tensors["token_refiner.blocks.1.mlp.fc2.lora_A.weight"].fill_(300.0)
    tensors["token_refiner.blocks.1.mlp.fc2.lora_B.weight"].fill_(300.0)
    save_file(tensors, str(path))
    state = LoraState(dit, CFG, "fuse")
    state.switch([(good, 1.0)])
    with pytest.raises(AdapterError, match="token_refiner.blocks.1.mlp.fc2.weight.*magnitude"):
        state.switch([(good, 1.0), (read_lora(path), 1.0)])
    assert state.key == () and all(torch.equal(base[k], v) for k, v in dit.state_dict().items())


def test_turbo_presets_alpha_and_metadata_schedule(tmp_path):
    """The 768p lightx2v preset runs its file at alpha 128 (scale alpha / rank on every pair without its own alpha);
    a header schedule must be of the documented form, named in the error."""
    from h3render.checkpoint.errors import AdapterError
    from h3render.checkpoint.lora import with_alpha
    from h3render.checkpoint.lora_schedule import PRESETS, metadata_schedule

    lora = read_lora(write_synthetic_lora(tmp_path / "l.safetensors", CFG, "diffusers", seed=1, rank=4, adaln_rank=2))
    assert set(lora.scales) == {1.0}
    scaled = with_alpha(lora, PRESETS["lightx2v-fl2va-4step-v1.0-768p"].alpha)
    assert sorted(set(scaled.scales)) == [128 / 4, 128 / 2]
    kohya = read_lora(write_synthetic_lora(tmp_path / "k.safetensors", CFG, "kohya", seed=1, alpha=8.0))
    assert with_alpha(kohya, 128.0).scales == kohya.scales  # per-module alphas win
    s = PRESETS["lightx2v-fl2va-8step-v1.0"].schedule("x")
    assert s.forwards == 8 and s.video_shift == 12.0 and s.audio_shift == 3.0
    stated, alpha = metadata_schedule({"h3render_schedule": '{"positions": [1, 0.5, 0], "video_shift": 5, '
                                                            '"audio_shift": 3, "alpha": 16}'}, "f")
    assert stated.positions == (1.0, 0.5, 0.0) and alpha == 16.0 and stated.forwards == 2
    assert metadata_schedule({}, "f") is None
    with pytest.raises(AdapterError, match="f: metadata h3render_schedule="):
        metadata_schedule({"h3render_schedule": '{"forwards": 4}'}, "f")
