"""The three on-disk checkpoint layouts and each layout's DiT tensors as native-named entries (DESIGN.md §2); their
detection and configs (`read_checkpoint_info`, no weights read, torch-free) are `h3render.checkpoint.info`.

* **official** (`MiniMaxAI/MiniMax-H3`): a partition folder `FL2VA/` (t2va, fl2va) holding `model_index.json` (with
  `_minimax_h3.sigma_shift_scales`), `transformer/` (sharded safetensors + `*.safetensors.index.json`, NATIVE names:
  q/k/v rows interleaved per head in `attn.qkv_proj`, `mlp.fc1` gate-first), `text_encoder/`, `tokenizer/`,
  `processor/`, `video_vae/`, `audio_vae/`.
* **diffusers**: `model_index.json`, `transformer/` (diffusers names: separate `to_q/to_k/to_v`, `ff.net.0.proj`
  value-first), `vae/`, `audio_vae/`, `scheduler/`, `audio_scheduler/`, `text_encoder/`, `tokenizer/`.
* **single file** (ComfyUI): one transformer `.safetensors`, native names but q/k/v STACKED `[q; k; v]`.

Assumption (not confirmed against the released files): the official `video_vae/` and `audio_vae/` folders hold
diffusers-named weights and a diffusers `config.json`, as the diffusers layout's `vae/` and `audio_vae/` do.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import CheckpointInfo
from h3render.checkpoint.names import (FC1_NATIVE, IGNORED_DIT_TENSORS, QKV_DIFFUSERS, QKV_NATIVE,
                                       dit_name_from_diffusers, interleave_qkv, native_gate_name, swap_halves)
from h3render.checkpoint.stream import Entry, file_entries, safetensors_entries
from h3render.models.dit_config import DiTConfig


# ---------------------------------------------------------------------------------------------------------------------
# DiT entry converters: every layout becomes native-named entries.


def _native_dit_entries(entries: Iterable[Entry]) -> Iterator[Entry]:
    """Native names as they are; a full FastH3 export's VSA gates (`attn.to_gate_compress`) as `attn.gate_proj`."""
    for entry in entries:
        if entry.name not in IGNORED_DIT_TENSORS:
            yield entry._replace(name=native_gate_name(entry.name))  # `_replace` keeps the host loader


def _stacked_dit_entries(entries: Iterable[Entry], config: DiTConfig) -> Iterator[Entry]:
    """ComfyUI single file: strip a `model.diffusion_model.` prefix; re-order stacked `[q; k; v]` to interleaved."""
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    for entry in entries:
        name = entry.name.removeprefix("model.diffusion_model.")
        if name in IGNORED_DIT_TENSORS:
            continue
        if name.endswith(QKV_NATIVE):
            def load(entry=entry) -> Tensor:
                stacked = entry.load()
                if stacked.ndim != 2 or stacked.shape[0] != 3 * heads * head_dim:
                    return stacked  # wrong shape: let the strict shape check report it
                return interleave_qkv(*stacked.chunk(3, dim=0), heads, head_dim)
            yield Entry(entry.file, name, load)
        else:
            yield entry._replace(name=native_gate_name(name))


def _diffusers_dit_entries(entries: Iterable[Entry], config: DiTConfig) -> Iterator[Entry]:
    """Diffusers names -> native: to_q/to_k/to_v fused per head once all three are seen; ff value-first -> fc1
    gate-first."""
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    pending: dict[str, dict[int, Entry]] = {}
    for entry in entries:
        if entry.name in IGNORED_DIT_TENSORS:
            continue
        try:
            native, slot = dit_name_from_diffusers(entry.name)
        except CheckpointError:
            raise CheckpointError(f"{entry.file}: unexpected tensor {entry.name!r} (not a diffusers "
                                  f"MiniMaxH3Transformer3DModel name)") from None
        if slot is None:
            if native.endswith(FC1_NATIVE):  # re-ordered rows: a computed tensor, read on the device only
                yield Entry(entry.file, native, functools.partial(lambda e: swap_halves(e.load()), entry))
            else:
                yield entry._replace(name=native)
            continue
        parts = pending.setdefault(native, {})
        if slot in parts:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} appears twice")
        parts[slot] = entry
        if len(parts) == 3:
            del pending[native]
            q, k, v = (parts[i] for i in range(3))

            def load(q=q, k=k, v=v) -> Tensor:
                tensors = [e.load() for e in (q, k, v)]
                expected = (heads * head_dim,)
                for e, t in zip((q, k, v), tensors):
                    if t.ndim != 2 or tuple(t.shape[:1]) != expected:
                        raise CheckpointError(f"{e.file}: tensor {e.name!r} has shape {tuple(t.shape)}, the DiT "
                                              f"config expects [{heads * head_dim}, in]")
                return interleave_qkv(*tensors, heads, head_dim)
            yield Entry(q.file, native, load)
    for native, parts in pending.items():
        have = next(iter(parts.values()))
        lacking = [QKV_DIFFUSERS[i] for i in range(3) if i not in parts]
        missing = have.name.rsplit("attn.", 1)[0] + lacking[0]
        raise CheckpointError(f"{have.file}: missing tensor {missing!r} (its q/k/v siblings are present)")


def dit_entries(info: CheckpointInfo, device: torch.device | str = "cpu") -> Iterator[Entry]:
    """The DiT tensors of a (non-builtin) checkpoint as native-named entries in file order, whatever its layout.

    Raises:
        CheckpointError: as `safetensors_entries`; a diffusers name outside the DiT, a repeated or lone q/k/v.
    """
    source, config = Path(info.transformer), info.release.dit
    if info.transformer_names == "native-stacked":
        return _stacked_dit_entries(file_entries(source, torch.device(device)), config)
    raw = safetensors_entries(source, device)
    if info.transformer_names == "native":
        return _native_dit_entries(raw)
    return _diffusers_dit_entries(raw, config)
