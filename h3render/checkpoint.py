"""Checkpoints: layout detection, shard streaming, built-in random models (the release registry is
`h3render.releases`, the DiT name mapping `h3render.dit_names`).

Three on-disk layouts load into the same modules (DESIGN.md §2):

* **official** (`MiniMaxAI/MiniMax-H3`): a partition folder `FL2VA/` (t2va, fl2va) holding `model_index.json` (with
  `_minimax_h3.sigma_shift_scales`), `transformer/` (sharded safetensors + `*.safetensors.index.json`, NATIVE names:
  q/k/v rows interleaved per head in `attn.qkv_proj`, `mlp.fc1` gate-first), `text_encoder/`, `tokenizer/`,
  `processor/`, `video_vae/`, `audio_vae/`.
* **diffusers**: `model_index.json`, `transformer/` (diffusers names: separate `to_q/to_k/to_v`, `ff.net.0.proj`
  value-first), `vae/`, `audio_vae/`, `scheduler/`, `audio_scheduler/`, `text_encoder/`, `tokenizer/`.
* **single file** (ComfyUI): one transformer `.safetensors`, native names but q/k/v STACKED `[q; k; v]`.

Assumption (not confirmed against the released files): the official `video_vae/` and `audio_vae/` folders hold
diffusers-named weights and a diffusers `config.json`, as the diffusers layout's `vae/` and `audio_vae/` do.

Loading builds every module with its parameters on the meta device (buffers are computed normally), then streams
the checkpoint tensor by tensor straight to the target device, casts each to the dtype the module's precision policy
gives it, and assigns it shard by shard with `load_state_dict(assign=True)`; no full-precision copy of a model ever
sits in host RAM. Loading is strict: a missing, unexpected, repeated or mis-shaped tensor, a shard named in an index
but absent, or an unreadable safetensors header raises `CheckpointError` naming the file and tensor.

The built-in random models ("tiny", "small") are made the same way from a deterministic per-tensor generator, so
`build_random(...)` in memory and `make_checkpoint(...)` on disk give identical weights for the same seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from h3render.dit_names import (FC1_NATIVE, IGNORED_DIT_TENSORS, QKV_DIFFUSERS, QKV_NATIVE, dit_name_from_diffusers,
                                interleave_qkv, swap_halves)
from h3render.errors import CheckpointError
from h3render.models.audio_vae import AudioVAE, AudioVAEConfig
from h3render.models.dit import DiT, DiTConfig
from h3render.models.text_encoder import TextEncoder
from h3render.models.video_vae import VideoVAE, VideoVAEConfig
from h3render.releases import BUILTIN, RELEASES, Release

PARTS = ("dit", "video_vae", "audio_vae", "text_encoder")



# ---------------------------------------------------------------------------------------------------------------------
# Tensor sources: (file, name, loader) entries, read lazily so skipped tensors are never read.


class Entry(NamedTuple):
    """One checkpoint tensor: the file it lives in, its name there, and a loader returning it (on the device the
    source was opened for, in its stored dtype)."""

    file: str
    name: str
    load: Callable[[], Tensor]


def _open(path: Path, device: torch.device, tensor: str | None = None):
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        # Opened for the target device, safetensors copies each tensor straight there (no host-RAM staging copy).
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError subclasses
        what = f" (holding tensor {tensor!r})" if tensor else ""
        raise CheckpointError(f"{path}: unreadable safetensors header{what}: {exc}") from None


def _file_entries(path: Path, device: torch.device, expect: Collection[str] | None = None) -> Iterator[Entry]:
    """Entries of one safetensors file; with `expect` (the names an index assigns to it), check both ways."""
    handle = _open(path, device, tensor=next(iter(expect), None) if expect else None)
    names = list(handle.keys())
    if expect is not None:
        absent = sorted(set(expect) - set(names))
        if absent:
            raise CheckpointError(f"{path}: tensor {absent[0]!r} is listed in the index but absent from this shard "
                                  f"({len(absent)} absent)")
        extra = sorted(set(names) - set(expect))
        if extra:
            raise CheckpointError(f"{path}: tensor {extra[0]!r} is in this shard but not in the index")
    for name in names:
        yield Entry(str(path), name, functools.partial(handle.get_tensor, name))


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
        weight_map = _read_json(index_path).get("weight_map")
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
            yield from _file_entries(directory / shard, device, expect=names)
        return
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights")
    if len(files) > 1:
        raise CheckpointError(f"{directory}: several *.safetensors files {[p.name for p in files]} and no index")
    yield from _file_entries(files[0], device)


def weights_where(folder: str | Path) -> str:
    """The file naming a folder's tensors, for messages: its index, its single weights file, or the folder."""
    folder = Path(folder)
    if folder.is_file():
        return str(folder)
    found = sorted(folder.glob("*.safetensors.index.json")) or sorted(folder.glob("*.safetensors"))
    return str(found[0]) if len(found) == 1 else str(folder)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------------------------------------------------
# DiT entry converters: every layout becomes native-named entries.


def _native_dit_entries(entries: Iterable[Entry]) -> Iterator[Entry]:
    for entry in entries:
        if entry.name not in IGNORED_DIT_TENSORS:
            yield entry


def _stacked_dit_entries(entries: Iterable[Entry], config: DiTConfig) -> Iterator[Entry]:
    """ComfyUI single file: strip a `model.diffusion_model.` prefix; re-order stacked `[q; k; v]` to interleaved."""
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    for entry in entries:
        name = entry.name.removeprefix("model.diffusion_model.")
        if name in IGNORED_DIT_TENSORS:
            continue
        if name.endswith(QKV_NATIVE):
            def load(entry=entry) -> Tensor:
                stacked = entry.load()
                if stacked.ndim != 2 or stacked.shape[0] != 3 * heads * head_dim:
                    return stacked  # wrong shape: let the strict shape check report it
                return interleave_qkv(*stacked.chunk(3, dim=0), heads, head_dim)
            yield Entry(entry.file, name, load)
        else:
            yield Entry(entry.file, name, entry.load)


def _diffusers_dit_entries(entries: Iterable[Entry], config: DiTConfig) -> Iterator[Entry]:
    """Diffusers names -> native: to_q/to_k/to_v fused per head once all three are seen; ff value-first -> fc1
    gate-first."""
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    pending: dict[str, dict[int, Entry]] = {}
    for entry in entries:
        if entry.name in IGNORED_DIT_TENSORS:
            continue
        try:
            native, slot = dit_name_from_diffusers(entry.name)
        except CheckpointError:
            raise CheckpointError(f"{entry.file}: unexpected tensor {entry.name!r} (not a diffusers "
                                  f"MiniMaxH3Transformer3DModel name)") from None
        if slot is None:
            load = entry.load
            if native.endswith(FC1_NATIVE):
                load = functools.partial(lambda e: swap_halves(e.load()), entry)
            yield Entry(entry.file, native, load)
            continue
        parts = pending.setdefault(native, {})
        if slot in parts:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} appears twice")
        parts[slot] = entry
        if len(parts) == 3:
            del pending[native]
            q, k, v = (parts[i] for i in range(3))

            def load(q=q, k=k, v=v) -> Tensor:
                tensors = [e.load() for e in (q, k, v)]
                expected = (heads * head_dim,)
                for e, t in zip((q, k, v), tensors):
                    if t.ndim != 2 or tuple(t.shape[:1]) != expected:
                        raise CheckpointError(f"{e.file}: tensor {e.name!r} has shape {tuple(t.shape)}, the DiT "
                                              f"config expects [{heads * head_dim}, in]")
                return interleave_qkv(*tensors, heads, head_dim)
            yield Entry(q.file, native, load)
    for native, parts in pending.items():
        have = next(iter(parts.values()))
        lacking = [QKV_DIFFUSERS[i] for i in range(3) if i not in parts]
        missing = have.name.rsplit("attn.", 1)[0] + lacking[0]
        raise CheckpointError(f"{have.file}: missing tensor {missing!r} (its q/k/v siblings are present)")


# ---------------------------------------------------------------------------------------------------------------------
# Empty modules and strict streaming.


@contextlib.contextmanager
def _parameters_on_meta():
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


def _cast_parameters_(module: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter (not buffer) to `dtype`: transformers keeps Qwen's RoPE `inv_freq` float32 in bf16 models."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.is_floating_point():
                sub._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=False)


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
) -> nn.Module:
    """Strictly load `entries` into an empty (meta-parameter) `module`, shard by shard, with `assign=True`.

    Each tensor goes straight to `device`, through `tensor_hook(name, tensor)` when given (stored dtype in, any dtype
    out), and is cast to the dtype of the module's own (meta) parameter: the module's precision policy decides.

    Args:
        what: the component, for messages ("DiT", "video VAE", ...); where: the folder/file, for missing tensors.
        skip: names present in the checkpoint that this module does not build (never read).

    Raises:
        CheckpointError: unexpected, repeated, mis-shaped or missing tensor, naming the file and tensor.
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
        tensor = entry.load()
        shape, dtype = targets[entry.name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {tuple(tensor.shape)}, the "
                                  f"{what} config expects {shape}")
        tensor = tensor.to(device)
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


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint info (configs only, no weights).


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint is, read from its JSON configs alone (cheap: for validating job manifests before any
    weights load).

    Attributes:
        path: what was given.
        layout: "official" | "diffusers" | "single-file" | "builtin".
        release: the checkpoint's own configs, shifts and frame limits; canvas, duration, sigma-point and tiling
            defaults from the registry entry with the same DiT architecture (else "released").
        transformer: folder (or file) of the DiT weights; None for a built-in.
        transformer_names: "native" (official), "diffusers", or "native-stacked" (single file).
        text_encoder, tokenizer, video_vae, audio_vae: component folders; None for a built-in / single file.
        random_model: "tiny" / "small" for a built-in or a checkpoint written by `make_checkpoint` (its
            `_minimax_h3.h3render_random` / `h3render_random` metadata), else None: a FastH3 adapter for it states
            h3render's synthetic base model rather than the release's.
    """

    path: str
    layout: str
    release: Release
    transformer: str | None = None
    transformer_names: str = "native"
    text_encoder: str | None = None
    tokenizer: str | None = None
    video_vae: str | None = None
    audio_vae: str | None = None
    random_model: str | None = None

    @property
    def config_hash(self) -> str:
        return self.release.config_hash()

    @property
    def video_shift(self) -> float:
        return self.release.video_shift

    @property
    def audio_shift(self) -> float:
        return self.release.audio_shift

    @property
    def min_frames(self) -> int:
        return self.release.min_frames

    @property
    def max_frames(self) -> int:
        return self.release.max_frames

    def limits(self):
        """`h3render.jobs.Limits` of this checkpoint."""
        return self.release.limits()


def _registry_defaults(dit: DiTConfig) -> Release:
    for release in RELEASES.values():
        if release.dit == dit:
            return release
    return RELEASES["released"]


def _config(path: Path, parse: Callable[[dict], Any]) -> Any:
    data = _read_json(path)
    try:
        return parse(data)
    except CheckpointError:
        raise
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: bad config: {exc}") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _official_shifts(meta: Mapping[str, Any], where: str) -> tuple[float, float]:
    """`_minimax_h3.sigma_shift_scales` as `{"video": v, "audio": a}` or `[v, a]`."""
    scales = meta.get("sigma_shift_scales")
    if isinstance(scales, Mapping) and "video" in scales and "audio" in scales:
        return (_number(scales["video"], f"{where} _minimax_h3.sigma_shift_scales.video"),
                _number(scales["audio"], f"{where} _minimax_h3.sigma_shift_scales.audio"))
    if isinstance(scales, (list, tuple)) and len(scales) == 2:
        return (_number(scales[0], f"{where} _minimax_h3.sigma_shift_scales[0]"),
                _number(scales[1], f"{where} _minimax_h3.sigma_shift_scales[1]"))
    raise CheckpointError(f"{where}: _minimax_h3.sigma_shift_scales must be {{\"video\": v, \"audio\": a}} or "
                          f"[v, a], got {scales!r}")


def _frame_limits(meta: Mapping[str, Any], default: Release, where: str) -> tuple[int, int]:
    limits = meta.get("frame_limits")
    if limits is None:
        return default.min_frames, default.max_frames
    ok = (isinstance(limits, Mapping) and all(isinstance(limits.get(k), int) for k in ("min", "max"))
          and 1 <= limits["min"] <= limits["max"])
    if not ok:
        raise CheckpointError(f"{where}: _minimax_h3.frame_limits must be {{\"min\": a, \"max\": b}}, got {limits!r}")
    return limits["min"], limits["max"]


def _read_layer(meta: Mapping[str, Any], text_encoder: Mapping[str, Any], where: str) -> int:
    layer = meta.get("text_encoder_layer", 50)  # released: hidden_states[50]
    depth = text_encoder.get("text_config", {}).get("num_hidden_layers")
    if not isinstance(layer, int) or not isinstance(depth, int) or not 1 <= layer < depth:
        raise CheckpointError(f"{where}: text_encoder_layer {layer!r} must be in 1..{depth}-1 for this "
                              f"{depth}-layer text encoder")
    return layer


def _find_partition(root: Path) -> tuple[str, Path]:
    if (root / "FL2VA" / "model_index.json").is_file():
        return "official", root / "FL2VA"
    if (root / "model_index.json").is_file():
        if (root / "video_vae").is_dir():
            return "official", root
        if (root / "vae").is_dir():
            return "diffusers", root
    raise CheckpointError(f"{root}: not a MiniMax-H3 checkpoint (expected FL2VA/model_index.json (official) or "
                          f"model_index.json with vae/ (diffusers))")


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Identify a checkpoint and read its configs, without touching any weights.

    Args:
        path: "tiny" / "small" (built-in random models); an official repository root or its `FL2VA/` partition; a
            diffusers folder; or a single-file transformer `.safetensors` (its header only is read).

    Raises:
        CheckpointError: unknown layout, a missing or malformed config (naming the file and field).
    """
    if isinstance(path, str) and path in BUILTIN:
        return CheckpointInfo(path=path, layout="builtin", release=RELEASES[path], random_model=path)
    root = Path(path)
    if root.suffix == ".safetensors":
        if not root.is_file():
            raise CheckpointError(f"{root}: missing")
        release = dataclasses.replace(_single_file_release(root), name=str(root))
        origin = (_open(root, torch.device("cpu")).metadata() or {}).get("h3render_random")
        return CheckpointInfo(path=str(root), layout="single-file", release=release, transformer=str(root),
                              transformer_names="native-stacked", random_model=origin)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder (or built-in name: {', '.join(BUILTIN)})")
    layout, part = _find_partition(root)
    index_path = part / "model_index.json"
    index = _read_json(index_path)
    meta = index.get("_minimax_h3", {})
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"{index_path}: _minimax_h3 must be an object")
    names = {"official": ("video_vae", "audio_vae", "native"), "diffusers": ("vae", "audio_vae", "diffusers")}
    video_dir, audio_dir, transformer_names = names[layout]

    dit = _config(part / "transformer" / "config.json", DiTConfig.from_dict)
    video_vae = _config(part / video_dir / "config.json", VideoVAEConfig.from_dict)
    audio_vae = _config(part / audio_dir / "config.json", AudioVAEConfig.from_dict)
    text_path = part / "text_encoder" / "config.json"
    text_encoder = _read_json(text_path)
    if not isinstance(text_encoder.get("text_config"), Mapping):
        raise CheckpointError(f"{text_path}: no text_config (expected a Qwen3-VL config)")
    if layout == "official":
        video_shift, audio_shift = _official_shifts(meta, str(index_path))
    else:
        shifts = []
        for folder in ("scheduler", "audio_scheduler"):
            cfg_path = part / folder / "scheduler_config.json"
            shifts.append(_number(_read_json(cfg_path).get("shift"), f"{cfg_path} shift"))
        video_shift, audio_shift = shifts
    defaults = _registry_defaults(dit)
    min_frames, max_frames = _frame_limits(meta, defaults, str(index_path))
    release = dataclasses.replace(
        defaults, name=str(root), dit=dit, video_vae=video_vae, audio_vae=audio_vae, text_encoder=text_encoder,
        text_read_layer=_read_layer(meta, text_encoder, str(index_path)), video_shift=video_shift,
        audio_shift=audio_shift, min_frames=min_frames, max_frames=max_frames,
    )
    return CheckpointInfo(
        path=str(root), layout=layout, release=release, transformer=str(part / "transformer"),
        transformer_names=transformer_names, text_encoder=str(part / "text_encoder"),
        tokenizer=str(part / "tokenizer"), video_vae=str(part / video_dir), audio_vae=str(part / audio_dir),
        random_model=(meta.get("h3render_random") or {}).get("config"),
    )


def dit_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native tensor names and shapes of a DiT config (built on the meta device)."""
    with torch.device("meta"):
        model = DiT(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _single_file_release(path: Path) -> Release:
    """The registry release whose DiT matches a single file: by its `config` metadata when present, else by the
    tensor shapes in its header."""
    handle = _open(path, torch.device("cpu"))
    metadata = handle.metadata() or {}
    if "config" in metadata:
        try:
            config = DiTConfig.from_dict(json.loads(metadata["config"]))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad `config` metadata: {exc}") from None
        return dataclasses.replace(_registry_defaults(config), dit=config)
    shapes = {}
    for name in handle.keys():
        name_native = name.removeprefix("model.diffusion_model.")
        if name_native not in IGNORED_DIT_TENSORS:
            shapes[name_native] = tuple(handle.get_slice(name).get_shape())
    for release in RELEASES.values():
        if dit_shapes(release.dit) == shapes:
            return release
    raise CheckpointError(f"{path}: tensor names/shapes match no known DiT config ({', '.join(RELEASES)}) and the "
                          f"file carries no `config` metadata")


# ---------------------------------------------------------------------------------------------------------------------
# Components.


@dataclass
class Components:
    """The loaded model parts (None for a part not asked for) and the checkpoint they came from."""

    dit: DiT | None
    video_vae: VideoVAE | None
    audio_vae: AudioVAE | None
    text_encoder: TextEncoder | None
    info: CheckpointInfo


def _empty_dit(config: DiTConfig, dtype: torch.dtype) -> DiT:
    with _parameters_on_meta():
        model = DiT(config)
    return model.apply_precision_(dtype)


def _empty_video_vae(release: Release, dtype: torch.dtype) -> VideoVAE:
    with _parameters_on_meta():
        model = VideoVAE(release.video_vae, tiling=release.vae_tiling)
    return model.apply_precision_(dtype)


def _empty_audio_vae(release: Release) -> AudioVAE:
    # Released audio VAE: fp32 always (it degrades in bf16, DESIGN.md §1).
    with _parameters_on_meta():
        model = AudioVAE(release.audio_vae)
    _cast_parameters_(model, torch.float32)
    return model


def _empty_text_encoder(release: Release, dtype: torch.dtype, tokenizer) -> TextEncoder:
    with _parameters_on_meta():
        model = TextEncoder(release.text_config, release.text_read_layer, tokenizer=tokenizer)
    _cast_parameters_(model, dtype)
    return model


# Prefixes under which Qwen3-VL checkpoints store the language model: transformers >= 4.57
# (`Qwen3VLForConditionalGeneration.save_pretrained`) and the older `language_model.model.` export.
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def _text_entries(entries: Iterable[Entry], read_layer: int) -> Iterator[Entry]:
    """Language-model tensors with the prefix removed; the vision tower, LM head, final norm and layers past
    `read_layer` are renamed to `_skip.*` so `stream_into` drops them unread."""
    for entry in entries:
        prefix = next((p for p in _TEXT_PREFIXES if entry.name.startswith(p)), None)
        if prefix is None:
            unused = entry.name.startswith(("model.visual.", "visual.", "lm_head.", "language_model.lm_head."))
            yield Entry(entry.file, ("_skip." if unused else "") + entry.name, entry.load)
            continue
        name = entry.name[len(prefix):]
        if name == "norm.weight":
            name = "_skip." + name
        elif name.startswith("layers."):
            index = name.split(".", 2)[1]
            if index.isdigit() and int(index) >= read_layer:
                name = "_skip." + name
        yield Entry(entry.file, name, entry.load)


def _is_skipped(name: str) -> bool:
    return name.startswith("_skip.")


def _finish_hook(tensor_hook: TensorHook | None) -> None:
    finish = getattr(tensor_hook, "finish", None)
    if finish is not None:
        finish()


def load_dit(info: CheckpointInfo, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             tensor_hook: TensorHook | None = None) -> DiT:
    """Load the DiT of a (non-builtin) checkpoint.

    Args:
        info: from `read_checkpoint_info`.
        dtype: block-stack dtype; `DiT.apply_precision_` keeps the fp32 islands fp32.
        tensor_hook: optional `hook(native_name, tensor) -> tensor` applied to every DiT tensor while streaming
            (e.g. FastH3 fusion), then `hook.finish()` if it has one.

    Raises:
        CheckpointError: as `stream_into`.
    """
    config = info.release.dit
    model = _empty_dit(config, dtype)
    source = Path(info.transformer)
    if info.transformer_names == "native-stacked":
        entries = _stacked_dit_entries(_file_entries(source, torch.device(device)), config)
    else:
        raw = safetensors_entries(source, device)
        entries = (_native_dit_entries(raw) if info.transformer_names == "native"
                   else _diffusers_dit_entries(raw, config))
    stream_into(model, entries, device, what="DiT", where=weights_where(source), tensor_hook=tensor_hook)
    _finish_hook(tensor_hook)
    return model


def load_components(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parts: Collection[str] = PARTS,
    tensor_hook: TensorHook | None = None,
    transformer_file: str | Path | None = None,
    seed: int = 0,
) -> Components:
    """Load a checkpoint (or build a built-in random model) onto `device`.

    Args:
        path: as `read_checkpoint_info`. A single-file checkpoint holds only the DiT: ask for `parts=("dit",)`.
        dtype: compute dtype of the DiT block stack, the video-VAE decoder linears and the text encoder; the
            release's fp32 islands stay fp32 and the audio VAE is always fp32.
        parts: which of "dit", "video_vae", "audio_vae", "text_encoder" to load (the others are None).
        tensor_hook: applied to every DiT tensor while streaming, then `finish()` (see `load_dit`).
        transformer_file: a single-file transformer replacing the checkpoint's own; its architecture must match.
        seed: weights seed of a built-in model ("tiny", "small"); ignored otherwise.

    Raises:
        CheckpointError: layout, config or tensor problems, naming the file and tensor; an unknown part.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise CheckpointError(f"unknown component {unknown[0]!r} (choose from {', '.join(PARTS)})")
    info = read_checkpoint_info(path)
    if info.layout == "builtin":
        if transformer_file is not None:
            raise CheckpointError(f"{transformer_file}: a built-in model takes no transformer file")
        return build_random(info.path, seed=seed, device=device, dtype=dtype, parts=parts, tensor_hook=tensor_hook)
    if info.layout == "single-file" and set(parts) - {"dit"}:
        raise CheckpointError(f"{info.path}: a single-file checkpoint holds only the transformer; load it with "
                              f"parts=('dit',) or as transformer_file= of a full checkpoint")
    if transformer_file is not None:
        file_info = read_checkpoint_info(transformer_file)
        if file_info.layout != "single-file":
            raise CheckpointError(f"{transformer_file}: transformer_file must be a single .safetensors file")
        if file_info.release.dit != info.release.dit:
            raise CheckpointError(f"{transformer_file}: DiT architecture differs from {info.path}'s transformer")
        info = dataclasses.replace(info, transformer=file_info.transformer, transformer_names="native-stacked")

    release = info.release
    dit = video_vae = audio_vae = text_encoder = None
    if "dit" in parts:
        dit = load_dit(info, device, dtype, tensor_hook)
    if "video_vae" in parts:
        video_vae = _empty_video_vae(release, dtype)
        stream_into(video_vae, safetensors_entries(Path(info.video_vae), device), device, what="video VAE",
                    where=weights_where(info.video_vae))
    if "audio_vae" in parts:
        audio_vae = _empty_audio_vae(release)
        stream_into(audio_vae, safetensors_entries(Path(info.audio_vae), device), device, what="audio VAE",
                    where=weights_where(info.audio_vae))
    if "text_encoder" in parts:
        text_encoder = _empty_text_encoder(release, dtype, load_tokenizer(info.tokenizer))
        entries = _text_entries(safetensors_entries(Path(info.text_encoder), device), release.text_read_layer)
        stream_into(text_encoder, entries, device, what="text encoder",
                    where=weights_where(info.text_encoder), skip=_is_skipped)
    return Components(dit, video_vae, audio_vae, text_encoder, info)


def load_tokenizer(folder: str | Path):
    """The prompt tokenizer of a checkpoint (`tokenizer/`); only the tokenizer, never the vision processor.

    Raises:
        CheckpointError: the folder is missing or transformers cannot read it.
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: tokenizer folder missing")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: cannot read the tokenizer: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Built-in random models (also what `make_checkpoint` writes).

# Storage dtypes of the release: DiT bf16 except the fp32 islands (patch projections, time embedder, output heads);
# text encoder bf16; both VAEs fp32 (DESIGN.md §1).


def dit_storage_dtype(name: str) -> torch.dtype:
    """Release storage dtype of a native DiT tensor."""
    return torch.float32 if name.startswith(tuple(m + "." for m in DiT.FP32_MODULES)) else torch.bfloat16


STORAGE_DTYPES: dict[str, Callable[[str], torch.dtype]] = {
    "dit": dit_storage_dtype,
    "text_encoder": lambda name: torch.bfloat16,
    "video_vae": lambda name: torch.float32,
    "audio_vae": lambda name: torch.float32,
}


def random_tensor(component: str, name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """Deterministic random tensor for one checkpoint tensor, rounded to the release storage dtype.

    Each tensor has its own generator, seeded from `(seed, component, name)`, so a subset of a model (the text
    encoder without its vision tower) gets the same values as the whole. Scale: biases N(0, 0.02²), gains (1-D
    weights, weight-norm `weight_g`) 1 + N(0, 0.1²), matrices and kernels N(0, 1/fan_in).

    Args:
        component: "dit" | "text_encoder" | "video_vae" | "audio_vae"; name: the tensor's name in the checkpoint
            (native DiT names, `model.language_model.*` text names, diffusers VAE names).

    Returns:
        CPU tensor of `shape` in the storage dtype.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{component}/{name}".encode()))
    x = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith("bias"):
        x = 0.02 * x
    elif len(shape) <= 1 or name.endswith("weight_g"):
        x = 1.0 + 0.1 * x
    else:
        x = x / math.sqrt(math.prod(shape[1:]))
    return x.to(STORAGE_DTYPES[component](name))


def _template(component: str, release: Release) -> nn.Module:
    """One component as stored in a checkpoint, parameters on meta, persistent buffers computed. The text encoder
    is the whole Qwen3-VL (vision tower, all layers, final norm, LM head), as released."""
    with _parameters_on_meta():
        if component == "dit":
            return DiT(release.dit)
        if component == "video_vae":
            return VideoVAE(release.video_vae)
        if component == "audio_vae":
            return AudioVAE(release.audio_vae)
        if component == "text_encoder":
            from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

            return Qwen3VLForConditionalGeneration(Qwen3VLConfig.from_dict(dict(release.text_encoder)))
    raise ValueError(f"unknown component {component!r}")


def random_entries(component: str, release: Release, seed: int) -> Iterator[Entry]:
    """Entries of a built-in random component in checkpoint naming and module order, generated on read.

    Parameters are `random_tensor`s; persistent buffers (the audio VAE's anti-aliasing filters and zero k-bias)
    carry the values the module computes, as a saved checkpoint does."""
    where = f"<builtin {release.name} seed {seed}>"
    template = _template(component, release)
    storage = STORAGE_DTYPES[component]
    for name, tensor in template.state_dict().items():
        if tensor.is_meta:
            load = functools.partial(random_tensor, component, name, tuple(tensor.shape), seed)
        else:
            load = functools.partial(lambda t, d: t.to(d), tensor, storage(name))
        yield Entry(where, name, load)


# A fixed corpus for the built-in byte-level BPE tokenizer (no downloads; same merges every time).
_TOKENIZER_CORPUS = (
    "A red fox runs through a snowy forest at dawn, its breath visible in the cold air.",
    "Waves crash against black rocks while gulls cry overhead and the wind carries salt spray.",
    "A street musician plays a slow song on a violin; people stop, listen, and drop coins in the case.",
    "Rain falls on a quiet city at night. Neon signs reflect in the puddles, a car passes, tyres hissing.",
    "The camera pans over green hills to a small white house. A dog barks; children laugh in the distance.",
    "Close-up of hands kneading dough on a wooden table, flour in the air, a kettle whistling behind.",
)


@functools.lru_cache(maxsize=None)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    return tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in memory on a fixed corpus (any text encodes; ids < `vocab_size`),
    as a transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tiny_tokenizer_json(vocab_size)))


def build_random(
    name: str = "tiny",
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parts: Collection[str] = PARTS,
    tensor_hook: TensorHook | None = None,
) -> Components:
    """A built-in random model ("tiny" or "small") in memory, from a fixed seed; no files, no downloads.

    Same weights as `make_checkpoint(out, name, seed=seed)` writes (values rounded to the release storage
    dtypes), loaded through the same strict streaming path.

    Raises:
        CheckpointError: an unknown name.
    """
    if name not in BUILTIN:
        raise CheckpointError(f"no built-in model {name!r} (choose from {', '.join(BUILTIN)})")
    release = RELEASES[name]
    info = CheckpointInfo(path=name, layout="builtin", release=release, random_model=name)
    where = f"<builtin {name}>"
    dit = video_vae = audio_vae = text_encoder = None
    if "dit" in parts:
        dit = stream_into(_empty_dit(release.dit, dtype), random_entries("dit", release, seed), device,
                          what="DiT", where=where, tensor_hook=tensor_hook)
        _finish_hook(tensor_hook)
    if "video_vae" in parts:
        video_vae = stream_into(_empty_video_vae(release, dtype), random_entries("video_vae", release, seed),
                                device, what="video VAE", where=where)
    if "audio_vae" in parts:
        audio_vae = stream_into(_empty_audio_vae(release), random_entries("audio_vae", release, seed), device,
                                what="audio VAE", where=where)
    if "text_encoder" in parts:
        vocab = release.text_config.vocab_size
        text_encoder = _empty_text_encoder(release, dtype, tiny_tokenizer(vocab))
        entries = _text_entries(random_entries("text_encoder", release, seed), release.text_read_layer)
        stream_into(text_encoder, entries, device, what="text encoder", where=where, skip=_is_skipped)
    return Components(dit, video_vae, audio_vae, text_encoder, info)


def build_tiny(seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> Components:
    """The built-in tiny random model; see `build_random`."""
    return build_random("tiny", seed=seed, device=device, dtype=dtype, **kwargs)
