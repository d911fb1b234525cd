"""Checkpoint layouts, strict streaming, the release registry and `make_checkpoint`.

Every layout is written by `make_checkpoint` from the same seed and must load to exactly the in-memory built-in
model; the official transformer shards must also load into diffusers 0.42.1 through diffusers' own converter and
give the same outputs as ours.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.load import load_components
from h3render.checkpoint.load import build_tiny
from h3render.checkpoint.names import dit_state_dict_to_diffusers
from h3render.checkpoint.releases import RELEASES
from h3render.make_checkpoint.writer import make_checkpoint
from h3render.packing import step_timesteps, t2va_layout
from tests._numerics import rel_err

TOL = 1e-5
PARTS = ("dit", "video_vae", "audio_vae", "text_encoder")
SHARD1 = "diffusion_pytorch_model-00001-of-00002.safetensors"
SHARD2 = "diffusion_pytorch_model-00002-of-00002.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "official": make_checkpoint(root / "official", "tiny", "official", seed=0),
        "diffusers": make_checkpoint(root / "diffusers", "tiny", "diffusers", seed=0),
        "single-file": make_checkpoint(root / "single.safetensors", "tiny", "single-file", seed=0),
    }


@pytest.fixture(scope="module")
def reference():
    return build_tiny(seed=0)


@pytest.fixture(scope="module")
def inputs():
    cfg = RELEASES["tiny"].dit
    layout = t2va_layout(text_len=5, height=64, width=96, frames=22)
    g = torch.Generator().manual_seed(7)
    video = torch.randn(layout.num_video_rows, cfg.video_patch_dim, generator=g)
    audio = torch.randn(layout.num_audio_rows, cfg.audio_in_channels, generator=g)
    text = torch.randn(layout.text_len, cfg.text_dim, generator=g)
    timesteps, index = step_timesteps(layout, 0.31, 0.62)
    return layout, video, audio, text, timesteps, index


def dit_forward(dit, inputs):
    layout, video, audio, text, timesteps, index = inputs
    with torch.no_grad():
        return dit(video, audio, text, layout, dit.modulation_tables(timesteps), index)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("layout", ["official", "diffusers"])
def test_layout_loads_same_model_as_builtin(ckpts, reference, inputs, layout):
    loaded = load_components(ckpts[layout])
    assert loaded.info.layout == layout
    for part in PARTS:
        assert_same_weights(getattr(loaded, part), getattr(reference, part))
    v, a = dit_forward(loaded.dit, inputs)
    rv, ra = dit_forward(reference.dit, inputs)
    assert torch.equal(v, rv) and torch.equal(a, ra)
    prompt = "A red fox runs through the snow"
    assert torch.equal(loaded.text_encoder.encode(prompt), reference.text_encoder.encode(prompt))


def test_single_file_stacked_qkv(ckpts, reference, tmp_path):
    path = ckpts["single-file"]
    loaded = load_components(path, parts=("dit",))
    assert loaded.info.layout == "single-file" and loaded.video_vae is None
    assert_same_weights(loaded.dit, reference.dit)
    # A ComfyUI file carries no config metadata and a `model.diffusion_model.` prefix: matched by its shapes.
    tensors = {"model.diffusion_model." + k: v for k, v in load_file(str(path)).items()}
    bare = tmp_path / "comfy.safetensors"
    save_file(tensors, str(bare))
    assert_same_weights(load_components(bare, parts=("dit",)).dit, reference.dit)
    with pytest.raises(CheckpointError, match="only the transformer"):
        load_components(bare)
    # As the transformer of a full checkpoint.
    mixed = load_components(ckpts["diffusers"], parts=("dit",), transformer_file=bare)
    assert_same_weights(mixed.dit, reference.dit)


def test_bf16_release_policy(ckpts):
    loaded = load_components(ckpts["official"], dtype=torch.bfloat16)
    builtin = build_tiny(seed=0, dtype=torch.bfloat16)
    for part in PARTS:
        assert_same_weights(getattr(loaded, part), getattr(builtin, part))
    dit = loaded.dit
    assert dit.video_patch_proj.weight.dtype == torch.float32 and dit.final_layer.audio_out.bias.dtype == torch.float32
    assert dit.condition_proj.weight.dtype == torch.bfloat16 and dit.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in loaded.audio_vae.parameters())
    assert loaded.text_encoder.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.text_encoder.rotary_emb.inv_freq.dtype == torch.float32  # as transformers keeps it
    # Storage on disk follows the release: bf16 blocks, fp32 islands.
    with safe_open(str(Path(ckpts["official"]) / "FL2VA/transformer" / SHARD1), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["video_patch_proj.weight"] == "F32" and dtypes["condition_proj.weight"] == "BF16"


def test_official_shards_through_diffusers_converter(ckpts, inputs):
    """diffusers' own converter (qkv_layout="interleaved") on our official shards loads strict into diffusers'
    transformer and gives our outputs; our diffusers layout loads with diffusers' `from_pretrained`."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    folder = Path(ckpts["official"]) / "FL2VA" / "transformer"
    native = {**load_file(str(folder / SHARD1)), **load_file(str(folder / SHARD2))}
    native = {k: v.float() for k, v in native.items()}
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["patch_size"] = tuple(config["patch_size"])
    ours_converted = dit_state_dict_to_diffusers(native, RELEASES["tiny"].dit)
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(native), config,
                                                                       qkv_layout="interleaved")
    assert ours_converted.keys() == converted.keys()
    assert all(torch.equal(ours_converted[k], converted[k]) for k in converted)
    ref = MiniMaxH3Transformer3DModel(**config).float().eval()
    missing, unexpected = ref.load_state_dict(converted, strict=True)
    assert not missing and not unexpected

    ours = load_components(ckpts["official"], parts=("dit",)).dit
    layout, video, audio, text, timesteps, index = inputs
    v, a = dit_forward(ours, inputs)
    with torch.no_grad():
        rv, ra = ref(hidden_states=video[None], audio_hidden_states=audio[None], encoder_hidden_states=text[None],
                     timestep=timesteps, timestep_indices=index, token_tags=layout.token_tags,
                     position_ids=layout.positions, video_indices=layout.video_index,
                     audio_indices=layout.audio_index, text_indices=layout.text_index, return_dict=False)
    ev, ea = rel_err(v, rv[0]), rel_err(a, ra[0])
    print(f"official shards via diffusers converter: video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert ev <= TOL and ea <= TOL

    # Our diffusers-layout shards hold exactly what diffusers' converter makes of the official ones, and load
    # strict into diffusers' model (`from_pretrained` itself needs accelerate for this model's fp32 islands).
    dif_folder = Path(ckpts["diffusers"]) / "transformer"
    on_disk = {**load_file(str(dif_folder / SHARD1)), **load_file(str(dif_folder / SHARD2))}
    assert on_disk.keys() == converted.keys()
    assert all(torch.equal(on_disk[k].float(), converted[k]) for k in converted)
    missing, unexpected = MiniMaxH3Transformer3DModel(**config).load_state_dict(on_disk, strict=True)
    assert not missing and not unexpected


def test_read_checkpoint_info(ckpts, tmp_path):
    official = read_checkpoint_info(ckpts["official"])
    diffusers = read_checkpoint_info(ckpts["diffusers"])
    builtin = read_checkpoint_info("tiny")
    for info in (official, diffusers, builtin):
        assert (info.video_shift, info.audio_shift) == (12.0, 3.0)
        assert (info.min_frames, info.max_frames) == (22, 362)
        assert info.release.dit == RELEASES["tiny"].dit and info.release.text_read_layer == 50
    assert official.config_hash == diffusers.config_hash == builtin.config_hash
    assert official.random_model == diffusers.random_model == builtin.random_model == "tiny"
    assert read_checkpoint_info(ckpts["single-file"]).random_model == "tiny"
    assert official.config_hash != read_checkpoint_info("small").config_hash
    assert official.limits().default_frames == 39 and official.release.default_canvas == (224, 128)

    # Shifts come from model_index.json (official) and the two scheduler configs (diffusers).
    off = shutil.copytree(Path(ckpts["official"]), tmp_path / "off")
    index_path = off / "FL2VA" / "model_index.json"
    index = json.loads(index_path.read_text())
    index["_minimax_h3"]["sigma_shift_scales"] = [10.0, 2.5]
    index["_minimax_h3"]["frame_limits"] = {"min": 39, "max": 124}
    index_path.write_text(json.dumps(index))
    info = read_checkpoint_info(off)
    assert (info.video_shift, info.audio_shift, info.min_frames, info.max_frames) == (10.0, 2.5, 39, 124)
    assert info.config_hash != official.config_hash
    del index["_minimax_h3"]["sigma_shift_scales"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model_index.json.*sigma_shift_scales"):
        read_checkpoint_info(off)

    dif = shutil.copytree(Path(ckpts["diffusers"]), tmp_path / "dif")
    (dif / "audio_scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": 4.5}))
    assert read_checkpoint_info(dif).audio_shift == 4.5
    (dif / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(CheckpointError, match="scheduler_config.json"):
        read_checkpoint_info(dif)
    with pytest.raises(CheckpointError, match="not a MiniMax-H3 checkpoint"):
        read_checkpoint_info(tmp_path)


def test_tensor_hook_sees_every_dit_tensor(ckpts, reference):
    class Hook:
        def __init__(self):
            self.names, self.finished = [], False

        def __call__(self, name, tensor):
            self.names.append(name)
            return tensor + 1.0 if name == "blocks.1.mlp.fc2.weight" else tensor

        def finish(self):
            self.finished = True

    hook = Hook()
    dit = load_components(ckpts["diffusers"], parts=("dit",), tensor_hook=hook).dit
    assert hook.finished and sorted(hook.names) == sorted(reference.dit.state_dict())
    delta = dit.blocks[1].mlp.fc2.weight - reference.dit.blocks[1].mlp.fc2.weight
    assert torch.allclose(delta, torch.ones_like(delta), atol=1e-2)  # bf16 storage rounding
    assert torch.equal(dit.blocks[0].mlp.fc2.weight, reference.dit.blocks[0].mlp.fc2.weight)


# -- strictness: every error names the file and the tensor -------------------------------------------------------


@pytest.fixture
def broken(ckpts, tmp_path):
    """A fresh copy of the official checkpoint and its transformer folder."""
    root = shutil.copytree(Path(ckpts["official"]), tmp_path / "broken")
    return root, root / "FL2VA" / "transformer"


def _rewrite_shard(folder: Path, shard: str, edit) -> None:
    """Apply `edit(tensors)` to one shard and keep the index in step with the shard's new names."""
    tensors = load_file(str(folder / shard))
    edit(tensors)
    save_file(tensors, str(folder / shard))
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update((k, shard) for k in tensors)
    (folder / INDEX).write_text(json.dumps(index))


def _load_dit(root):
    return load_components(root, parts=("dit",))


def test_missing_tensor(broken):
    root, folder = broken
    _rewrite_shard(folder, SHARD1, lambda t: t.pop("condition_proj.weight"))
    with pytest.raises(CheckpointError, match=rf"{INDEX}: missing tensor 'condition_proj.weight'"):
        _load_dit(root)


def test_unexpected_tensor(broken):
    root, folder = broken
    _rewrite_shard(folder, SHARD2, lambda t: t.update({"blocks.1.attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: unexpected tensor 'blocks.1.attn.extra.weight'"):
        _load_dit(root)


def test_wrong_shape(broken):
    root, folder = broken
    name = "blocks.1.mlp.fc1.weight"
    index = json.loads((folder / INDEX).read_text())
    shard = index["weight_map"][name]
    _rewrite_shard(folder, shard, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{name}' has shape \(255, 64\).*\(256, 64\)"):
        _load_dit(root)


def test_shard_in_index_but_absent(broken):
    root, folder = broken
    (folder / SHARD2).unlink()
    with pytest.raises(CheckpointError, match=rf"{SHARD2}: shard named in {INDEX} is absent.*tensor '"):
        _load_dit(root)


def test_tensor_in_index_but_absent_from_shard(broken):
    root, folder = broken
    tensors = load_file(str(folder / SHARD1))
    tensors.pop("video_patch_proj.weight")
    save_file(tensors, str(folder / SHARD1))
    with pytest.raises(CheckpointError, match=rf"{SHARD1}: tensor 'video_patch_proj.weight' is listed in the index"):
        _load_dit(root)


def test_corrupt_header(broken):
    root, folder = broken
    data = bytearray((folder / SHARD1).read_bytes())
    data[8:24] = b"\x00garbage-header!"
    (folder / SHARD1).write_bytes(bytes(data))
    first = json.loads((folder / INDEX).read_text())["weight_map"]
    first = next(k for k, v in first.items() if v == SHARD1)
    with pytest.raises(CheckpointError, match=rf"{SHARD1}: unreadable safetensors header \(holding tensor '{first}'\)"):
        _load_dit(root)


def test_diffusers_missing_projection(ckpts, tmp_path):
    root = shutil.copytree(Path(ckpts["diffusers"]), tmp_path / "dif")
    folder = root / "transformer"
    index = json.loads((folder / INDEX).read_text())
    shard = index["weight_map"]["transformer_blocks.0.attn.to_k.weight"]
    _rewrite_shard(folder, shard, lambda t: t.pop("transformer_blocks.0.attn.to_k.weight"))
    with pytest.raises(CheckpointError, match=rf"{shard}: missing tensor 'transformer_blocks.0.attn.to_k.weight'"):
        _load_dit(root)


def test_text_encoder_and_vae_strict(ckpts, tmp_path):
    root = shutil.copytree(Path(ckpts["official"]), tmp_path / "te")
    te = root / "FL2VA" / "text_encoder"
    weight_map = json.loads((te / "model.safetensors.index.json").read_text())["weight_map"]

    def reshape(name):
        shard = weight_map[name]
        tensors = load_file(str(te / shard))
        tensors[name] = tensors[name][..., :-1].clone()
        save_file(tensors, str(te / shard))
        return shard

    # Layers past the read layer (50 of 51), the final norm, the vision tower and the LM head are never read:
    # mis-shaping them changes nothing.
    read = RELEASES["tiny"].text_read_layer
    for name in (f"model.language_model.layers.{read}.mlp.up_proj.weight", "model.language_model.norm.weight",
                 "model.visual.blocks.0.attn.qkv.weight", "lm_head.weight"):
        reshape(name)
    encoder = load_components(root, parts=("text_encoder",)).text_encoder
    assert len(encoder.layers) == read == 50
    shard = reshape(f"model.language_model.layers.{read - 1}.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor 'layers.{read - 1}.mlp.up_proj.weight' has shape"):
        load_components(root, parts=("text_encoder",))

    vae = root / "FL2VA" / "video_vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(vae))
    dropped = next(iter(tensors))
    tensors.pop(dropped)
    save_file(tensors, str(vae))
    with pytest.raises(CheckpointError, match=rf"{vae}: missing tensor '{dropped}' for the video VAE"):
        load_components(root, parts=("video_vae",))


def test_make_checkpoint_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown config"):
        make_checkpoint(tmp_path / "a", "huge")
    with pytest.raises(ValueError, match="unknown layout"):
        make_checkpoint(tmp_path / "a", "tiny", "comfy")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        make_checkpoint(tmp_path / "b", "tiny")


def test_seed_changes_weights():
    a, b = build_tiny(seed=0, parts=("dit",)), build_tiny(seed=1, parts=("dit",))
    assert not torch.equal(a.dit.blocks[0].attn.qkv_proj.weight, b.dit.blocks[0].attn.qkv_proj.weight)
    assert torch.equal(a.dit.blocks[0].attn.qkv_proj.weight, build_tiny(seed=0, parts=("dit",)).dit.blocks[0].attn.qkv_proj.weight)


def test_written_tensor_files_get_the_umask_mode_not_0600(tmp_path):
    """safetensors creates its files 0600; a checkpoint (or adapter) made for a cluster must be readable by the
    users the umask lets read it."""
    import os

    from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter

    old = os.umask(0o027)
    try:
        root = make_checkpoint(tmp_path / "ckpt", "tiny", "official", seed=0)
        adapter = write_synthetic_adapter(tmp_path / "a.safetensors", RELEASES["tiny"].dit, seed=1)
    finally:
        os.umask(old)
    files = sorted(Path(root).rglob("*.safetensors")) + [Path(adapter)]
    assert len(files) > 4
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {oct(0o640)}
