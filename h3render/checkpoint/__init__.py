"""Checkpoints: what a checkpoint is and how its weights reach the device. Import each name from its module:

* `info`: official / diffusers / single-file detection and configs (`read_checkpoint_info`, `CheckpointInfo`), from
  JSON and safetensors headers, torch-free (the front end reads it before anything heavy loads).
* `layouts`: each layout's DiT tensors as native-named entries.
* `stream`: strict safetensors streaming onto the device in the module's own dtypes, meta-device builds.
* `builtin`: the built-in random models ("tiny", "small") as a source of entries, and their tokenizer.
* `load`: `load_components`, `build_random`, `load_dit`, `load_tokenizer`, `load_vision` (fl2va's vision tower +
  processor).
* `names`: the one native <-> diffusers DiT name table and the q/k/v and gate/value row orders.
* `adapter`, `contract`, `students`: the FastH3 adapter (read, validate, fusion hook), the students' contracts and
  few-step schedules, and the student a run resolves to.
* `releases`: the release registry.
* `errors`: `CheckpointError`, `AdapterError`.

The writers of on-disk checkpoints live in `h3render.make_checkpoint`, which imports this package, never the reverse.
"""
