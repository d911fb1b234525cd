"""Checkpoints: what a checkpoint is and how its weights reach the device.

* `layouts`: official / diffusers / single-file detection and configs (`read_checkpoint_info`, `CheckpointInfo`),
  each layout's DiT tensors as native-named entries.
* `stream`: strict safetensors streaming onto the device in the module's own dtypes, meta-device builds.
* `load`: `load_components`, `load_dit`, `load_tokenizer`, `load_vision` (fl2va's vision tower + processor).
* `names`: the one native <-> diffusers DiT name table and the q/k/v and gate/value row orders.
* `adapter`: the FastH3 adapter (read, validate, fusion hook), the V2 contract and the few-step schedule.
* `releases`: the release registry.
* `errors`: `CheckpointError`, `AdapterError`.

The built-in random models and the checkpoint writer live in `h3render.make_checkpoint`.
"""

from h3render.checkpoint.adapter import (RELEASED_BASE_MODEL, TINY_BASE_MODEL, V2_CONTRACT_FILE, Adapter, AdapterFusion,
                                         fasth3_schedule, read_adapter, read_v2_contract)
from h3render.checkpoint.errors import AdapterError, CheckpointError
from h3render.checkpoint.layouts import CheckpointInfo, read_checkpoint_info, with_transformer_file
from h3render.checkpoint.load import PARTS, Components, load_components, load_dit, load_tokenizer, load_vision
from h3render.checkpoint.names import dit_state_dict_to_diffusers
from h3render.checkpoint.releases import (BUILTIN, QWEN3VL_RELEASED, QWEN3VL_SMALL, QWEN3VL_TINY, RELEASES,
                                          Release)
from h3render.checkpoint.stream import Entry, TensorHook, safetensors_entries, stream_into, weights_where

__all__ = [
    "Adapter", "AdapterError", "AdapterFusion", "BUILTIN", "CheckpointError", "CheckpointInfo", "Components", "Entry",
    "PARTS", "QWEN3VL_RELEASED", "QWEN3VL_SMALL", "QWEN3VL_TINY", "RELEASED_BASE_MODEL", "RELEASES", "Release",
    "TINY_BASE_MODEL", "TensorHook", "V2_CONTRACT_FILE", "dit_state_dict_to_diffusers", "fasth3_schedule",
    "load_components", "load_dit", "load_tokenizer", "load_vision", "read_adapter", "read_checkpoint_info", "read_v2_contract",
    "safetensors_entries", "stream_into", "weights_where", "with_transformer_file",
]
