"""Synthetic MiniMax-H3 models: the built-in random "tiny" / "small" models, the checkpoint writer of the
`h3render make-checkpoint` command (every on-disk layout), and a synthetic FastH3 adapter. Nothing here loads a real
checkpoint: that is `h3render.checkpoint`.

* `random_model`: deterministic per-tensor random weights (`random_entries`), `build_random` / `build_tiny`, and the
  in-memory byte-level tokenizer.
* `writer`: `make_checkpoint` (official, diffusers and single-file layouts), `check_output` (its target path).
* `synthetic_adapter`: `write_synthetic_adapter` (`fastvideo-lora-v2` layout).
"""

from h3render.make_checkpoint.random_model import (STORAGE_DTYPES, build_random, build_tiny, dit_storage_dtype,
                                                   random_entries, random_tensor, tiny_tokenizer)
from h3render.make_checkpoint.synthetic_adapter import write_synthetic_adapter
from h3render.make_checkpoint.writer import LAYOUTS, check_output, make_checkpoint

__all__ = [
    "LAYOUTS", "STORAGE_DTYPES", "build_random", "build_tiny", "check_output", "dit_storage_dtype", "make_checkpoint",
    "random_entries", "random_tensor", "tiny_tokenizer", "write_synthetic_adapter",
]
