"""Pure-torch MiniMax-H3 modules: tensors in, tensors out; no I/O, env reads or process groups."""
