"""Errors shared by the checkpoint modules."""


class CheckpointError(ValueError):
    """A checkpoint cannot be read (layout, config or tensor); the message names the file and, where one is
    involved, the tensor."""
