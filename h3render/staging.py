"""Pinned host buffers for the decoded frames' device-to-host copies, handed to the MP4 writer without a host copy.

Split from h3render/media.py (the writer consumes `StagedChunk`s and releases their buffers).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from h3render.colour import MediaError


@dataclass
class StagedChunk:
    """Host frames whose buffer is on loan from :class:`PinnedFrameStager`.

    ``array`` may only be read after ``wait()`` (the device-to-host copy may still be in flight) and must not
    be touched after ``release()`` (the stager reuses the buffer). :class:`Mp4Writer` does both itself.
    """

    array: np.ndarray
    wait: Callable[[], None] = field(default=lambda: None)
    release: Callable[[], None] = field(default=lambda: None)


_STAGE_TIMEOUT_S = 600.0


class _Slot:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event = None  # torch.cuda.Event once used
        self.free = threading.Event()
        self.free.set()


class PinnedFrameStager:
    """Reused pinned host buffers for non-blocking device-to-host copies of uint8 frame chunks.

    ``stage(chunk)`` starts the copy of a CUDA tensor on a side stream into the next of ``num_buffers``
    pinned buffers, records a CUDA event, and returns at once with a :class:`StagedChunk` whose numpy array is
    a view of that buffer (no further host copy). Whoever reads it calls ``wait()`` (event sync) and then
    ``release()``; ``stage`` blocks only if every buffer is still on loan. Buffers grow to the largest chunk
    seen and are kept. On CPU tensors (or without CUDA) it is a pass-through: ``array`` is
    ``chunk.numpy()``, with no-op wait/release.

    Every staged chunk must reach ``Mp4Writer.write_frames`` (which releases it, also on errors) or be
    released by hand; ``stage`` raises MediaError after 10 minutes waiting for a buffer.

    Args:
        num_buffers: pinned buffers in the ring; use at least the writer's ``queue_chunks + 2`` so that the
            producer never waits on the encoder for a buffer before the queue itself pushes back.
    """

    def __init__(self, num_buffers: int = 6) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers: need at least 1, got {num_buffers}")
        self._slots = [_Slot() for _ in range(num_buffers)]
        self._next = 0
        self._stream = None

    def stage(self, chunk: torch.Tensor) -> StagedChunk:
        """Args: chunk uint8 ``[n, ...]`` (RGB ``[n, H, W, 3]`` or I420 ``[n, H*3//2, W]``), any device."""
        if chunk.dtype != torch.uint8:
            raise MediaError(f"stage: expected uint8 frames, got {chunk.dtype}")
        if chunk.device.type != "cuda":
            return StagedChunk(chunk.detach().contiguous().numpy())

        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if not slot.free.wait(timeout=_STAGE_TIMEOUT_S):  # the writer still reads it: back-pressure
            raise MediaError(f"stage: pinned buffer not released in {_STAGE_TIMEOUT_S:.0f} s (a staged chunk "
                             "was neither written nor released)")
        slot.free.clear()
        numel = chunk.numel()
        if slot.buffer is None or slot.buffer.numel() < numel:
            slot.buffer = torch.empty(numel, dtype=torch.uint8, pin_memory=True)
        host = slot.buffer[:numel].view(chunk.shape)

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=chunk.device)
        producer = torch.cuda.current_stream(chunk.device)
        self._stream.wait_stream(producer)  # the copy must see the finished conversion
        with torch.cuda.stream(self._stream):
            host.copy_(chunk, non_blocking=True)
            slot.event = torch.cuda.Event()
            slot.event.record(self._stream)
        chunk.record_stream(self._stream)  # keep the allocator from reusing chunk before the copy ends
        event = slot.event
        return StagedChunk(host.numpy(), wait=event.synchronize, release=slot.free.set)
