"""Synthetic per-job LoRA files in every layout `h3render.checkpoint.lora` reads (issue #25), for a (tiny) DiT
config, so the reader and the application run without the published files. The key spellings are the ones the
module docstring of `h3render.checkpoint.lora` tabulates (diffusers 0.42.1's MiniMax-H3 LoRA loader is their
reference); the values are random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from h3render.checkpoint.adapter import ADAPTER_FORMAT, TINY_BASE_MODEL
from h3render.checkpoint.lora import FORMATS
from h3render.checkpoint.names import STACKS, diffusers_modules
from h3render.make_checkpoint.files import save_tensors
from h3render.models.dit_config import DiTConfig

# Block linears a synthetic LoRA changes (native), and its model-level one: the final AdaLN projection, which
# every format (FastVideo's included) may target.
_BLOCK_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
_TOP_TARGETS = ("final_layer.adaln_proj.linear",)


def _targets(config: DiTConfig, adaln: bool = True) -> list[str]:
    """Native module paths: every block's and refiner block's linears, each block's AdaLN projection and the final
    one (``adaln``)."""
    out = []
    for prefix, _, count_field in STACKS:
        for i in range(getattr(config, count_field)):
            out += [f"{prefix}{i}.{m}" for m in _BLOCK_TARGETS]
            if prefix == "blocks." and adaln:
                out.append(f"{prefix}{i}.adaln_proj.linear")
    return out + (list(_TOP_TARGETS) if adaln else [])


def write_synthetic_lora(path: str | Path, config: DiTConfig, fmt: str, seed: int, rank: int = 4,
                         adaln_rank: int = 2, *, alpha: float | None = None, header_alpha: float | None = None,
                         metadata: Mapping[str, str] | None = None, std: float = 0.05, adaln: bool = True,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write a random LoRA in layout ``fmt`` (`checkpoint.lora.FORMATS`) for ``config``.

    Every block and refiner block gets pairs on q/k/v (one fused ``qkv_proj`` pair in the native layouts, three
    ``to_q/to_k/to_v`` pairs in the diffusers ones), out, fc1, fc2; every block's AdaLN projection and the final
    one get rank-``adaln_rank`` pairs (published files mix ranks so). ``alpha``: a per-module alpha scalar on
    every pair (kohya, musubi write one always: ``alpha`` defaults to the rank there); ``header_alpha``: the
    header ``alpha`` entry lightx2v's 8-step file carries. Factor entries ~ N(0, std²)·fan-in⁻½, stored in
    ``dtype``. ``adaln=False``: no AdaLN pairs (a DiT that dropped its AdaLN weights, as the benchmark's).

    Returns: the written path.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; one of {', '.join(FORMATS)}")
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    from h3render.checkpoint.lora import _linear_shapes

    shapes = _linear_shapes(config)
    native_names = fmt in ("ai-toolkit", "comfy", "diffsynth", "kohya", "musubi")
    if fmt in ("kohya", "musubi") and alpha is None:
        alpha = float(rank)
    tensors: dict[str, torch.Tensor] = {}

    def key(module: str, role: str) -> str:
        if fmt == "diffusers":
            return f"transformer.{module}.{role}.weight"
        if fmt == "peft":
            return f"base_model.model.{module}.{role}.weight"
        if fmt == "fastvideo" or fmt == "comfy":
            return f"{module}.{role}.weight"
        if fmt == "ai-toolkit":
            return f"diffusion_model.{module}.{role}.weight"
        if fmt == "diffsynth":
            return f"{module}.{role}.default.weight"
        flat = f"lora_unet_{module.replace('.', '_')}" if fmt == "musubi" else module
        return f"{flat}.{'lora_down' if role == 'lora_A' else 'lora_up'}.weight"

    def pair(module: str, out: int, inp: int, r: int) -> None:
        tensors[key(module, "lora_A")] = (torch.randn(r, inp, generator=g) * std * inp ** -0.5).to(dtype)
        tensors[key(module, "lora_B")] = (torch.randn(out, r, generator=g) * std).to(dtype)
        if alpha is not None:
            stem = key(module, "lora_A").rsplit(".", 2)[0]
            if fmt == "diffsynth":
                stem = stem.rsplit(".", 1)[0]
            tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))

    for native in _targets(config, adaln):
        out, inp = shapes[native + ".weight"]
        r = adaln_rank if "adaln_proj" in native else rank
        if native_names:
            pair(native, out, inp, r)
        elif native.endswith("attn.qkv_proj"):
            for module in diffusers_modules(native):  # to_q, to_k, to_v
                pair(module, out // 3, inp, r)
        else:
            (module,) = diffusers_modules(native)
            pair(module, out, inp, r)
    meta = dict(metadata or {})
    if fmt == "fastvideo":
        meta.setdefault("format", ADAPTER_FORMAT)
        meta.setdefault("base_model", TINY_BASE_MODEL)
    if header_alpha is not None:
        meta["alpha"] = repr(float(header_alpha))
    save_tensors(tensors, path, metadata=meta or None)
    return path
