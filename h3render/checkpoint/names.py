"""DiT tensor names: THE one table of native (official shards, our DiT) <-> diffusers
(`MiniMaxH3Transformer3DModel`, also the FastH3 adapter namespace) module names, and the two row orders that differ
between them: q/k/v interleaved per head (native `attn.qkv_proj`) vs separate `to_q/to_k/to_v`, and `mlp.fc1`
gate-first vs `ff.net.0.proj` value-first.

Source: the inverse of diffusers 0.42.1 `convert_minimax_h3_transformer_checkpoint_to_diffusers`
(`loaders/single_file_utils.py`, `qkv_layout="interleaved"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from h3render.checkpoint.errors import CheckpointError
from h3render.models.dit import DiT
from h3render.models.dit_config import DiTConfig

# How a diffusers module's rows enter its native parameter.
PLAIN = "plain"
QKV = "qkv"  # one of q/k/v, scattered into rows interleaved per head: [head0: q k v, head1: q k v, ...]
GATE_VALUE = "gate_value"  # diffusers ff.net.0.proj rows [value; gate] -> native mlp.fc1 rows [gate; value]

# Model-level modules, (native, diffusers).
TOP_MODULES = (
    ("video_patch_proj", "proj_in"),
    ("audio_patch_proj", "audio_proj_in"),
    ("condition_proj", "context_embedder"),
    ("time_embedder.proj_in", "time_embedder.linear_1"),
    ("time_embedder.proj_out", "time_embedder.linear_2"),
    ("token_refiner.final_norm", "token_refiner.final_norm"),
    ("final_layer.norm", "norm_out.norm"),
    ("final_layer.adaln_proj.linear", "norm_out.linear"),
    ("final_layer.video_out", "proj_out"),
    ("final_layer.audio_out", "audio_proj_out"),
    ("adaln_basis", "adaln_basis"),  # FastH3 Trim only (`DiTConfig.adaln_rank`)
)
# Block stacks, (native prefix, diffusers prefix, DiTConfig field holding the block count); the refiner comes first
# so that "blocks." does not swallow "token_refiner.blocks.".
STACKS = (
    ("token_refiner.blocks.", "token_refiner.refiner_blocks.", "num_refiner_layers"),
    ("blocks.", "transformer_blocks.", "num_layers"),
)
# Modules inside one block, (native, diffusers, row layout, q/k/v slot).
BLOCK_MODULES = (
    ("norm1", "norm1", PLAIN, None),
    ("norm2", "norm2", PLAIN, None),
    ("adaln_proj.linear", "adaln_proj.linear", PLAIN, None),
    ("attn.q_norm", "attn.norm_q", PLAIN, None),
    ("attn.k_norm", "attn.norm_k", PLAIN, None),
    ("attn.qkv_proj", "attn.to_q", QKV, 0),
    ("attn.qkv_proj", "attn.to_k", QKV, 1),
    ("attn.qkv_proj", "attn.to_v", QKV, 2),
    ("attn.out_proj", "attn.to_out.0", PLAIN, None),
    ("mlp.fc1", "ff.net.0.proj", GATE_VALUE, None),
    ("mlp.fc2", "ff.net.2", PLAIN, None),
)
# The video-sparse-attention compression gate of FastH3's sparse-attention students, weight [H·D, hidden], no
# bias: FastVideo's (and the adapters' / full checkpoints') `attn.to_gate_compress`, our `attn.gate_proj`. Absent
# from the base checkpoint and from a dense DiT (`DiT.enable_vsa` adds it), so a dense load meets it as an
# unexpected tensor.
VSA_GATE = "attn.to_gate_compress"
VSA_GATE_NATIVE = "attn.gate_proj"
GATE_ROWS = ((VSA_GATE_NATIVE, VSA_GATE, PLAIN, None),)

QKV_NATIVE = "attn.qkv_proj.weight"
QKV_DIFFUSERS = tuple(f"{diffusers}.weight" for _, diffusers, layout, _ in BLOCK_MODULES if layout == QKV)
FC1_NATIVE = "mlp.fc1.weight"


def native_gate_name(name: str) -> str:
    """A native-named DiT tensor with FastVideo's gate module name (`blocks.3.attn.to_gate_compress.weight`, as a
    full FastH3 export in native naming may carry) under ours (`blocks.3.attn.gate_proj.weight`); others unchanged."""
    if name.startswith("blocks.") and f".{VSA_GATE}." in name:
        return name.replace(f".{VSA_GATE}.", f".{VSA_GATE_NATIVE}.", 1)
    return name


# The RoPE buffer some exports carry; both DiTs recompute it from the config.
IGNORED_DIT_TENSORS = ("rope.inv_freq",)


@dataclass(frozen=True)
class Target:
    """Where one diffusers-named module lands in the native DiT.

    Attributes:
        native: the native module path (no `.weight` / `.bias`).
        layout: PLAIN, QKV or GATE_VALUE (how its rows enter the native parameter).
        slot: 0 / 1 / 2 for q / k / v, else None.
        block: (native stack prefix, block index), or None for a model-level module.
    """

    native: str
    layout: str
    slot: int | None
    block: tuple[str, int] | None


def _rows(module: str, side: int) -> list[tuple[str, str, Target]]:
    """Every table row whose native (`side` 0) or diffusers (`side` 1) module path is `module`, as
    (native path, diffusers path, target); the VSA gate of a block (not of a refiner block) included."""
    for pair in TOP_MODULES:
        if module == pair[side]:
            return [(*pair, Target(pair[0], PLAIN, None, None))]
    for stack in STACKS:
        in_block = BLOCK_MODULES + (GATE_ROWS if stack[0] == "blocks." else ())
        if module.startswith(stack[side]):
            index, _, suffix = module[len(stack[side]):].partition(".")
            if not index.isdigit():
                return []
            native_prefix, diffusers_prefix = f"{stack[0]}{index}.", f"{stack[1]}{index}."
            return [(native_prefix + row[0], diffusers_prefix + row[1],
                     Target(native_prefix + row[0], row[2], row[3], (stack[0], int(index))))
                    for row in in_block if suffix == row[side]]
    return []


def native_module(module: str) -> Target | None:
    """The native target of a diffusers module path (`transformer_blocks.3.attn.to_q`; the VSA gate
    `transformer_blocks.3.attn.to_gate_compress` -> `blocks.3.attn.gate_proj`), or None for a name outside the
    table."""
    rows = _rows(module, 1)
    return rows[0][2] if rows else None


def diffusers_modules(module: str) -> tuple[str, ...]:
    """The diffusers module path(s) of a native module: three (`to_q`, `to_k`, `to_v`) for a fused
    `attn.qkv_proj`, else one; () for a name outside the table."""
    return tuple(diffusers for _, diffusers, _ in _rows(module, 0))


def dit_names_to_diffusers(native: str) -> tuple[str, ...]:
    """Diffusers name(s) of one native DiT tensor: `(to_q, to_k, to_v)` weights for a fused `attn.qkv_proj.weight`,
    else one name.

    Raises:
        CheckpointError: a name outside the DiT's native naming.
    """
    module, _, param = native.rpartition(".")
    names = diffusers_modules(module)
    if not names:
        raise CheckpointError(f"no diffusers name for native DiT tensor {native!r}")
    return tuple(f"{name}.{param}" for name in names)


def dit_name_from_diffusers(name: str) -> tuple[str, int | None]:
    """Native name of one diffusers DiT tensor, and its slot in the fused qkv (0 q, 1 k, 2 v) or None.

    Raises:
        CheckpointError: a name outside diffusers' `MiniMaxH3Transformer3DModel` naming.
    """
    module, _, param = name.rpartition(".")
    target = native_module(module)
    if target is None:
        raise CheckpointError(f"no native name for diffusers DiT tensor {name!r}")
    return f"{target.native}.{param}", target.slot


def dit_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native tensor names and shapes of a DiT config, in module order (the DiT is built on the meta device)."""
    with torch.device("meta"):
        model = DiT(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------------------------
# Row orders.


def qkv_slot(qkv: Tensor, slot: int, heads: int, head_dim: int) -> Tensor:
    """View of the q (0), k (1) or v (2) rows of a native per-head interleaved qkv.

    Args:
        qkv: [3 * H * D, in], rows `[head0: q k v, head1: q k v, ...]` (contiguous).
    Returns:
        [H, D, in], a view: writing into it writes `qkv`.
    """
    return qkv.view(heads, 3, head_dim, -1)[:, slot]  # [H, 3, D, in] -> [H, D, in]


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, head_dim: int) -> Tensor:
    """Fuse per-projection weights into the native per-head interleaved qkv.

    Args:
        q, k, v: [heads * head_dim, in] each.
    Returns:
        [3 * heads * head_dim, in], rows `[head0: q k v, head1: q k v, ...]`.
    """
    per_head = torch.stack([w.reshape(heads, head_dim, -1) for w in (q, k, v)], dim=1)  # [H, 3, D, in]
    return per_head.reshape(3 * heads * head_dim, -1)


def deinterleave_qkv(qkv: Tensor, heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `interleave_qkv`: [3 * H * D, in] per-head interleaved -> three [H * D, in]."""
    qkv = qkv.contiguous()
    q, k, v = (qkv_slot(qkv, slot, heads, head_dim).reshape(heads * head_dim, -1) for slot in range(3))
    return q, k, v


def swap_halves(weight: Tensor) -> Tensor:
    """Native fc1 `[gate; value]` <-> diffusers `[value; gate]` (the map is its own inverse). [2F, ...] -> [2F, ...]."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def dit_state_dict_to_diffusers(state_dict: Mapping[str, Tensor], config: DiTConfig) -> dict[str, Tensor]:
    """A native DiT state dict (interleaved qkv, gate-first fc1) under diffusers names and row orders."""
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        if name in IGNORED_DIT_TENSORS:
            continue
        targets = dit_names_to_diffusers(name)
        if name.endswith(QKV_NATIVE):
            parts = deinterleave_qkv(tensor, config.num_attention_heads, config.attention_head_dim)
            out.update((t, p.contiguous()) for t, p in zip(targets, parts))
        elif name.endswith(FC1_NATIVE):
            out[targets[0]] = swap_halves(tensor)
        else:
            out[targets[0]] = tensor
    return out
