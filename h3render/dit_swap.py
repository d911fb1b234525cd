"""Moving DiT partitions between the device and host memory (a mixed queue's t2va / fl2va and ref2va jobs).

At release each DiT is ≈40 GB without its AdaLN projections, which stay in host memory (`DiT.offload_adaln_`, ≈26 GB
each) and never move here. An H200 holds one DiT beside the text encoder and a forward's activations, not two, so the
inactive partition waits in host memory. Sending the active DiT to the host with `.to("cpu")` while the other still
sat there held both there at once: 2 x 26 GB of projections + 2 x 40 GB of DiTs, and the two-partition engine was
killed by the out-of-memory killer of a 128 GB host (docs/performance.md §18.2). `exchange` swaps the two tensor by
tensor through the host buffers the incoming DiT leaves, so neither the host nor the device ever holds more than one
DiT plus one tensor; the parked DiT's buffers are pinned on CUDA (`pinned.PinnedArena`), so both copies run at the
link's rate instead of paging fresh host memory in (≈1 GB/s on the H200 host, §11.2). Measured on one H200 with the
released DiT (40.2 GB): 1.48 s a swap, host memory of the whole two-partition engine 101.9 GB at its peak (§20).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from h3render.pinned import PinnedArena

Slot = tuple[nn.Module, str, str]  # (module, "_parameters" | "_buffers", name)


def _slots(dit: nn.Module) -> dict[str, Slot]:
    """Every parameter and buffer of `dit` outside its AdaLN projections, by qualified name."""
    slots: dict[str, Slot] = {}
    for path, module in dit.named_modules():
        if "adaln_proj" in path.split("."):
            continue
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    slots[f"{path}.{name}" if path else name] = (module, kind, name)
    return slots


def _get(slot: Slot) -> torch.Tensor:
    module, kind, name = slot
    return getattr(module, kind)[name]


def _put(slot: Slot, t: torch.Tensor) -> None:
    """Point the slot at `t`; a parameter keeps its identity (the forward and optimizers hold the object)."""
    module, kind, name = slot
    if kind == "_parameters":
        param = module._parameters[name]
        if torch._has_compatible_shallow_copy_type(param, t):
            param.data = t
        else:  # meta and real tensors do not share a tensor type (as `nn.Module._apply`, a new parameter)
            module._parameters[name] = nn.Parameter(t, requires_grad=param.requires_grad)
    else:
        module._buffers[name] = t


def _move(slots: Iterator[Slot], device: torch.device | str, pin: bool) -> int:
    to_host = torch.device(device).type == "cpu"
    arena = PinnedArena() if to_host and pin else None  # its slabs live as long as the tensors carved from them
    moved = 0
    for slot in slots:
        t = _get(slot).detach()
        if t.device == torch.device(device) or to_host and t.device.type == "cpu":
            continue
        if not to_host:
            moved_t = t.to(device)
        elif arena is not None:
            try:
                moved_t = arena.copy(t)
            except RuntimeError:  # no pinnable memory left: pageable still works, only slower
                arena, moved_t = None, t.to("cpu")
        else:
            moved_t = t.to("cpu")
        _put(slot, moved_t)
        moved += t.numel() * t.element_size()
    return moved


def move_dit(dit: nn.Module, device: torch.device | str, pin: bool = False) -> int:
    """`dit.to(device)` except its AdaLN projections, which stay where they are; tensor by tensor, so the source side
    frees each one as the other side receives it. To "cpu" with `pin` the copies are pinned (a later `exchange` or
    move back then runs at the link's rate). Tensors already there (to "cpu": in host memory) stay as they are.
    Returns the bytes moved."""
    return _move(iter(_slots(dit).values()), device, pin)


def exchange(outgoing: nn.Module, incoming: nn.Module) -> int:
    """Swap where two DiTs live: `outgoing`'s tensors go where `incoming`'s are (host memory) and `incoming`'s where
    `outgoing`'s are (the device), each module keeping its own values and parameter objects.

    Tensors of one name, shape and dtype in both (all of them for two DiTs of one config) trade storage: the incoming
    tensor is copied to the outgoing one's device, then its host buffer receives the outgoing tensor's values (the
    same stream orders the two copies) and becomes that tensor. A name in one DiT only moves alone (the outgoing
    ones first, so the device frees before it fills). Returns the bytes that went each way (outgoing's).
    """
    out_slots, in_slots = _slots(outgoing), _slots(incoming)
    paired = [name for name, slot in out_slots.items() if name in in_slots and _same(_get(slot), _get(in_slots[name]))]
    both = set(paired)
    alone_out = [slot for name, slot in out_slots.items() if name not in both]
    alone_in = [slot for name, slot in in_slots.items() if name not in both]
    target = next((_get(in_slots[n]).device for n in paired), torch.device("cpu"))
    device = next((_get(out_slots[n]).device for n in paired), torch.device("cpu"))
    moved = _move(iter(alone_out), target, pin=target.type == "cpu" and torch.cuda.is_available())
    for name in paired:
        # detached views: `_put` repoints a parameter object, and these must keep naming the old storages
        out_t, in_t = _get(out_slots[name]).detach(), _get(in_slots[name]).detach()
        arriving = in_t.to(device, copy=True, non_blocking=True)
        in_t.copy_(out_t, non_blocking=True)
        _put(in_slots[name], arriving)
        _put(out_slots[name], in_t)
        moved += out_t.numel() * out_t.element_size()
    _move(iter(alone_in), device, pin=False)
    if device.type == "cuda" or target.type == "cuda":
        torch.cuda.synchronize()  # the device-to-host copies land in host memory before anyone reads it
    return moved


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype
