"""The three on-disk checkpoint layouts: detection, configs (`read_checkpoint_info`, no weights read) and each
layout's DiT tensors as native-named entries (DESIGN.md §2).

* **official** (`MiniMaxAI/MiniMax-H3`): a partition folder `FL2VA/` (t2va, fl2va) holding `model_index.json` (with
  `_minimax_h3.sigma_shift_scales`), `transformer/` (sharded safetensors + `*.safetensors.index.json`, NATIVE names:
  q/k/v rows interleaved per head in `attn.qkv_proj`, `mlp.fc1` gate-first), `text_encoder/`, `tokenizer/`,
  `processor/`, `video_vae/`, `audio_vae/`.
* **diffusers**: `model_index.json`, `transformer/` (diffusers names: separate `to_q/to_k/to_v`, `ff.net.0.proj`
  value-first), `vae/`, `audio_vae/`, `scheduler/`, `audio_scheduler/`, `text_encoder/`, `tokenizer/`.
* **single file** (ComfyUI): one transformer `.safetensors`, native names but q/k/v STACKED `[q; k; v]`.

Assumption (not confirmed against the released files): the official `video_vae/` and `audio_vae/` folders hold
diffusers-named weights and a diffusers `config.json`, as the diffusers layout's `vae/` and `audio_vae/` do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.names import (FC1_NATIVE, IGNORED_DIT_TENSORS, QKV_DIFFUSERS, QKV_NATIVE,
                                       dit_name_from_diffusers, dit_shapes, interleave_qkv, native_gate_name,
                                       swap_halves)
from h3render.checkpoint.releases import BUILTIN, RELEASES, Release
from h3render.checkpoint.stream import Entry, file_entries, open_safetensors, read_json, safetensors_entries
from h3render.models.audio_vae import AudioVAEConfig
from h3render.models.dit_config import DiTConfig
from h3render.models.video_vae_config import VideoVAEConfig

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
        processor: the keyframe image processor's config file (fl2va), or None (a built-in model's is in its
            release; a checkpoint without `processor/` renders t2va only).
        transformer_ref: folder of ref2va's DiT (official `Ref2VA/transformer/` beside `FL2VA/`, diffusers
            `transformer_ref/`), in the same naming as `transformer`; None when the checkpoint has none (a built-in
            model has one, generated from its own seed; a single file never does).
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
    processor: str | None = None
    transformer_ref: str | None = None

    @property
    def recorded_path(self) -> str:
        """`path` as sidecars and resume record it: absolute (resolved, as `--transformer` is), so the same checkpoint
        named from another working directory compares equal; a built-in name as given."""
        return self.path if self.layout == "builtin" else str(Path(self.path).resolve())

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
        """`h3render.spec.Limits` of this checkpoint."""
        return self.release.limits()


def _registry_defaults(dit: DiTConfig) -> Release:
    for release in RELEASES.values():
        if release.dit == dit:
            return release
    return RELEASES["released"]


def _config(path: Path, parse: Callable[[dict], Any]) -> Any:
    data = read_json(path)
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


# Where the keyframe image processor's config lives: the official layout's `processor/preprocessor_config.json`; a
# diffusers folder's `processor/` (diffusers 0.42.1's MiniMax-H3 blocks load `ComponentSpec("processor",
# Qwen3VLProcessor)` from it) holds either that file or, as transformers 5.x `ProcessorMixin.save_pretrained`
# writes it, `processor_config.json` with the image processor's dict under "image_processor".
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _image_processor_config(part: Path) -> tuple[str | None, Mapping[str, Any] | None]:
    """(config file, the image processor's dict) of a partition, or (None, None) when it has no processor."""
    for name in _PROCESSOR_FILES:
        path = part / "processor" / name
        if not path.is_file():
            continue
        data = read_json(path)
        if name == "processor_config.json":
            data = data.get("image_processor")
            if not isinstance(data, Mapping):
                continue  # a processor_config.json beside a preprocessor_config.json, or without the images part
        if not isinstance(data.get("patch_size"), int) or not isinstance(data.get("merge_size"), int):
            raise CheckpointError(f"{path}: the image processor config needs integer patch_size and merge_size")
        return str(path), data
    return None, None


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
        release = _single_file_release(root)  # named for its registry entry, as the sidecar records it
        origin = (open_safetensors(root, torch.device("cpu")).metadata() or {}).get("h3render_random")
        return CheckpointInfo(path=str(root), layout="single-file", release=release, transformer=str(root),
                              transformer_names="native-stacked", random_model=origin)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder (or built-in name: {', '.join(BUILTIN)})")
    layout, part = _find_partition(root)
    index_path = part / "model_index.json"
    index = read_json(index_path)
    meta = index.get("_minimax_h3", {})
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"{index_path}: _minimax_h3 must be an object")
    names = {"official": ("video_vae", "audio_vae", "native"), "diffusers": ("vae", "audio_vae", "diffusers")}
    video_dir, audio_dir, transformer_names = names[layout]

    dit = _config(part / "transformer" / "config.json", DiTConfig.from_dict)
    video_vae = _config(part / video_dir / "config.json", VideoVAEConfig.from_dict)
    audio_vae = _config(part / audio_dir / "config.json", AudioVAEConfig.from_dict)
    text_path = part / "text_encoder" / "config.json"
    text_encoder = read_json(text_path)
    if not isinstance(text_encoder.get("text_config"), Mapping):
        raise CheckpointError(f"{text_path}: no text_config (expected a Qwen3-VL config)")
    if layout == "official":
        video_shift, audio_shift = _official_shifts(meta, str(index_path))
    else:
        shifts = []
        for folder in ("scheduler", "audio_scheduler"):
            cfg_path = part / folder / "scheduler_config.json"
            shifts.append(_number(read_json(cfg_path).get("shift"), f"{cfg_path} shift"))
        video_shift, audio_shift = shifts
    defaults = _registry_defaults(dit)
    min_frames, max_frames = _frame_limits(meta, defaults, str(index_path))
    processor_file, image_processor = _image_processor_config(part)
    ref = part.parent / "Ref2VA" / "transformer" if layout == "official" else part / "transformer_ref"
    release = dataclasses.replace(
        defaults, dit=dit, video_vae=video_vae, audio_vae=audio_vae, text_encoder=text_encoder,
        text_read_layer=_read_layer(meta, text_encoder, str(index_path)), video_shift=video_shift,
        audio_shift=audio_shift, min_frames=min_frames, max_frames=max_frames, image_processor=image_processor,
    )
    return CheckpointInfo(
        path=str(root), layout=layout, release=release, transformer=str(part / "transformer"),
        transformer_names=transformer_names, text_encoder=str(part / "text_encoder"),
        tokenizer=str(part / "tokenizer"), video_vae=str(part / video_dir), audio_vae=str(part / audio_dir),
        random_model=(meta.get("h3render_random") or {}).get("config"), processor=processor_file,
        transformer_ref=str(ref) if (ref / "config.json").is_file() else None,
    )


def with_transformer_file(info: CheckpointInfo, transformer_file: str | Path) -> CheckpointInfo:
    """`info` with its DiT weights taken from a single-file transformer (ComfyUI layout, q/k/v stacked) instead of its
    own `transformer/`; reads the file's header only, so `h3render --transformer` runs it before any weights load.

    Raises:
        CheckpointError: the file is missing, a folder, not named `*.safetensors` (the suffix is how
            `read_checkpoint_info` tells a single file from a folder), has an unreadable header, or holds a DiT whose
            architecture differs from `info`'s; the message starts with the file's path.
    """
    path = Path(transformer_file)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file")
    if not path.is_file():
        raise CheckpointError(f"{path}: not a file; a transformer file is one single-file DiT (.safetensors)")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: not a .safetensors file; a single-file DiT must be named *.safetensors")
    file_info = read_checkpoint_info(path)
    if file_info.release.dit != info.release.dit:
        raise CheckpointError(f"{path}: DiT architecture differs from {info.path}'s transformer")
    return dataclasses.replace(info, transformer=file_info.transformer, transformer_names="native-stacked")


def _single_file_release(path: Path) -> Release:
    """The registry release whose DiT matches a single file: by its `config` metadata when present, else by the
    tensor shapes in its header."""
    handle = open_safetensors(path, torch.device("cpu"))
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
# DiT entry converters: every layout becomes native-named entries.


def _native_dit_entries(entries: Iterable[Entry]) -> Iterator[Entry]:
    """Native names as they are; a full FastH3 export's VSA gates (`attn.to_gate_compress`) as `attn.gate_proj`."""
    for entry in entries:
        if entry.name not in IGNORED_DIT_TENSORS:
            yield Entry(entry.file, native_gate_name(entry.name), entry.load)


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
            yield Entry(entry.file, native_gate_name(name), entry.load)


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


def dit_entries(info: CheckpointInfo, device: torch.device | str = "cpu") -> Iterator[Entry]:
    """The DiT tensors of a (non-builtin) checkpoint as native-named entries in file order, whatever its layout.

    Raises:
        CheckpointError: as `safetensors_entries`; a diffusers name outside the DiT, a repeated or lone q/k/v.
    """
    source, config = Path(info.transformer), info.release.dit
    if info.transformer_names == "native-stacked":
        return _stacked_dit_entries(file_entries(source, torch.device(device)), config)
    raw = safetensors_entries(source, device)
    if info.transformer_names == "native":
        return _native_dit_entries(raw)
    return _diffusers_dit_entries(raw, config)
