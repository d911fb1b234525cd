"""A synthetic FastH3 Trim checkpoint (issue #25 item 4) in its published layout, from the tiny model: FastVideo's
FastH3 Trim keeps 42 of the 50 blocks (renumbered 0..41) and replaces each block's AdaLN projection by a shared
rank-16 basis of the time embedding plus a small projection per block (fasth3-rtx blog, "Compressing the timestep
conditioning"; FastVideo 0.2.1 `MiniMaxH3Transformer3DModel` with `adaln_rank`):

* `transformer/config.json`: `num_layers` (kept blocks), `adaln_rank` r;
* `adaln_basis.weight` [r, time_embed_dim], no bias; `transformer_blocks.{i}.adaln_proj.linear.weight`
  [18·hidden, r] (+ bias) and `norm_out.linear.weight` [2·hidden, r] (+ bias), all float16 as FastVideo stores them;
* the V2 contract (8 forwards, VSA 0.8) and a VSA gate per kept block, as the V2 full student.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from h3render.make_checkpoint.files import save_tensors
from h3render.make_checkpoint.writer import write_synthetic_full_student

_BLOCK = "transformer_blocks."


def write_synthetic_trim(out: str | Path, seed: int = 0, *, keep: Sequence[int] = (1,), rank: int = 4) -> Path:
    """The tiny V2 full student (`write_synthetic_full_student`, diffusers layout) trimmed to the blocks ``keep``
    (renumbered in order) with a rank-``rank`` factorized AdaLN. Returns the checkpoint root."""
    root = write_synthetic_full_student(out, "v2", "tiny", "diffusers", seed)
    folder = root / "transformer"
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(folder / shard)))
        (folder / shard).unlink()
    config = json.loads((folder / "config.json").read_text())
    hidden, temb_dim = config["hidden_size"], config["time_embed_dim"]
    renumber = {old: new for new, old in enumerate(keep)}
    trimmed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(_BLOCK):
            index_text, _, rest = name[len(_BLOCK):].partition(".")
            if int(index_text) not in renumber:
                continue
            name = f"{_BLOCK}{renumber[int(index_text)]}.{rest}"
        trimmed[name] = t
    g = torch.Generator().manual_seed(seed + 31)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.float16)

    trimmed["adaln_basis.weight"] = rand(rank, temb_dim, std=temb_dim ** -0.5)
    for i in range(len(keep)):
        trimmed[f"{_BLOCK}{i}.adaln_proj.linear.weight"] = rand(18 * hidden, rank, std=0.1 * rank ** -0.5)
        trimmed[f"{_BLOCK}{i}.adaln_proj.linear.bias"] = rand(18 * hidden, std=0.02)
    trimmed["norm_out.linear.weight"] = rand(2 * hidden, rank, std=0.1 * rank ** -0.5)
    trimmed["norm_out.linear.bias"] = rand(2 * hidden, std=0.02)
    shard = "diffusion_pytorch_model.safetensors"
    save_tensors(trimmed, str(folder / shard), metadata={"format": "pt"})
    index["weight_map"] = dict.fromkeys(sorted(trimmed), shard)
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config.update(num_layers=len(keep), adaln_rank=rank)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root
