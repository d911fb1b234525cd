"""Write a random MiniMax-H3 checkpoint ("tiny" or "small") in a real on-disk layout (`make_checkpoint`), or a full
FastH3 student checkpoint built on one (`write_synthetic_full_student`).

The weights are the built-in random model's (`h3render.checkpoint.builtin.random_entries`; `checkpoint.load.
build_random` with the same seed gives the same values), stored with the release's dtypes: DiT bf16 except its fp32
islands (patch projections, time embedder, output heads), text encoder bf16, both VAEs fp32. Layouts:

* "official": `OUT/FL2VA/` with `model_index.json` (`_minimax_h3.sigma_shift_scales`, text-encoder read layer,
  frame limits), `transformer/` (>= 2 shards + `diffusion_pytorch_model.safetensors.index.json`, native names),
  `text_encoder/` (the whole Qwen3-VL incl. vision tower and LM head, 2 shards + index), `tokenizer/`, `processor/`,
  `video_vae/`, `audio_vae/`; and `OUT/Ref2VA/transformer/` (ref2va's DiT, native names, same sharding).
* "diffusers": `OUT/model_index.json` (what h3render reads), `OUT/modular_model_index.json` (what diffusers'
  `ModularPipeline.from_pretrained` reads: the pipeline and blocks classes, each component's folder, the canvas
  rule), `transformer/` and `transformer_ref/` (ref2va's DiT; diffusers names and row orders), `vae/`, `audio_vae/`, `scheduler/`, `audio_scheduler/`,
  `text_encoder/`, `tokenizer/`, `processor/` (image and video processor configs). diffusers 0.42.1 loads it with
  `load_components` (accelerate installed), and its prompt encode (`get_qwen3vl_prompt_embeds` at its hard-coded
  `hidden_states[50]`) gives h3render's embeddings: the tiny conditioner has 51 layers read at 50, as released
  (tests/unit/test_make_checkpoint_diffusers.py). Its t2va text-encode *block* also builds `processor/` as a
  `Qwen3VLProcessor`, which needs torchvision (not on the project's CPU machines; the test stands in for the one
  processor method a text-only prompt uses).
* "single-file": `OUT` is one `.safetensors` file holding the DiT, native names with q/k/v stacked `[q; k; v]`
  (ComfyUI style), the DiT config in its `config` metadata.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from h3render.checkpoint.builtin import random_entries, tiny_vl_tokenizer
from h3render.checkpoint.contract import CONTRACT_FILE, VSA_BACKEND
from h3render.checkpoint.names import QKV_NATIVE, VSA_GATE, deinterleave_qkv, dit_state_dict_to_diffusers
from h3render.checkpoint.releases import BUILTIN, RELEASES, Release, dit_fields
from h3render.models.dit_config import DiTConfig
from h3render.make_checkpoint.files import save_tensors
from h3render.make_checkpoint.targets import check_extras, check_output
from h3render.make_checkpoint.synthetic_adapter import FULL_STUDENTS, write_synthetic_adapter, write_synthetic_bundle

LAYOUTS = ("official", "diffusers", "single-file")
# A synthetic adapter's kind: dense (no gates) or VSA (a gate per DiT block), the two kinds of the published v1 LoRAs.
ADAPTER_KINDS = ("dense", "vsa")
DIFFUSERS_VERSION = "0.42.1"
# Tensor files of a diffusers model folder and of a transformers model folder.
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"
TRANSFORMERS_WEIGHTS = "model"
# diffusers' modular pipeline for MiniMax-H3 and its blocks (`modular_model_index.json`).
MODULAR_PIPELINE, MODULAR_BLOCKS = "MiniMaxH3ModularPipeline", "MiniMaxH3Blocks"


def make_checkpoint(
    out_dir: str | Path,
    config: str = "tiny",
    layout: str = "official",
    seed: int = 0,
    *,
    shards: int = 2,
    adapter: str | Path | None = None,
    adapter_kind: str = "dense",
    bundle: str | Path | None = None,
) -> Path:
    """Write the random `config` model as a checkpoint in `layout` under `out_dir`.

    Args:
        out_dir: a new (or empty) folder; for "single-file" the `.safetensors` path to write.
        config: "tiny" | "small".
        layout: "official" | "diffusers" | "single-file".
        seed: weights seed (as `build_random`).
        shards: transformer shard count (>= 2 exercises the index path).
        adapter: also write a synthetic FastH3 adapter (`fastvideo-lora-v2`) for this DiT at this path.
        adapter_kind: "dense" (no gates) or "vsa" (the `attn.to_gate_compress.set_weight` gate of every DiT block,
            as the VSA students carry: 50 released, 2 tiny).
        bundle: also write the v1 LoRA bundle root (`write_synthetic_bundle`: four variant folders and
            `adapter_manifest.json`) for this DiT there.

    Returns:
        The path to pass to `load_components` (the repository root for "official").

    Raises:
        ValueError: unknown config / layout, `shards < 1`, or as `check_output` (`out_dir` exists and is not empty,
            a "single-file" path not ending in `.safetensors`).
    """
    if config not in BUILTIN:
        raise ValueError(f"make-checkpoint: unknown config {config!r} (choose from {', '.join(BUILTIN)})")
    if layout not in LAYOUTS:
        raise ValueError(f"make-checkpoint: unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})")
    if shards < 1:
        raise ValueError(f"make-checkpoint: shards must be >= 1, got {shards}")
    if adapter_kind not in ADAPTER_KINDS:
        raise ValueError(f"make-checkpoint: unknown adapter kind {adapter_kind!r} (choose from "
                         f"{', '.join(ADAPTER_KINDS)})")
    out = check_output(out_dir, layout)
    check_extras(adapter, bundle, out_dir)
    release = RELEASES[config]

    if layout == "single-file":
        _write_single_file(out, release, seed)
    else:
        part = out / "FL2VA" if layout == "official" else out
        _write_partition(part, release, seed, layout, shards)
        # ref2va's DiT: same architecture, its own weights (official `Ref2VA/transformer/`, diffusers
        # `transformer_ref/`); a single file holds one transformer and has none.
        _write_transformer(out / "Ref2VA" / "transformer" if layout == "official" else out / "transformer_ref",
                           _materialize("dit_ref", release, seed), release, layout, shards)
    if adapter is not None:
        write_synthetic_adapter(adapter, release.dit, seed=seed, with_set_weight=adapter_kind == "vsa")
    if bundle is not None:
        write_synthetic_bundle(bundle, release.dit, seed=seed)
    return out


def _materialize(component: str, release: Release, seed: int) -> dict[str, Tensor]:
    return {entry.name: entry.load() for entry in random_entries(component, release, seed)}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _diffusers_config(class_name: str, config: Any) -> dict[str, Any]:
    fields = dit_fields(config) if isinstance(config, DiTConfig) else dataclasses.asdict(config)
    return {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION,
            **fields}  # json writes the config's tuples as lists


def _save_sharded(folder: Path, tensors: Mapping[str, Tensor], stem: str, shards: int) -> None:
    """`stem.safetensors`, or `stem-0000i-of-0000n.safetensors` + `stem.safetensors.index.json` (HF index format)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shards == 1:
        save_tensors(tensors, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        chunk = names[i * per_shard:(i + 1) * per_shard]
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_tensors({n: tensors[n] for n in chunk}, str(folder / file), metadata={"format": "pt"})
        weight_map.update((n, file) for n in chunk)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder / f"{stem}.safetensors.index.json", {"metadata": {"total_size": total},
                                                             "weight_map": weight_map})


def _write_transformer(folder: Path, dit: dict[str, Tensor], release: Release, layout: str, shards: int) -> None:
    """One DiT partition: `config.json` and the sharded weights, native names (official) or diffusers names."""
    if layout != "official":
        dit = dit_state_dict_to_diffusers(dit, release.dit)
    _write_json(folder / "config.json", _diffusers_config("MiniMaxH3Transformer3DModel", release.dit))
    _save_sharded(folder, dit, DIFFUSERS_WEIGHTS, shards)


def _write_partition(part: Path, release: Release, seed: int, layout: str, shards: int) -> None:
    from transformers import Qwen3VLConfig


    official = layout == "official"
    meta: dict[str, Any] = {
        "text_encoder_layer": release.text_read_layer,
        "frame_limits": {"min": release.min_frames, "max": release.max_frames},
        "h3render_random": {"config": release.name, "seed": seed},
    }
    video_dir = "video_vae" if official else "vae"
    index: dict[str, Any] = {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": DIFFUSERS_VERSION,
        "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
        video_dir: ["diffusers", "AutoencoderKLMiniMaxH3"],
        "audio_vae": ["diffusers", "AutoencoderKLMiniMaxH3Audio"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
    }
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    if official:
        meta = {"sigma_shift_scales": {"video": release.video_shift, "audio": release.audio_shift},
                "tasks": ["t2va", "fl2va"], **meta}
    else:
        index["scheduler"] = ["diffusers", "MiniMaxH3Scheduler"]
        index["audio_scheduler"] = ["diffusers", "MiniMaxH3Scheduler"]
        index["transformer_ref"] = ["diffusers", "MiniMaxH3Transformer3DModel"]
    index["_minimax_h3"] = meta
    _write_json(part / "model_index.json", index)
    if not official:
        _write_json(part / "modular_model_index.json", _modular_index(index, release))

    _write_transformer(part / "transformer", _materialize("dit", release, seed), release, layout, shards)

    # VAEs (diffusers names in both layouts).
    _write_json(part / video_dir / "config.json", _diffusers_config("AutoencoderKLMiniMaxH3", release.video_vae))
    _save_sharded(part / video_dir, _materialize("video_vae", release, seed), DIFFUSERS_WEIGHTS, 1)
    _write_json(part / "audio_vae" / "config.json",
                _diffusers_config("AutoencoderKLMiniMaxH3Audio", release.audio_vae))
    _save_sharded(part / "audio_vae", _materialize("audio_vae", release, seed), DIFFUSERS_WEIGHTS, 1)

    # Text encoder: the whole Qwen3-VL, as released (the loader reads only layers < read layer).
    text_config = Qwen3VLConfig.from_dict(dict(release.text_encoder))
    text_config.architectures = ["Qwen3VLForConditionalGeneration"]
    text_config.dtype = "bfloat16"
    text_config.save_pretrained(str(part / "text_encoder"))
    _save_sharded(part / "text_encoder", _materialize("text_encoder", release, seed), TRANSFORMERS_WEIGHTS, 2)
    tokenizer = tiny_vl_tokenizer(text_config.text_config.vocab_size)
    tokenizer.save_pretrained(str(part / "tokenizer"))

    # Vision preprocessing for fl2va keyframes (t2va never reads it), at the vision tower's patch size.
    image_processor = {**release.image_processor, "patch_size": text_config.vision_config.patch_size}
    if official:
        # The official repository's file: `processor/preprocessor_config.json`.
        _write_json(part / "processor" / "preprocessor_config.json", image_processor)
    else:
        # diffusers loads `processor/` with `Qwen3VLProcessor.from_pretrained`; transformers 5.x writes the
        # sub-processors' configs into one `processor_config.json` and the tokenizer files beside it.
        # Qwen3VLProcessor.from_pretrained also needs a video processor: Qwen3-VL's defaults at the tower's patch
        # size (h3render never reads it: t2va and fl2va take no video).
        video_processor = {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
                           "patch_size": text_config.vision_config.patch_size, "temporal_patch_size": 2,
                           "merge_size": 2}
        _write_json(part / "processor" / "processor_config.json", {
            "processor_class": "Qwen3VLProcessor", "image_processor": image_processor,
            "video_processor": video_processor})
        tokenizer.save_pretrained(str(part / "processor"))
        for folder, shift in (("scheduler", release.video_shift), ("audio_scheduler", release.audio_shift)):
            _write_json(part / folder / "scheduler_config.json", {
                "_class_name": "MiniMaxH3Scheduler", "_diffusers_version": DIFFUSERS_VERSION, "shift": shift})


def _modular_index(index: Mapping[str, Any], release: Release) -> dict[str, Any]:
    """`modular_model_index.json`: diffusers resolves its MiniMax-H3 pipeline and blocks only from this file (from a
    plain `model_index.json` it builds a generic `ModularPipeline` without blocks). Each component is
    `[library, class, loading spec]` with no repository: diffusers loads a component whose files are present from
    the folder itself, wherever it was moved. The canvas rule is the release's own (tiny: short edge 128)."""
    modular: dict[str, Any] = {"_class_name": MODULAR_PIPELINE, "_diffusers_version": DIFFUSERS_VERSION,
                               "_blocks_class_name": MODULAR_BLOCKS}
    for name, value in index.items():
        if isinstance(value, list) and len(value) == 2:
            library, class_name = value
            modular[name] = [library, class_name, {"pretrained_model_name_or_path": None, "subfolder": name,
                                                   "variant": None, "revision": None,
                                                   "type_hint": [library, class_name]}]
    modular.update(canvas_short_edge=release.canvas_short_edge, canvas_max_pixels=release.canvas_max_pixels)
    return modular


def _write_single_file(path: Path, release: Release, seed: int) -> None:
    """ComfyUI-style: native names, q/k/v stacked `[q; k; v]` (the reference model's post-load order)."""
    cfg = release.dit
    tensors = {}
    for name, tensor in _materialize("dit", release, seed).items():
        if name.endswith(QKV_NATIVE):
            tensor = torch.cat(deinterleave_qkv(tensor, cfg.num_attention_heads, cfg.attention_head_dim), dim=0)
        tensors[name] = tensor.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "config": json.dumps(dataclasses.asdict(cfg)),
                "h3render_random": release.name}
    save_tensors(tensors, str(path), metadata=metadata)


def write_synthetic_full_student(out: str | Path, student: str = "v2", config: str = "tiny",
                                 layout: str = "diffusers", seed: int = 0, *, contract: dict | None = None,
                                 gate_blocks: Sequence[int] | None = None, zero_gates: Sequence[int] = ()) -> Path:
    """A full FastH3 student checkpoint: `make_checkpoint(out, config, layout, seed)` (2 transformer shards), a
    third shard with the VSA gates (bf16 [H·D, hidden] per block, named as FastVideo's export:
    `transformer_blocks.{i}.attn.to_gate_compress.weight` in the diffusers layout, `blocks.{i}.attn.
    to_gate_compress.weight` in the official one) added to the index, and `fastvideo_inference.json` at the root.

    Args:
        student: a `FULL_STUDENTS` name (the dense one gets no gates).
        contract: written in place of the student's own.
        gate_blocks: blocks that get a gate (default all, for a VSA student); zero_gates: blocks whose gate is 0.

    Returns: the checkpoint root.

    Raises:
        ValueError: an unknown student, the "single-file" layout (a student's contract sits beside its transformer
            folder), or as `make_checkpoint`.
    """
    if contract is None and student not in FULL_STUDENTS:
        raise ValueError(f"make-checkpoint: unknown student {student!r} (choose from {', '.join(FULL_STUDENTS)})")
    if layout not in ("official", "diffusers"):
        raise ValueError(f"make-checkpoint: a full FastH3 student is a checkpoint folder (official or diffusers "
                         f"layout), not {layout!r}")
    out = make_checkpoint(out, config, layout, seed)
    contract = dict(FULL_STUDENTS[student] if contract is None else contract)
    dit = RELEASES[config].dit
    vsa = contract.get("attention_backend") == VSA_BACKEND
    blocks = range(dit.num_layers) if gate_blocks is None and vsa else (gate_blocks or ())
    prefix = "transformer_blocks" if layout == "diffusers" else "blocks"
    inner, hidden = dit.num_attention_heads * dit.attention_head_dim, dit.hidden_size
    generator = torch.Generator().manual_seed(seed + 7)
    gates = {}
    for i in blocks:
        gate = torch.randn(inner, hidden, generator=generator) * hidden ** -0.5
        gates[f"{prefix}.{i}.{VSA_GATE}.weight"] = (gate * (i not in zero_gates)).to(torch.bfloat16)
    transformer = out / ("FL2VA" if layout == "official" else "") / "transformer"
    if gates:
        shard = "diffusion_pytorch_model-gates.safetensors"
        save_tensors(gates, str(transformer / shard), metadata={"format": "pt"})
        index_path = transformer / "diffusion_pytorch_model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update(dict.fromkeys(gates, shard))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    (out / CONTRACT_FILE).write_text(json.dumps(contract, indent=2) + "\n")
    return out
