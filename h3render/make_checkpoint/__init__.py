"""Synthetic MiniMax-H3 checkpoints on disk: the writer of the `h3render make-checkpoint` command (every layout) and
synthetic FastH3 adapters and students. The built-in random weights they store are a checkpoint source
(`h3render.checkpoint.builtin`); this package imports `h3render.checkpoint`, never the reverse.

* `writer`: `make_checkpoint` (official, diffusers and single-file layouts), `write_synthetic_full_student` (a
  full FastH3 student checkpoint, v1 or V2).
* `targets`: `check_output`, `check_extras` (where it would write; torch-free).
* `synthetic_adapter`: `write_synthetic_adapter` (`fastvideo-lora-v2` layout), `write_synthetic_bundle` (the v1
  LoRA bundle), `FULL_STUDENTS` (the students' contracts).
* `files`: `save_tensors`.
"""
