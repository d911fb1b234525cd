"""What a checkpoint is, from its JSON configs and safetensors headers alone (no weights read, no torch):
layout detection (official / diffusers / single-file, or a built-in name), `CheckpointInfo` and
`with_transformer_file`. The front end reads it before anything heavy is imported, so that a manifest or option
mistake answers at once; `h3render.checkpoint.layouts` turns each layout's DiT tensors into entries.

The layouts themselves are described in `h3render.checkpoint.layouts`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.releases import BUILTIN, RELEASES, Release
from h3render.models.audio_vae_config import AudioVAEConfig
from h3render.models.dit_config import DiTConfig
from h3render.models.video_vae_config import VideoVAEConfig


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a config file.

    Raises:
        CheckpointError: the file is missing, not JSON, or not an object.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def safetensors_header(path: Path):
    """A safetensors file's header (names, shapes, metadata) through safetensors' numpy handle: torch-free.

    Raises:
        CheckpointError: the header cannot be read.
    """
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError subclasses
        raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from None


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
    """`parse(data)` of a config file; a missing key takes the config dataclass's default (the released value). When
    the result is inconsistent, the error names the keys the file does not state, whose defaults did not fit."""
    data = read_json(path)
    try:
        return parse(data)
    except CheckpointError:
        raise
    except (TypeError, ValueError) as exc:
        cls = getattr(parse, "__self__", None)  # `DiTConfig.from_dict` etc.: the dataclass
        missing = ([f.name for f in dataclasses.fields(cls) if f.name not in data] if dataclasses.is_dataclass(cls)
                   else [])
        note = (f" (not stated: {', '.join(missing)}; the released model's default was used, which does not fit the "
                f"rest)") if missing else ""
        raise CheckpointError(f"{path}: bad config: {exc}{note}") from None


def _header_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a model folder's weights (its index's shards, or its one file), from the headers."""
    from safetensors import safe_open

    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted({folder / shard for shard in read_json(indexes[0]).get("weight_map", {}).values()} if indexes
                   else folder.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            shapes.update((key, tuple(handle.get_slice(key).get_shape())) for key in handle.keys())
    return shapes


def _dit_shapes(dit: DiTConfig, names: str) -> dict[str, tuple[int, ...]]:
    """The DiT tensors `dit` implies, in the checkpoint's naming ("native" or "diffusers")."""
    import torch  # here only: a config that states every key (every written checkpoint) never needs it

    from h3render.checkpoint.names import dit_shapes, dit_state_dict_to_diffusers

    expected = dit_shapes(dit)
    if names == "diffusers":
        meta = {name: torch.empty(shape, device="meta") for name, shape in expected.items()}
        expected = {name: tuple(t.shape) for name, t in dit_state_dict_to_diffusers(meta, dit).items()}
    return expected


def _module_shapes(component: str, release: Release) -> dict[str, tuple[int, ...]]:
    """The tensors a VAE of `release`'s config stores (its module built on meta: no memory, no data; torch is
    imported only for a config that leaves keys unstated)."""
    from h3render.checkpoint.builtin import _template

    return {name: tuple(t.shape) for name, t in _template(component, release).state_dict().items()}


def _check_unstated_keys(path: Path, cls: type, folder: Path, expected: Callable[[], Mapping[str, tuple]]) -> None:
    """A component `config.json` that leaves keys to their defaults (the released model's) must still fit its
    weights: the tensors the config implies (`expected()`) are compared with the shapes the weight headers state (no
    data read). Without this, a tiny checkpoint lacking the DiT's `num_layers` passed every check as a 50-block DiT
    and failed each job at load ("missing tensor 'blocks.2.norm1.weight'"). A config stating every key is left to
    the loader, as before.

    Raises:
        CheckpointError: naming the config file, the keys it does not state, and the first tensor that does not fit.
    """
    data = read_json(path)
    # A FastVideo-only field left out means "not that variant" (DiT `adaln_rank`: not a Trim), not a default guessed
    unstated = [f.name for f in dataclasses.fields(cls)
                if f.name not in data and f.name not in getattr(cls, "FASTVIDEO_FIELDS", ())]
    if not unstated:
        return
    try:
        stored = _header_shapes(folder)
    except Exception:  # an unreadable index or header: the loader names it, with its own message
        return
    try:
        implied = expected()
    except (ValueError, TypeError, RuntimeError) as exc:  # e.g. GroupNorm: channels not divisible by the groups
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path}: not stated: {', '.join(unstated)}; the released model's defaults used for them "
                              f"make no valid model with the rest: {first}") from None
    absent = [name for name in implied if name not in stored]
    wrong = [name for name in implied if name in stored and tuple(stored[name]) != tuple(implied[name])]
    if not absent and not wrong:
        return
    misfit = (f"tensor {wrong[0]!r} is {list(stored[wrong[0]])}, the config gives {list(implied[wrong[0]])}" if wrong
              else f"no tensor {absent[0]!r} ({len(absent)} of the config's {len(implied)} absent)")
    raise CheckpointError(f"{path}: not stated: {', '.join(unstated)}; the released model's defaults used for them "
                          f"do not fit the weights in {folder}: {misfit}")


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


def _read_layer(meta: Mapping[str, Any], text_encoder: Mapping[str, Any], where: str, text_path: Path) -> int:
    layer = meta.get("text_encoder_layer", 50)  # released: hidden_states[50]
    depth = text_encoder.get("text_config", {}).get("num_hidden_layers")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 2:
        raise CheckpointError(f"{text_path}: text_config.num_hidden_layers must be an integer >= 2 (the text "
                              f"encoder's depth, which bounds the read layer), got {depth!r}")
    if not isinstance(layer, int) or not 1 <= layer < depth:
        stated = "" if "text_encoder_layer" in meta else " (not stated: the released default)"
        raise CheckpointError(f"{where}: _minimax_h3.text_encoder_layer {layer!r}{stated} must be in 1..{depth - 1} "
                              f"for this {depth}-layer text encoder")
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
        origin = (safetensors_header(root).metadata() or {}).get("h3render_random")
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
    _check_unstated_keys(part / "transformer" / "config.json", DiTConfig, part / "transformer",
                         lambda: _dit_shapes(dit, transformer_names))
    video_vae = _config(part / video_dir / "config.json", VideoVAEConfig.from_dict)
    audio_vae = _config(part / audio_dir / "config.json", AudioVAEConfig.from_dict)
    vaes = dataclasses.replace(_registry_defaults(dit), video_vae=video_vae, audio_vae=audio_vae)
    for folder, cls, component in ((video_dir, VideoVAEConfig, "video_vae"), (audio_dir, AudioVAEConfig, "audio_vae")):
        _check_unstated_keys(part / folder / "config.json", cls, part / folder,
                             lambda component=component: _module_shapes(component, vaes))
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
        text_read_layer=_read_layer(meta, text_encoder, str(index_path), text_path), video_shift=video_shift,
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
    handle = safetensors_header(path)
    metadata = handle.metadata() or {}
    if "config" in metadata:
        try:
            config = DiTConfig.from_dict(json.loads(metadata["config"]))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: bad `config` metadata: {exc}") from None
        return dataclasses.replace(_registry_defaults(config), dit=config)
    from h3render.checkpoint.names import IGNORED_DIT_TENSORS, dit_shapes  # torch: only for a file without metadata

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
