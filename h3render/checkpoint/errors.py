"""The two errors of checkpoint and adapter loading."""


class CheckpointError(ValueError):
    """A checkpoint cannot be read (layout, config or tensor); the message names the file and, where one is
    involved, the tensor."""


class AdapterError(ValueError):
    """A FastH3 adapter file cannot be read, matched to the checkpoint, or fused; the message names the file and
    the field or tensor."""
