"""Layer streaming for small cards (the streamed memory plan, `h3render.memplan`): the layers of a `ModuleList` (the
DiT's blocks, the text encoder's decoder layers) live in host memory (pinned on a CUDA machine) and come to the
device one layer ahead of use, on a side stream, into two device slots (double-buffered): while layer i computes
in one slot, layer i + 1 is copied into the other.

The order of one layer's life, from forward hooks (the model's own loop is untouched):

1. pre-hook of layer i: if layer i was not prefetched (the first layer of a forward), copy it now on the side
   stream; the compute stream waits for its copy's event; its tensors point into its slot; then the copy of
   layer i + 1 (wrapping to 0, for the next forward) into the other slot is queued on the side stream, after the
   event that the last layer computing in that slot recorded when it finished.
2. forward hook of layer i: the compute stream records "slot free" for its slot; the layer's tensors point back at
   empty placeholders, so no module keeps a slot alive.

Off CUDA the side stream degenerates to the current thread (each copy completes at once) but every other step, the
slots and the host->slot copies included, is the same code: a streamed CPU render is bit-equal to the resident one
(tests/unit/test_memplans.py). Tensors named in `keep` (the DiT's AdaLN projections: `DiT.modulation_tables` moves
them itself) are not streamed and stay where they are.

What a transfer costs and hides: a released bf16 DiT block is 0.77 GB (fp8 0.39 GB) and PCIe 5.0 x16 moves about
50 GB/s (H200 NVL / PCIe boards; 25 GB/s on PCIe 4.0), so a block arrives in ~15 ms (8 ms fp8), under a block's
compute at 1344x768x243 (8.4 s / 50 blocks = 168 ms a VSA forward): fully hidden there, exposed only for short
clips of few rows (docs/performance.md §13.2: predicted; §13.3 gives the device runs that measure it).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Iterable

import torch
from torch import nn

from h3render.pinned import PinnedArena


class LayerStreamer:
    """Stream `layers` (same tensor shapes in every layer) through two device slots on `device`.

    Args:
        layers: the modules to stream, in forward order (an `nn.ModuleList`).
        device: where they compute.
        keep: submodule names (relative to a layer) whose tensors are not streamed (e.g. "adaln_proj").
    Attributes:
        host_bytes: bytes of the streamed layers held in host memory.
        copies: layer copies issued (one per layer per forward once warm); copy_seconds: host time issuing them.
    """

    def __init__(self, layers: nn.ModuleList, device: torch.device, keep: Iterable[str] = ()):
        self.layers = list(layers)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        keep = tuple(keep)
        # Per layer: (module, attribute, kind) of each streamed tensor, and its host copy.
        self._slots_of: list[list[tuple[nn.Module, str, str]]] = []
        self._host: list[list[torch.Tensor]] = []
        self._empty: list[torch.Tensor] = []
        # Pinned slabs, not one pinned allocation per tensor: torch rounds those up to a power of two (+50 % for
        # the released DiT's linears, `h3render.pinned`).
        arena = PinnedArena() if self.cuda else None
        for i, layer in enumerate(self.layers):
            refs, host = [], []
            for name, module in layer.named_modules():
                if any(name == k or name.startswith(k + ".") for k in keep):
                    continue
                for kind, table in (("p", module._parameters), ("b", module._buffers)):
                    for attr, t in table.items():
                        if t is None:
                            continue
                        refs.append((module, attr, kind))
                        host.append(arena.copy(t) if arena is not None else _host_copy(t))
            if self._host and [(t.shape, t.dtype) for t in host] != [(t.shape, t.dtype) for t in self._host[0]]:
                raise ValueError(f"LayerStreamer: layer {i} differs from layer 0 in its tensors; two shared slots "
                                 "cannot hold both")
            self._slots_of.append(refs)
            self._host.append(host)
            if not self._empty:
                self._empty = [torch.empty(0, dtype=t.dtype, device=self.device) for t in host]
            self._point(i, self._empty)  # the layer's own tensors go now: one layer's worth of them at a time
        self.host_bytes = sum(t.numel() * t.element_size() for h in self._host for t in h)
        self.host_held_bytes = arena.held_bytes if arena is not None else self.host_bytes
        self._slots = [[torch.empty_like(t, device=self.device) for t in self._host[0]] for _ in range(2)]
        self.slot_bytes = sum(t.numel() * t.element_size() for t in self._slots[0])
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._in_slot: list[int | None] = [None, None]  # which layer each slot holds (or is receiving)
        self._ready: list[torch.cuda.Event | None] = [None, None]  # the copy into the slot is done
        self._free: list[torch.cuda.Event | None] = [None, None]  # the last layer computing in the slot is done
        self._current: int | None = None  # the slot of the layer computing now
        self.copies = 0
        self.copy_seconds = 0.0
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda m, args, i=i: self._before(i))
            layer.register_forward_hook(lambda m, args, out, i=i: self._after(i))

    # -- the hooks ---------------------------------------------------------------------------------------------------

    def _before(self, i: int) -> None:
        slot = self._slot_holding(i)
        if slot is None:
            slot = 0 if self._current is None else 1 - self._current
            self._fetch(i, slot)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
        self._point(i, self._slots[slot])
        self._current = slot
        following = (i + 1) % len(self.layers)
        if following != i:
            self._fetch(following, 1 - slot)

    def _after(self, i: int) -> None:
        slot = self._current
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._free[slot] = event
        self._point(i, self._empty)

    # -- the pieces --------------------------------------------------------------------------------------------------

    def _slot_holding(self, i: int) -> int | None:
        for slot in (0, 1):
            if self._in_slot[slot] == i:
                return slot
        return None

    def _fetch(self, i: int, slot: int) -> None:
        """Queue the copy of layer i into `slot` on the side stream, after the slot's last user finished."""
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream) if self.cuda else nullcontext():
            if self.cuda and self._free[slot] is not None:
                self._stream.wait_event(self._free[slot])
            for dst, src in zip(self._slots[slot], self._host[i]):
                dst.copy_(src, non_blocking=self.cuda)
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
                self._ready[slot] = event
        self._in_slot[slot] = i
        self.copies += 1
        self.copy_seconds += time.perf_counter() - t0

    def _point(self, i: int, tensors: list[torch.Tensor]) -> None:
        for (module, attr, kind), t in zip(self._slots_of[i], tensors):
            if kind == "p":
                module._parameters[attr].data = t
            else:
                module._buffers[attr] = t

    def record(self) -> dict:
        """For the engine's warm-up record: what streams and what it holds."""
        return {"layers": len(self.layers), "host_gb": round(self.host_bytes / 1e9, 3),
                "host_held_gb": round(self.host_held_bytes / 1e9, 3),
                "slot_gb": round(self.slot_bytes / 1e9, 3), "pinned": self.cuda}


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in (pageable) host memory, its own storage: the module's pointer swap must not alias a CPU tensor."""
    host = t.detach().to("cpu")
    return host.clone() if host.data_ptr() == t.data_ptr() else host


def stream_layers_(model: nn.Module, layers: nn.ModuleList, device: torch.device,
                   keep: Iterable[str] = ()) -> LayerStreamer:
    """Make `layers` (a ModuleList of `model`) stream (`LayerStreamer`), then move every other tensor of `model` to
    `device`, except those under a `keep` submodule of a layer (they stay where they are). Returns the streamer."""
    streamer = LayerStreamer(layers, device, keep)
    kept = {id(m) for layer in layers for name, m in layer.named_modules()
            if any(name == k or name.startswith(k + ".") for k in keep)}
    streamed = {id(m) for layer in layers for m in layer.modules()} - kept
    for module in model.modules():
        if id(module) in kept or id(module) in streamed:
            continue
        for attr, p in module._parameters.items():
            if p is not None:
                p.data = p.data.to(device)
        for attr, b in module._buffers.items():
            if b is not None:
                module._buffers[attr] = b.to(device)
    return streamer


def stream_parts(components, device: torch.device):
    """The streamed plan's placement (wherever the parts were loaded; `Engine.load` loads them in host memory): the
    DiT's blocks stream (`block_stream.stream_layers_`; their AdaLN projections go to host memory, as
    `DiT.offload_adaln_` would put them), the rest of the DiT and the audio VAE go to `device`, the video VAE to
    host memory until a decode (`Engine.vae_on_device`). Returns the DiT blocks' streamer."""
    dit = components.dit
    dit.offload_adaln_("cpu")
    streamer = stream_layers_(dit, dit.blocks, device, keep=("adaln_proj",))
    if dit.final_layer.adaln_proj is not None:
        dit.final_layer.adaln_proj.to("cpu")
    components.audio_vae.to(device)
    if device.type == "cuda":
        components.video_vae.to("cpu")
        torch.cuda.empty_cache()
    return streamer
