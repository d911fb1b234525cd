"""DiT tensor names: native (official shards, our DiT) <-> diffusers (`MiniMaxH3Transformer3DModel`), and the
per-head q/k/v interleave and gate/value order that differ between them.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from h3render.errors import CheckpointError
from h3render.models.dit import DiTConfig

# ---------------------------------------------------------------------------------------------------------------------
# DiT names: native (official shards, our DiT) <-> diffusers (`MiniMaxH3Transformer3DModel`).

# Whole-prefix renames outside the block stacks, (native, diffusers).
_DIT_TOP = (
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("condition_proj.", "context_embedder."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("token_refiner.final_norm.", "token_refiner.final_norm."),
    ("final_layer.norm.", "norm_out.norm."),
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
)
# Block stacks, (native, diffusers); refiner first so "blocks." does not swallow "token_refiner.blocks.".
_DIT_STACKS = (("token_refiner.blocks.", "token_refiner.refiner_blocks."), ("blocks.", "transformer_blocks."))
# Inside one block, (native, diffusers). The fused qkv is handled separately.
_DIT_IN_BLOCK = (
    ("norm1.", "norm1."),
    ("norm2.", "norm2."),
    ("adaln_proj.linear.", "adaln_proj.linear."),
    ("attn.q_norm.", "attn.norm_q."),
    ("attn.k_norm.", "attn.norm_k."),
    ("attn.out_proj.", "attn.to_out.0."),
    ("mlp.fc1.", "ff.net.0.proj."),
    ("mlp.fc2.", "ff.net.2."),
)
QKV_NATIVE = "attn.qkv_proj.weight"
QKV_DIFFUSERS = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")
FC1_NATIVE = "mlp.fc1.weight"
# The RoPE buffer some exports carry; both DiTs recompute it from the config.
IGNORED_DIT_TENSORS = ("rope.inv_freq",)


def _rename(name: str, pairs: Iterable[tuple[str, str]], to_diffusers: bool) -> str | None:
    for native, diffusers in pairs:
        src, dst = (native, diffusers) if to_diffusers else (diffusers, native)
        if name.startswith(src):
            return dst + name[len(src):]
    return None


def _split_stack(name: str, to_diffusers: bool) -> tuple[str, str, str] | None:
    """`(other-side stack prefix + index + ".", rest)` split of a block tensor name, or None."""
    for native, diffusers in _DIT_STACKS:
        src, dst = (native, diffusers) if to_diffusers else (diffusers, native)
        if name.startswith(src):
            index, _, rest = name[len(src):].partition(".")
            if index.isdigit():
                return dst, index, rest
    return None


def dit_names_to_diffusers(native: str) -> tuple[str, ...]:
    """Diffusers name(s) of one native DiT tensor: `(to_q, to_k, to_v)` names for a fused `attn.qkv_proj.weight`,
    else one name.

    Raises:
        CheckpointError: a name outside the DiT's native naming.
    """
    stack = _split_stack(native, to_diffusers=True)
    if stack is not None:
        prefix, index, rest = stack
        if rest == QKV_NATIVE:
            return tuple(f"{prefix}{index}.{part}" for part in QKV_DIFFUSERS)
        inner = _rename(rest, _DIT_IN_BLOCK, to_diffusers=True)
        if inner is not None:
            return (f"{prefix}{index}.{inner}",)
    else:
        top = _rename(native, _DIT_TOP, to_diffusers=True)
        if top is not None:
            return (top,)
    raise CheckpointError(f"no diffusers name for native DiT tensor {native!r}")


def dit_name_from_diffusers(name: str) -> tuple[str, int | None]:
    """Native name of one diffusers DiT tensor, and its slot in the fused qkv (0 q, 1 k, 2 v) or None.

    Raises:
        CheckpointError: a name outside diffusers' `MiniMaxH3Transformer3DModel` naming.
    """
    stack = _split_stack(name, to_diffusers=False)
    if stack is not None:
        prefix, index, rest = stack
        if rest in QKV_DIFFUSERS:
            return f"{prefix}{index}.{QKV_NATIVE}", QKV_DIFFUSERS.index(rest)
        inner = _rename(rest, _DIT_IN_BLOCK, to_diffusers=False)
        if inner is not None:
            return f"{prefix}{index}.{inner}", None
    else:
        top = _rename(name, _DIT_TOP, to_diffusers=False)
        if top is not None:
            return top, None
    raise CheckpointError(f"no native name for diffusers DiT tensor {name!r}")


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
    per_head = qkv.reshape(heads, 3, head_dim, -1)  # [H, 3, D, in]
    q, k, v = (per_head[:, i].reshape(heads * head_dim, -1) for i in range(3))
    return q, k, v


def swap_halves(weight: Tensor) -> Tensor:
    """Native fc1 `[gate; value]` <-> diffusers `[value; gate]` (the map is its own inverse). [2F, in] -> [2F, in]."""
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
