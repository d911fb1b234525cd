"""Loading: a checkpoint (any layout, or a built-in random model) into our DiT, VAEs and text encoder.

Every module is built with its parameters on the meta device (buffers computed normally), then its tensors stream
straight to the target device through `stream_into`, cast to the dtype the module's precision policy gives them.
The DiT goes through an optional per-tensor hook on the way (FastH3 fusion). The built-in random models ("tiny",
"small") are a source of entries like any layout (`h3render.checkpoint.builtin`) and load through the same path.

`precision="fp8"` (issue #18, `h3render.models.fp8`): the DiT block linears are empty `Fp8Linear` modules from the
start (after a FastH3 hook's `prepare` has added any VSA gates) and each weight is quantized as it streams, after
the hook has fused it; the text encoder's decoder-layer linears are `Fp8WeightLinear` the same way. So neither the
bf16 DiT nor the bf16 encoder ever exists on the device.

On a CUDA device, at either precision, the DiT's AdaLN projections (≈13 B parameters at release, read only to
build the modulation tables) load into host memory: a safetensors source reads them there directly (`Entry.host`),
so they never visit the GPU. Before, a bf16 load put them on the GPU and `Engine.prepare` copied them back, 26 GB at
≈1 GB/s: 19.5–26 s of every run's prepare on an H200, table cache or not (docs/performance.md §11.2, §20.3).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator

import torch

from h3render.checkpoint.builtin import random_entries, tiny_vl_tokenizer
from h3render.checkpoint.errors import CheckpointError
from h3render.checkpoint.info import CheckpointInfo, read_checkpoint_info, with_transformer_file
from h3render.checkpoint.layouts import dit_entries
from h3render.checkpoint.releases import BUILTIN, RELEASES, Release
from h3render.checkpoint.stream import (Entry, TensorHook, cast_parameters_, finish_hook, parameters_on_meta,
                                        safetensors_entries, stream_into, weights_where)
from h3render.models.audio_vae import AudioVAE
from h3render.models.dit import AdaLNProj, DiT
from h3render.models.dit_config import DiTConfig
from h3render.models.fp8 import Fp8Linear, Fp8WeightLinear, empty_dit_fp8_, quantize_text_encoder_fp8_, quantize_weight
from h3render.models.text_encoder import TextEncoder, build_vision_tower, image_processor_from_dict
from h3render.models.video_vae import VideoVAE
from h3render.spec import check_precision

PARTS = ("dit", "video_vae", "audio_vae", "text_encoder")
# "bf16": every linear in the load dtype (today's path); "fp8": see the module docstring.
# Each part's name in messages.
_WHAT = {"dit": "DiT", "video_vae": "video VAE", "audio_vae": "audio VAE", "text_encoder": "text encoder"}


@dataclass
class Components:
    """The loaded model parts (None for a part not asked for) and the checkpoint they came from."""

    dit: DiT | None
    video_vae: VideoVAE | None
    audio_vae: AudioVAE | None
    text_encoder: TextEncoder | None
    info: CheckpointInfo


# ---------------------------------------------------------------------------------------------------------------------
# Empty modules (parameters on meta, in the dtype each will be loaded in).


def _empty_dit(config: DiTConfig, dtype: torch.dtype) -> DiT:
    with parameters_on_meta():
        model = DiT(config)
    return model.apply_precision_(dtype)


def _empty_video_vae(release: Release, dtype: torch.dtype) -> VideoVAE:
    with parameters_on_meta():
        model = VideoVAE(release.video_vae, tiling=release.vae_tiling)
    return model.apply_precision_(dtype)


def _empty_audio_vae(release: Release) -> AudioVAE:
    # Released audio VAE: fp32 always (it degrades in bf16, DESIGN.md §1).
    with parameters_on_meta():
        model = AudioVAE(release.audio_vae)
    cast_parameters_(model, torch.float32)
    return model


def _empty_text_encoder(release: Release, dtype: torch.dtype, tokenizer, precision: str = "bf16") -> TextEncoder:
    with parameters_on_meta():
        model = TextEncoder(release.text_config, release.text_read_layer, tokenizer=tokenizer)
    cast_parameters_(model, dtype)
    if precision == "fp8":
        quantize_text_encoder_fp8_(model)  # empty Fp8WeightLinear modules (meta), filled by `_quantized_entries`
    return model


def _quantized_entries(entries: Iterable[Entry], weights: Collection[str]) -> Iterator[Entry]:
    """Entries with every tensor named in `weights` quantized as it is read: `<name>` becomes its e4m3 data
    [N, K] and a following `<name>_scale` entry its [1, N] fp32 per-channel scale (`models.fp8.quantize_weight`),
    on the device the source reads to. Only one bf16 weight exists at a time."""
    for entry in entries:
        if entry.name not in weights:
            yield entry
            continue
        done: list[tuple[torch.Tensor, torch.Tensor]] = []

        def quantized(entry: Entry = entry, done: list = done) -> tuple[torch.Tensor, torch.Tensor]:
            if not done:
                done.append(quantize_weight(entry.load()))
            return done[0]

        yield Entry(entry.file, entry.name, lambda q=quantized: q()[0])
        yield Entry(entry.file, entry.name + "_scale", lambda q=quantized: q()[1])


class _DitPlacement:
    """The DiT's per-tensor hook when its block linears are FP8 or its AdaLN projections live off `device`.

    Every tensor goes through the caller's `tensor_hook` first (the FastH3 fusion sees the streamed tensor, as on
    the bf16 path), then:

    * a block-linear weight (an empty `Fp8Linear` of `dit`): cast to the linear's `out_dtype` (what the bf16 path
      would hold) and quantized on its device (`quantize_weight`); the hook returns the e4m3 data [N, K], and the
      [1, N] scale is the `<name>_scale` entry that `entries` adds right after it. Each bf16 weight is dropped as
      soon as it is quantized, so one exists at a time, and the result equals quantizing the loaded bf16 DiT.
    * an AdaLN projection tensor (`blocks.*.adaln_proj`, `final_layer.adaln_proj`): cast to its parameter's dtype
      and moved to `adaln_device` (host memory). `stream_into` reads it there already (`elsewhere`) when its entry
      has a host loader; otherwise (random weights made on the device, a fusion computed there) at most one
      projection is on the device at a time.

    Args:
        dit: the empty DiT, already swapped to FP8 (`empty_dit_fp8_`) where it should be.
        tensor_hook: the caller's hook, or None.
        adaln_device: where the AdaLN projections go, or None to leave them where the DiT streams.
    """

    def __init__(self, dit: DiT, tensor_hook: TensorHook | None, adaln_device: torch.device | None):
        self.hook = tensor_hook
        self.quantized = {f"{name}.weight": m.out_dtype for name, m in dit.named_modules() if isinstance(m, Fp8Linear)}
        self.scales = {name + "_scale" for name in self.quantized}
        self.adaln_device = adaln_device
        self.adaln: dict[str, torch.dtype] = {}
        if adaln_device is not None:
            self.adaln = {f"{name}.{leaf}": p.dtype for name, m in dit.named_modules() if isinstance(m, AdaLNProj)
                          for leaf, p in m.named_parameters()}
        self._pending: dict[str, torch.Tensor] = {}

    def entries(self, stream: Iterable[Entry]) -> Iterator[Entry]:
        """`stream`, with each quantized weight's scale entry right after it (same file, so the same shard)."""
        for entry in stream:
            if entry.name in self.scales:
                raise CheckpointError(f"{entry.file}: unexpected tensor {entry.name!r} for the DiT (a pre-quantized "
                                      f"export?); precision='fp8' quantizes the checkpoint's own weights")
            yield entry
            if entry.name in self.quantized:
                yield Entry(entry.file, entry.name + "_scale", functools.partial(self._pending.pop,
                                                                                 entry.name + "_scale"))

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.scales:
            return tensor  # computed with its weight, the hook already saw that
        if self.hook is not None:
            tensor = self.hook(name, tensor)
        if name in self.quantized:
            data, self._pending[name + "_scale"] = quantize_weight(tensor.to(self.quantized[name]))
            return data
        if name in self.adaln:
            return tensor.to(self.adaln[name]).to(self.adaln_device)
        return tensor


def _adaln_home(adaln_device: torch.device | str | None, precision: str, device: torch.device | str) -> torch.device:
    """Where the AdaLN projections load: `adaln_device` when given, else host memory when the DiT loads onto a CUDA
    device (any precision) or at fp8, else `device` (a CPU load keeps them with the DiT)."""
    if adaln_device is not None:
        return torch.device(adaln_device)
    device = torch.device(device)
    return torch.device("cpu") if precision == "fp8" or device.type == "cuda" else device


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


# ---------------------------------------------------------------------------------------------------------------------
# Loading.


def assemble_components(
    info: CheckpointInfo,
    source: Callable[[str], Iterable[Entry]],
    where: Callable[[str], str],
    tokenizer: Callable[[], Any],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parts: Collection[str] = PARTS,
    tensor_hook: TensorHook | None = None,
    precision: str = "bf16",
    adaln_device: torch.device | str | None = None,
) -> Components:
    """Build the asked-for parts empty and stream each one's tensors into it: the one loading path of checkpoints
    on disk and of the built-in random models.

    Args:
        info: the checkpoint (its release gives every architecture).
        source: `source(part)` -> the part's entries in checkpoint naming (the DiT's already native).
        where: `where(part)` -> the file or folder named when a tensor is missing.
        tokenizer: called once when the text encoder is asked for.
        dtype: compute dtype of the DiT block stack, the video-VAE decoder linears and the text encoder; the
            release's fp32 islands stay fp32 and the audio VAE is always fp32.
        tensor_hook: applied to every DiT tensor while streaming, then `finish()` when it has one; its optional
            `prepare(dit)` runs on the empty DiT first and `entries(stream)` wraps the DiT's entries.
        precision: "bf16" or "fp8". With "fp8" the DiT's block linears (`models.fp8.DIT_BLOCK_LINEARS`, VSA gates
            included) are empty `Fp8Linear` modules before anything streams, and each weight is quantized on
            `device` as it arrives, after the hook has fused it (cast to `dtype` first: bit-identical to quantizing
            the bf16-loaded DiT with `quantize_dit_fp8_`); the text encoder's decoder-layer weights are quantized as
            they stream too. Only one bf16 weight exists at a time.
        adaln_device: where the DiT's AdaLN projections (`blocks.*.adaln_proj`, `final_layer.adaln_proj`; read only
            by `DiT.modulation_tables`, which brings each to the tables' device for its own block) are placed as
            they stream; None: host memory ("cpu") on a CUDA `device` or with precision "fp8", else `device`.

    Peak device memory with precision "fp8" on a GPU, released sizes (parameter counts of the release configs'
    modules built on meta, times bytes per element; parts load in the order dit, video_vae, audio_vae,
    text_encoder, so the peak comes at the end): FP8 DiT 20.9 GB (19.27 B e4m3 block-linear weights + 12 MB
    scales + 1.67 GB of other DiT tensors in bf16/fp32; a VSA student's gates add 1.93 GB) + video VAE 5.6 GB +
    audio VAE 0.6 GB + FP8 text encoder 26.0 GB (24.38 B e4m3 weights + 14 MB scales + 1.56 GB bf16 embeddings
    and norms) ≈ 53.1 GB (55.0 GB VSA), plus one weight's transient (≈1 GB: a bf16 text linear of at most
    25600 x 5120, 0.26 GB, and the fp32 temporaries of one 2**26-element quantization chunk, ≈0.8 GB). The DiT
    phase peaks lower: its FP8 part plus one AdaLN projection on its way to host memory (96768 x 2688, 0.52 GB
    bf16; ≈2.6 GB while a FastH3 adapter fuses it in fp32). The 13.04 B AdaLN parameters (26.1 GB bf16) sit in
    host memory. Before: the whole bf16 DiT with its AdaLN projections, 66.3 GB, then quantized in place.

    Raises:
        CheckpointError: as `stream_into`.
        ValueError: an unknown precision.
    """
    check_precision(precision)
    release = info.release
    built: dict[str, Any] = dict.fromkeys(PARTS)
    if "dit" in parts:
        dit, entries = _empty_dit(release.dit, dtype), source("dit")
        # A FastH3 student's hook (`checkpoint.students.StudentHook`) turns VSA on in the empty DiT, so its gates
        # exist before the weights stream, and adds or checks gate entries.
        if hasattr(tensor_hook, "prepare"):
            tensor_hook.prepare(dit)
        if hasattr(tensor_hook, "entries"):
            entries = tensor_hook.entries(entries)
        hook, adaln_home = tensor_hook, _adaln_home(adaln_device, precision, device)
        adaln_away = adaln_home if adaln_home != torch.device(device) else None
        if precision == "fp8" or adaln_away is not None:
            if precision == "fp8":
                empty_dit_fp8_(dit)  # after `prepare`: a VSA student's gates become FP8 too
            hook = _DitPlacement(dit, tensor_hook, adaln_away)
            entries = hook.entries(entries)
        elsewhere = dict.fromkeys(hook.adaln, adaln_away) if adaln_away is not None else None
        built["dit"] = stream_into(dit, entries, device, what=_WHAT["dit"], where=where("dit"), tensor_hook=hook,
                                   elsewhere=elsewhere)
        finish_hook(tensor_hook)
    if "video_vae" in parts:
        built["video_vae"] = stream_into(_empty_video_vae(release, dtype), source("video_vae"), device,
                                         what=_WHAT["video_vae"], where=where("video_vae"))
    if "audio_vae" in parts:
        built["audio_vae"] = stream_into(_empty_audio_vae(release), source("audio_vae"), device,
                                         what=_WHAT["audio_vae"], where=where("audio_vae"))
    if "text_encoder" in parts:
        entries = _text_entries(source("text_encoder"), release.text_read_layer)
        encoder = _empty_text_encoder(release, dtype, tokenizer(), precision)
        fp8_weights = {f"{name}.weight" for name, m in encoder.named_modules() if isinstance(m, Fp8WeightLinear)}
        if fp8_weights:
            entries = _quantized_entries(entries, fp8_weights)
        built["text_encoder"] = stream_into(encoder, entries, device, what=_WHAT["text_encoder"],
                                            where=where("text_encoder"), skip=_is_skipped)
    return Components(**built, info=info)


def _folder(info: CheckpointInfo, part: str) -> str:
    """The file or folder holding one part's weights."""
    return info.transformer if part == "dit" else getattr(info, part)


def _from_disk(info: CheckpointInfo, device: torch.device | str, dtype: torch.dtype, parts: Collection[str],
               tensor_hook: TensorHook | None, precision: str = "bf16") -> Components:
    def source(part: str) -> Iterable[Entry]:
        return dit_entries(info, device) if part == "dit" else safetensors_entries(Path(_folder(info, part)), device)

    return assemble_components(info, source, lambda part: weights_where(_folder(info, part)),
                               lambda: load_tokenizer(info.tokenizer), device, dtype, parts=parts,
                               tensor_hook=tensor_hook, precision=precision)


def load_dit(info: CheckpointInfo, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             tensor_hook: TensorHook | None = None, precision: str = "bf16") -> DiT:
    """Load the DiT of a (non-builtin) checkpoint.

    Args:
        info: from `read_checkpoint_info`.
        dtype: block-stack dtype; `DiT.apply_precision_` keeps the fp32 islands fp32.
        tensor_hook: optional `hook(native_name, tensor) -> tensor` applied to every DiT tensor while streaming
            (e.g. FastH3 fusion), then `hook.finish()` if it has one.
        precision: "bf16" or "fp8" (block linears quantized as they stream, after the fusion; see
            `assemble_components`). On CUDA the AdaLN projections load into host memory at either precision.

    Raises:
        CheckpointError: as `stream_into`.
    """
    return _from_disk(info, device, dtype, ("dit",), tensor_hook, precision).dit


REF_PARTITION = "transformer_ref"  # ref2va's DiT (official `Ref2VA/transformer/`, diffusers `transformer_ref/`)


def load_partition_dit(info: CheckpointInfo, partition: str, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, *, seed: int = 0, precision: str = "bf16") -> DiT:
    """The DiT of one checkpoint partition: "transformer" (t2va, fl2va) or "transformer_ref" (ref2va), loaded as
    `load_components` loads the base DiT (a built-in model's from its `seed`, as `make_checkpoint` writes it).

    Raises:
        CheckpointError: an unknown partition; a checkpoint without that partition (named); as `stream_into`.
    """
    if partition == "transformer":
        if info.layout == "builtin":
            return build_random(info.path, seed=seed, device=device, dtype=dtype, parts=("dit",),
                                precision=precision).dit
        return _from_disk(info, device, dtype, ("dit",), None, precision).dit
    if partition != REF_PARTITION:
        raise CheckpointError(f"unknown DiT partition {partition!r} (transformer, {REF_PARTITION})")
    if info.layout == "builtin":
        release = info.release
        return assemble_components(info, source=lambda part: random_entries("dit_ref", release, seed),
                                   where=lambda part: f"<builtin {info.path} {REF_PARTITION}>", tokenizer=lambda: None,
                                   device=device, dtype=dtype, parts=("dit",), precision=precision).dit
    if info.transformer_ref is None:
        where = {"official": "Ref2VA/transformer/", "diffusers": "transformer_ref/"}.get(info.layout)
        raise CheckpointError(f"{info.path}: no ref2va DiT partition" + (f" ({where} missing)" if where else
                              " (a single-file checkpoint holds one transformer)") + "; ref2va jobs need it")
    # The checkpoint's own naming, also when `--transformer` replaced the base DiT by a single file.
    names = {"official": "native", "diffusers": "diffusers"}[info.layout]
    ref_info = dataclasses.replace(info, transformer=info.transformer_ref, transformer_names=names)
    return _from_disk(ref_info, device, dtype, ("dit",), None, precision).dit


def load_components(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parts: Collection[str] = PARTS,
    tensor_hook: TensorHook | None = None,
    transformer_file: str | Path | None = None,
    seed: int = 0,
    precision: str = "bf16",
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
        precision: "bf16" (default: all linears in `dtype`) or "fp8": DiT block linears `Fp8Linear`, text encoder
            decoder-layer linears `Fp8WeightLinear`, each weight quantized on `device` as it streams. On a CUDA
            `device` the DiT's AdaLN projections load into host memory at either precision. Peak device memory of
            fp8 on a GPU, released sizes: ≈53 GB (FP8 DiT 20.9 + VAEs 6.2 + FP8 text encoder 26.0, plus ≈1 GB
            transient; derivation in `assemble_components`), where the bf16 DiT alone is 40.2 GB (66.3 GB with its
            AdaLN projections, as a bf16 load held it before). `models.fp8.precision_report(components)` describes
            the result.

    Raises:
        CheckpointError: layout, config or tensor problems, naming the file and tensor; an unknown part.
        ValueError: an unknown precision.
    """
    check_precision(precision)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise CheckpointError(f"unknown component {unknown[0]!r} (choose from {', '.join(PARTS)})")
    info = read_checkpoint_info(path)
    if info.layout == "builtin":
        if transformer_file is not None:
            raise CheckpointError(f"{transformer_file}: a built-in model takes no transformer file")
        return build_random(info.path, seed=seed, device=device, dtype=dtype, parts=parts, tensor_hook=tensor_hook,
                            precision=precision)
    if info.layout == "single-file" and set(parts) - {"dit"}:
        raise CheckpointError(f"{info.path}: a single-file checkpoint holds only the transformer; load it with "
                              f"parts=('dit',) or as transformer_file= of a full checkpoint")
    if transformer_file is not None:
        info = with_transformer_file(info, transformer_file)
    return _from_disk(info, device, dtype, parts, tensor_hook, precision)


def build_random(
    name: str = "tiny",
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    parts: Collection[str] = PARTS,
    tensor_hook: TensorHook | None = None,
    precision: str = "bf16",
) -> Components:
    """A built-in random model ("tiny" or "small") in memory, from a fixed seed; no files, no downloads.

    Same weights as `make_checkpoint.writer.make_checkpoint(out, name, seed=seed)` writes (values rounded to the
    release storage dtypes), loaded through the same strict streaming path (`assemble_components`), `precision`
    ("bf16" / "fp8") included.

    Raises:
        CheckpointError: an unknown name.
    """
    if name not in BUILTIN:
        raise CheckpointError(f"no built-in model {name!r} (choose from {', '.join(BUILTIN)})")
    release = RELEASES[name]
    info = CheckpointInfo(path=name, layout="builtin", release=release, random_model=name)
    return assemble_components(info, source=lambda part: random_entries(part, release, seed),
                               where=lambda part: f"<builtin {name}>",
                               tokenizer=lambda: tiny_vl_tokenizer(release.text_config.vocab_size),
                               device=device, dtype=dtype, parts=parts, tensor_hook=tensor_hook,
                               precision=precision)


def build_tiny(seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> Components:
    """The built-in tiny random model; see `build_random`."""
    return build_random("tiny", seed=seed, device=device, dtype=dtype, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# fl2va: the conditioner's vision tower and image processor, loaded only when a job has keyframes.

# Where Qwen3-VL checkpoints store the vision tower (transformers >= 4.57, and the older `visual.` export).
_VISION_PREFIXES = ("model.visual.", "visual.")


def _vision_entries(entries: Iterable[Entry]) -> Iterator[Entry]:
    """Vision-tower tensors with the prefix removed (`model.visual.blocks.0...` -> `blocks.0...`); every other
    tensor of the text encoder's files is renamed to `_skip.*`, so `stream_into` drops it unread."""
    for entry in entries:
        prefix = next((p for p in _VISION_PREFIXES if entry.name.startswith(p)), None)
        name = entry.name[len(prefix):] if prefix else "_skip." + entry.name
        yield Entry(entry.file, name, entry.load)


def load_vision(info: CheckpointInfo, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                seed: int = 0) -> tuple[Any, Any]:
    """The Qwen3-VL vision tower and keyframe image processor of a checkpoint (fl2va).

    The tower is transformers' `Qwen3VLVisionModel` built from the text encoder config's `vision_config` (released:
    27 blocks, DeepStack after 8/16/24), its parameters streamed in `dtype` from the text encoder's `model.visual.*`
    tensors; a built-in model's come from its random weights (same `seed` as `load_components`). The processor is
    `text_encoder.image_processor_from_dict` of the checkpoint's `processor/` config (`CheckpointInfo.processor`).

    Returns:
        `(vision tower on device, eval mode; image processor)`.

    Raises:
        CheckpointError: no `vision_config` or no processor config (a t2va-only checkpoint), or as `stream_into`.
    """
    release = info.release
    vision_config = release.text_encoder.get("vision_config")
    where = weights_where(info.text_encoder) if info.text_encoder else f"<builtin {info.path}>"
    if vision_config is None:
        raise CheckpointError(f"{where}: the text encoder config has no vision_config; fl2va needs Qwen3-VL's "
                              f"vision tower")
    if release.image_processor is None:
        raise CheckpointError(f"{info.path}: no processor/preprocessor_config.json (or processor_config.json); fl2va "
                              f"needs the keyframe image processor's config")
    with parameters_on_meta():
        tower = build_vision_tower(vision_config)
    cast_parameters_(tower, dtype)
    if info.layout == "builtin":
        entries = random_entries("text_encoder", release, seed)
    else:
        entries = safetensors_entries(Path(info.text_encoder), device)
    tower = stream_into(tower, _vision_entries(entries), device, what="vision tower", where=where, skip=_is_skipped)
    return tower.eval(), image_processor_from_dict(release.image_processor)


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
