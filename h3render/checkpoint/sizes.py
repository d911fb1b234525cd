"""What each model part weighs on the device, from the checkpoint's config alone: its modules built empty (parameters
on meta, as the loader builds them, FP8 replacements included) and their tensors counted, element size times count.
Nothing is read from the weight files, so the memory-plan chooser (`h3render.memplan`) answers before any load.

Validated against the resident sizes measured on one H200 (docs/performance.md §9.4; 1 GB = 1e9 bytes there and
here): text encoder 50.32 GB bf16 / 25.95 fp8, DiT (AdaLN projections in host memory) 40.20 / 20.95, video VAE 5.57
(3.16 at fp8, its decoder's FP8 linears), audio VAE 0.61 (tests/unit/test_memplans.py holds them to 1 %).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from h3render.checkpoint.load import _empty_dit, _empty_text_encoder, _empty_video_vae, check_precision
from h3render.checkpoint.releases import Release
from h3render.models.fp8 import empty_dit_fp8_


@dataclass(frozen=True)
class PartSize:
    """One part's bytes on the device (1 GB = 1e9 bytes in the properties).

    Attributes:
        resident: every tensor the part keeps on the device when fully resident (the DiT without its AdaLN
            projections, which live in host memory once the tables are built; the text encoder without the
            fl2va vision tower, loaded only for keyframe jobs).
        layer: the largest of its streamable layers (DiT blocks without their AdaLN projection; text-encoder
            decoder layers); 0 for the VAEs.
        layers: how many streamable layers.
        host_only: bytes that stay in host memory in every plan (the DiT's AdaLN projections).
    """

    resident: int
    layer: int = 0
    layers: int = 0
    host_only: int = 0

    @property
    def outside_layers(self) -> int:
        """What stays on the device when the layers stream (embeddings, refiner, heads, norms)."""
        return self.resident - self.layer * self.layers


def _bytes(module: nn.Module, skip: str | None = None) -> int:
    """Bytes of every parameter and buffer of `module`, leaving out tensors under a submodule named `skip`."""
    total = 0
    for name, sub in module.named_modules():
        if skip is not None and (name == skip or name.endswith("." + skip) or f".{skip}." in f".{name}."):
            continue
        for t in list(sub._parameters.values()) + list(sub._buffers.values()):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def part_sizes(release: Release, precision: str = "bf16", dtype: torch.dtype = torch.bfloat16, *,
               vsa: bool = False) -> dict[str, PartSize]:
    """`{"dit", "text_encoder", "video_vae", "audio_vae"}` -> `PartSize` of `release`'s parts loaded in `dtype`
    at `precision` ("bf16" or "fp8": block linears e4m3 with fp32 scales, `models.fp8`); `vsa` adds a FastH3 VSA
    student's gate projections to every DiT block (1.93 GB bf16 at release).

    Raises:
        ValueError: an unknown precision.
    """
    check_precision(precision)
    key = (release.config_hash(), precision, dtype, vsa)
    if key not in _CACHE:
        _CACHE[key] = _part_sizes(release, precision, dtype, vsa)
    return dict(_CACHE[key])


_CACHE: dict[tuple, dict[str, PartSize]] = {}  # building the released parts empty takes seconds (the audio VAE's)


def _part_sizes(release: Release, precision: str, dtype: torch.dtype, vsa: bool) -> dict[str, PartSize]:
    dit = _empty_dit(release.dit, dtype)
    if vsa:
        dit.enable_vsa(0.9)  # the sparsity is irrelevant to the size
    if precision == "fp8":
        empty_dit_fp8_(dit)
    adaln = sum(_bytes(m) for m in [b.adaln_proj for b in dit.blocks] + [dit.final_layer.adaln_proj])
    blocks = [_bytes(b, skip="adaln_proj") for b in dit.blocks]
    sizes = {"dit": PartSize(resident=_bytes(dit) - adaln, layer=max(blocks, default=0), layers=len(blocks),
                             host_only=adaln)}
    encoder = _empty_text_encoder(release, dtype, tokenizer=None, precision=precision)
    layers = [_bytes(layer) for layer in encoder.layers]
    sizes["text_encoder"] = PartSize(resident=_bytes(encoder), layer=max(layers, default=0), layers=len(layers))
    key = (release.config_hash(), dtype, precision)
    if key not in _VAE_CACHE:
        _VAE_CACHE[key] = {"video_vae": PartSize(resident=_bytes(_video_vae(release, dtype, precision))),
                           "audio_vae": PartSize(resident=_bytes(_meta_audio_vae(release)))}
    return {**sizes, **_VAE_CACHE[key]}


def _video_vae(release: Release, dtype: torch.dtype, precision: str) -> nn.Module:
    """The video VAE as the Engine holds it: at fp8 its decoder blocks' linears are e4m3 (`Engine.__init__`: fused
    q/k/v, then `quantize_video_decoder_fp8_`; 3.16 GB against 5.57 at release)."""
    vae = _empty_video_vae(release, dtype)
    if precision == "fp8":
        from h3render.models.fp8 import quantize_video_decoder_fp8_

        vae.fuse_qkv_()
        quantize_video_decoder_fp8_(vae)
    return vae


_VAE_CACHE: dict[tuple, dict[str, PartSize]] = {}


def _meta_audio_vae(release: Release) -> nn.Module:
    """The audio VAE (fp32 always) built on the meta device entirely: the loader's empty build draws its
    weight-norm initial values with torch.randn on the host first (9 s for the release on a busy 2-core machine)."""
    from h3render.models.audio_vae import AudioVAE

    with torch.device("meta"):
        model = AudioVAE(release.audio_vae)
    return model.float()


def vision_bytes(release: Release, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the conditioner's vision tower (fl2va keyframes), built empty from the release's vision config."""
    from h3render.checkpoint.stream import cast_parameters_, parameters_on_meta
    from h3render.models.text_encoder import build_vision_tower

    config = release.text_encoder.get("vision_config")
    if config is None:
        return 0
    with parameters_on_meta():
        tower = build_vision_tower(config)
    cast_parameters_(tower, dtype)
    return _bytes(tower)
