"""Synthetic FastH3 students in the published formats, for a (tiny) DiT config, so every loading path
(`h3render.checkpoint.adapter`, `.students`, `.contract`) runs without the released files:

* `write_synthetic_adapter`: one `fastvideo-lora-v2` adapter file (VSA gates optional);
* `write_synthetic_bundle`: the v1 LoRA bundle root (four variant folders + `adapter_manifest.json`);
* `FULL_STUDENTS`: the contracts (`fastvideo_inference.json`) of the full student checkpoints, v1 and V2, which
  `h3render.make_checkpoint.writer.write_synthetic_full_student` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from h3render.checkpoint.adapter import (ADAPTER_FORMAT, APPLICATION, TINY_BASE_MODEL, native_shapes,
                                         split_adapter_key)
from h3render.checkpoint.contract import CONTRACT_SCHEMA, V2_MODEL_ID, V2_REQUIRED, V2_VSA, VSA_BACKEND
from h3render.checkpoint.names import STACKS, diffusers_modules
from h3render.make_checkpoint.files import save_tensors
from h3render.models.dit_config import DiTConfig


def write_synthetic_adapter(path: str | Path, dit_config: DiTConfig, seed: int, rank: int = 4,
                            with_set_weight: bool = False, *, base_model: str = TINY_BASE_MODEL,
                            dmd_denoising_steps: Sequence[int] | None = None,
                            dtype: torch.dtype = torch.float32) -> Path:
    """Write a random adapter in the real ``fastvideo-lora-v2`` layout for a (tiny) DiT config.

    Contents, mirroring the released FastH3 adapter: rank-``rank`` factors for q/k/v/out/ff.net.0.proj/ff.net.2
    of every block and refiner block plus ``adaln_proj.linear`` of every block; ``.diff`` for every norm1/norm2,
    block 0's norm_q/norm_k, the refiner final norm and final norm; ``.diff_b`` for every block's adaLN bias;
    proj_in ``.diff`` + ``.diff_b`` (no factors: FastVideo never wraps proj_in, audio_proj_in, context_embedder,
    time_embedder, proj_out, audio_proj_out with a LoRA layer, so factors there are refused); a few other
    model-level ``.diff``/``.diff_b``; rank-``rank`` factors on ``norm_out.linear``; with
    ``with_set_weight``, a ``attn.to_gate_compress.set_weight`` [H·D, hidden] per block. Factors are scaled so
    deltas are ~2% of a unit weight. Metadata as FastVideo's finalize_adapter.py writes it, ``dmd_denoising_steps``
    added when given.

    Returns: the written path.
    """
    path = Path(path)
    generator = torch.Generator().manual_seed(seed)
    shapes = native_shapes(dit_config)
    tensors: dict[str, torch.Tensor] = {}

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    def lora(module: str, out: int, inp: int) -> None:
        tensors[f"{module}.lora_A.weight"] = rand(rank, inp, std=inp ** -0.5)  # [r, in]
        tensors[f"{module}.lora_B.weight"] = rand(out, rank, std=0.02 * rank ** -0.5)  # [out, r]

    def diff(native_param: str) -> None:
        (module,) = diffusers_modules(native_param.rsplit(".", 1)[0])
        suffix = ".diff_b" if native_param.endswith(".bias") else ".diff"
        tensors[module + suffix] = rand(*shapes[native_param], std=0.02)

    inner = dit_config.num_attention_heads * dit_config.attention_head_dim
    hidden = dit_config.hidden_size
    for native_prefix, adapter_prefix, count_field in STACKS:
        for i in range(getattr(dit_config, count_field)):
            block = f"{adapter_prefix}{i}"
            for name in ("attn.to_q", "attn.to_k", "attn.to_v"):
                lora(f"{block}.{name}", inner, hidden)
            lora(f"{block}.attn.to_out.0", hidden, inner)
            lora(f"{block}.ff.net.0.proj", 2 * dit_config.ffn_dim, hidden)
            lora(f"{block}.ff.net.2", hidden, dit_config.ffn_dim)
            diff(f"{native_prefix}{i}.norm1.weight")
            diff(f"{native_prefix}{i}.norm2.weight")
            if native_prefix == "blocks.":
                lora(f"{block}.adaln_proj.linear", *shapes[f"blocks.{i}.adaln_proj.linear.weight"])
                diff(f"blocks.{i}.adaln_proj.linear.bias")
                if with_set_weight:
                    tensors[f"{block}.attn.to_gate_compress.set_weight"] = rand(inner, hidden, std=hidden ** -0.5)
    diff("blocks.0.attn.q_norm.weight")
    diff("blocks.0.attn.k_norm.weight")
    for param in ("video_patch_proj.weight", "video_patch_proj.bias", "audio_patch_proj.bias",
                  "condition_proj.bias", "time_embedder.proj_in.bias", "time_embedder.proj_out.weight",
                  "token_refiner.final_norm.weight", "final_layer.norm.weight", "final_layer.adaln_proj.linear.bias",
                  "final_layer.video_out.bias", "final_layer.audio_out.weight"):
        diff(param)
    lora("norm_out.linear", *shapes["final_layer.adaln_proj.linear.weight"])

    roles = [split_adapter_key(key)[1] for key in tensors]
    metadata = {
        "format": ADAPTER_FORMAT,
        "base_model": base_model,
        "finetuned_model": f"h3render/synthetic-fasth3-seed{seed}",
        "base_revision": "",
        "finetuned_revision": "",
        "rank": str(rank),
        "application": APPLICATION,
        "low_rank_tensors": str(sum(role in ("lora_A", "lora_B") for role in roles)),
        "diff_tensors": str(sum(role in ("diff", "diff_b") for role in roles)),
        "set_weight_tensors": str(sum(role == "set_weight" for role in roles)),
        "dropped_unchanged": "0",
        "finalized_from": "h3render write_synthetic_adapter",
    }
    if dmd_denoising_steps is not None:
        metadata["dmd_denoising_steps"] = json.dumps(list(dmd_denoising_steps))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({key: value.contiguous() for key, value in tensors.items()}, str(path), metadata=metadata)
    return path


# v1 LoRA bundle (FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA): variant -> VSA gates or not.
BUNDLE_VARIANTS = {"vsa-datafree": True, "vsa-synthetic-step1300": True, "vsa-synthetic-step1900": True,
                   "dense-datafree": False}


def write_synthetic_bundle(root: str | Path, dit_config: DiTConfig, seed: int, *, manifest: dict | None = None,
                           base_model: str = TINY_BASE_MODEL) -> Path:
    """The v1 LoRA bundle root: `<variant>/adapter_model.safetensors` for the four published variants (the three
    VSA ones with gates, seeds `seed`, `seed + 1`, ...) and `adapter_manifest.json`.

    Args:
        manifest: the manifest to write; default `{"schema_version": "fasth3-lora-bundle-v1", "variants":
            {name: {"path": ..., "attention_backend": ..., ["vsa_sparsity": 0.9, "vsa_tile_size": 64]}}}` (the
            published file's fields beyond `schema_version` are unverified).

    Returns: the root.
    """
    root = Path(root)
    variants = {}
    for i, (name, vsa) in enumerate(BUNDLE_VARIANTS.items()):
        write_synthetic_adapter(root / name / "adapter_model.safetensors", dit_config, seed + i,
                                with_set_weight=vsa, base_model=base_model)
        variants[name] = {"path": f"{name}/adapter_model.safetensors",
                          "attention_backend": VSA_BACKEND if vsa else "FLASH_ATTN",
                          **({"vsa_sparsity": 0.9, "vsa_tile_size": 64} if vsa else {})}
    if manifest is None:
        manifest = {"schema_version": "fasth3-lora-bundle-v1", "base_model": base_model, "variants": variants}
    (root / "adapter_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return root


def _v1_contract(name: str, vsa: bool) -> dict:
    # Fields third-party validators expect of the v1 full checkpoints (vsa.md §2; the published file is unverified).
    contract = {"schema_version": CONTRACT_SCHEMA, "model_id": f"FastVideo/FastVideo-FastH3-4-step-Preview-v1-{name}",
                "transformer_forwards": 4, "num_inference_steps": 5, "dmd_denoising_steps": [999, 749, 500, 250],
                "guidance_scale": 1.0, "task": "t2av", "attention_backend": VSA_BACKEND if vsa else "FLASH_ATTN"}
    if vsa:
        contract.update(vsa_sparsity=0.9, vsa_tile_size=64, vsa_kernel="sm100a")
    return contract


# Full students: name -> contract (`fastvideo_inference.json`).
FULL_STUDENTS = {
    "v2": {"schema_version": CONTRACT_SCHEMA, "model_id": V2_MODEL_ID, "num_inference_steps": 9, **V2_REQUIRED,
           **V2_VSA},
    "v1-vsa-datafree": _v1_contract("VSA-DataFree", True),
    "v1-vsa-synthetic-step1300": _v1_contract("VSA-Synthetic-Step1300", True),
    "v1-vsa-synthetic-step1900": _v1_contract("VSA-Synthetic-Step1900", True),
    "v1-dense-datafree": _v1_contract("Dense-DataFree", False),
}
