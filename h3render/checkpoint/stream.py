"""Strict safetensors streaming: checkpoint tensors read lazily, straight onto the target device, cast to the dtype
each module's precision policy gives it, and assigned shard by shard into modules built on the meta device.

No full-precision copy of a model ever sits in host RAM. Loading is strict: a missing, unexpected, repeated or
mis-shaped tensor, a shard named in an index but absent, or an unreadable safetensors header raises
`CheckpointError` naming the file and tensor (pattern: flux `util.py` `load_flow_model`, gpt-fast `generate.py`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator, Mapping, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import read_json

# ---------------------------------------------------------------------------------------------------------------------
# Tensor sources: (file, name, loader) entries, read lazily so skipped tensors are never read.


class Entry(NamedTuple):
    """One checkpoint tensor: the file it lives in, its name there, and a loader returning it (on the device the
    source was opened for, in its stored dtype); `host`, when the source can, reads the same tensor straight into
    host memory (a safetensors file's entries have one; a computed tensor, such as a fused q/k/v, has none)."""

    file: str
    name: str
    load: Callable[[], Tensor]
    host: Callable[[], Tensor] | None = None


def open_safetensors(path: Path, device: torch.device, tensor: str | None = None):
    """A safetensors handle opened for `device`; `tensor` (one name the file should hold) is named in the error.

    Raises:
        CheckpointError: the header cannot be read.
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        # Opened for the target device, safetensors copies each tensor straight there (no host-RAM staging copy).
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError subclasses
        what = f" (holding tensor {tensor!r})" if tensor else ""
        raise CheckpointError(f"{path}: unreadable safetensors header{what}: {exc}") from None


def file_entries(path: Path, device: torch.device, expect: Collection[str] | None = None) -> Iterator[Entry]:
    """Entries of one safetensors file; with `expect` (the names an index assigns to it), check both ways."""
    handle = open_safetensors(path, device, tensor=next(iter(expect), None) if expect else None)
    names = list(handle.keys())
    if expect is not None:
        absent = sorted(set(expect) - set(names))
        if absent:
            raise CheckpointError(f"{path}: tensor {absent[0]!r} is listed in the index but absent from this shard "
                                  f"({len(absent)} absent)")
        extra = sorted(set(names) - set(expect))
        if extra:
            raise CheckpointError(f"{path}: tensor {extra[0]!r} is in this shard but not in the index")
    host = [handle] if device.type == "cpu" else []

    def host_tensor(name: str) -> Tensor:
        # A second handle, opened for host memory on first use: a tensor the loader keeps on the host (the DiT's
        # AdaLN projections) is copied from the file's pages, never through the device and back (≈1 GB/s D2H).
        if not host:
            host.append(open_safetensors(path, torch.device("cpu"), tensor=name))
        return host[0].get_tensor(name)

    for name in names:
        yield Entry(str(path), name, functools.partial(handle.get_tensor, name), functools.partial(host_tensor, name))


def safetensors_entries(directory: Path, device: torch.device | str = "cpu") -> Iterator[Entry]:
    """Every tensor of a model folder: the shards of its `*.safetensors.index.json` in index order, or its single
    `*.safetensors` file.

    Raises:
        CheckpointError: no weights, several indexes, several unindexed files, a bad index, a shard named in the
            index but absent, an unreadable header, or a tensor in a shard that the index does not list.
    """
    directory = Path(directory)
    device = torch.device(device)
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{directory}: several weight indexes {[p.name for p in indexes]}")
    if indexes:
        index_path = indexes[0]
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in by_shard.items():
            shard_path = directory / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{shard_path}: shard named in {index_path.name} is absent "
                                      f"(it should hold tensor {names[0]!r})")
        for shard, names in by_shard.items():
            yield from file_entries(directory / shard, device, expect=names)
        return
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights")
    if len(files) > 1:
        raise CheckpointError(f"{directory}: several *.safetensors files {[p.name for p in files]} and no index")
    yield from file_entries(files[0], device)


def weights_where(folder: str | Path) -> str:
    """The file naming a folder's tensors, for messages: its index, its single weights file, or the folder."""
    folder = Path(folder)
    if folder.is_file():
        return str(folder)
    found = sorted(folder.glob("*.safetensors.index.json")) or sorted(folder.glob("*.safetensors"))
    return str(found[0]) if len(found) == 1 else str(folder)


# ---------------------------------------------------------------------------------------------------------------------
# Empty modules and strict streaming.


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with every parameter on the meta device while buffers (RoPE frequencies, latent statistics)
    are computed for real: they are derived from the config and never stored in a checkpoint."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def cast_parameters_(module: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter (not buffer) to `dtype`: transformers keeps Qwen's RoPE `inv_freq` float32 in bf16 models."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.is_floating_point():
                sub._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)


# `hook(native_name, tensor) -> tensor`, applied to every DiT tensor while it streams; may carry a `finish()`.
TensorHook = Callable[[str, Tensor], Tensor]


def stream_into(
    module: nn.Module,
    entries: Iterable[Entry],
    device: torch.device | str,
    *,
    what: str,
    where: str,
    skip: Callable[[str], bool] = lambda name: False,
    tensor_hook: TensorHook | None = None,
    elsewhere: Mapping[str, torch.device] | None = None,
) -> nn.Module:
    """Strictly load `entries` into an empty (meta-parameter) `module`, shard by shard, with `assign=True`.

    Each tensor goes straight to `device` (or to its `elsewhere` place), through `tensor_hook(name, tensor)` when
    given (stored dtype in, any dtype out), and is cast to the dtype of the module's own (meta) parameter: the
    module's precision policy decides.

    Args:
        what: the component, for messages ("DiT", "video VAE", ...); where: the folder/file, for missing tensors.
        skip: names present in the checkpoint that this module does not build (never read).
        elsewhere: tensors (by name) that go to another device than `device`; one bound for host memory is read
            with its entry's `host` loader when it has one, so it never visits `device`.

    Raises:
        CheckpointError: unexpected, repeated, mis-shaped or missing tensor, or an integer (or bool) tensor for a
            floating-point parameter, naming the file and tensor.
    """
    device = torch.device(device)
    targets = {name: (tuple(t.shape), t.dtype) for name, t in module.state_dict(keep_vars=True).items()}
    loaded: set[str] = set()
    shard: dict[str, Tensor] = {}
    shard_file = None
    for entry in entries:
        if skip(entry.name):
            continue
        if entry.name not in targets:
            raise CheckpointError(f"{entry.file}: unexpected tensor {entry.name!r} for the {what}")
        if entry.name in loaded:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} appears twice")
        if entry.file != shard_file and shard:
            module.load_state_dict(shard, strict=False, assign=True)
            shard = {}
        shard_file = entry.file
        place = device if elsewhere is None else elsewhere.get(entry.name, device)
        tensor = (entry.host if place.type == "cpu" and entry.host is not None else entry.load)()
        shape, dtype = targets[entry.name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {tuple(tensor.shape)}, the "
                                  f"{what} config expects {shape}")
        if dtype.is_floating_point and not (tensor.is_floating_point() or tensor.is_complex()):
            # A cast would turn stored integers (a quantized or corrupt export) into garbage weights silently.
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} is stored as {tensor.dtype}, the {what} "
                                  f"parameter is floating point; refusing to cast integers into weights")
        tensor = tensor.to(place)
        if tensor_hook is not None:
            tensor = tensor_hook(entry.name, tensor)
        shard[entry.name] = tensor.to(dtype)
        loaded.add(entry.name)
    if shard:
        module.load_state_dict(shard, strict=False, assign=True)
    missing = [name for name in targets if name not in loaded]
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} for the {what} ({len(missing)} missing)")
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.to(device)
    module.requires_grad_(False)
    return module.eval()


def finish_hook(tensor_hook: TensorHook | None) -> None:
    """Call `tensor_hook.finish()` when the hook has one (a fusion checks that every target was streamed)."""
    finish = getattr(tensor_hook, "finish", None)
    if finish is not None:
        finish()

