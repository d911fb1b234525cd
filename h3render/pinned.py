"""Host tensors carved out of large pinned slabs, so pinning a model costs its bytes and not up to twice them.

torch's pinned (page-locked) host allocator rounds every allocation up to a power of two (ATen
`CachingHostAllocator::allocate`, `PowerOf2Ceil`, as torch 2.13's headers show): the released DiT's block linears are
77, 154, 231 and 308 MB, which round to 128, 256, 256 and 512 MB, so a 40 GB DiT pinned tensor by tensor would hold
≈60 GB of host memory (computed). Measured with the slabs on the H200 host: the streamed fp8 DiT blocks hold 22.55 GB
for 21.21 GB of tensors (docs/performance.md §20.1).
Slabs of `SLAB_BYTES` (itself a power of two, so not rounded) filled first-fit lose only what no tensor fits into.
"""

from __future__ import annotations

import math

import torch

SLAB_BYTES = 1 << 30  # 1 GiB: the released DiT's largest linear (308 MB) wastes at most a third of one slab
ALIGN = 512  # bytes: every dtype's alignment, and the DMA engines' preferred one


class PinnedArena:
    """First-fit allocator of host tensors inside `SLAB_BYTES` slabs (pinned when `pin`; pageable slabs serve the
    CPU tests of the carving). A tensor larger than a slab gets its own allocation. Slabs live as long as any
    tensor carved from them (each is a view of its slab's storage).

    Attributes:
        slabs: the slabs made so far (uint8 `[SLAB_BYTES]`); `used[i]` bytes of slab i are taken.
    """

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.slabs: list[torch.Tensor] = []
        self.used: list[int] = []

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous host tensor of `shape` and `dtype`."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > SLAB_BYTES:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        slot = next((i for i, used in enumerate(self.used) if used + size <= SLAB_BYTES), None)
        if slot is None:
            self.slabs.append(torch.empty(SLAB_BYTES, dtype=torch.uint8, pin_memory=self.pin))
            self.used.append(0)
            slot = len(self.slabs) - 1
        start = self.used[slot]
        self.used[slot] += size
        return self.slabs[slot][start:start + nbytes].view(dtype).view(shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s values in a host tensor of this arena (from the device, one direct copy into pinned memory)."""
        host = self.empty(t.shape, t.dtype)
        host.copy_(t.detach())
        return host

    @property
    def held_bytes(self) -> int:
        """Host bytes the slabs hold (what the process pays), beside the tensors' own bytes."""
        return len(self.slabs) * SLAB_BYTES
