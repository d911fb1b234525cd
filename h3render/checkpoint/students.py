"""FastH3 students: which published layout a path is, the student's attention (dense or video sparse attention,
sparsity, tile, and where each came from), and the load hook that turns VSA on in the empty DiT, fuses the adapter
and checks the gates.

Published layouts (vsa.md §2; FastVideo blog "FastH3 preview"):

* an adapter file (`adapter_model.safetensors`, `fastvideo-lora-v2`);
* a single-variant adapter folder (`vsa-datafree/adapter_model.safetensors`);
* the LoRA bundle root `FastVideo/FastVideo-FastH3-4-step-Preview-v1-LoRA`: variant folders `vsa-datafree/`,
  `vsa-synthetic-step1300/`, `vsa-synthetic-step1900/`, `dense-datafree/` and `adapter_manifest.json` with
  `schema_version = "fasth3-lora-bundle-v1"` (its other fields are unpublished: `variants.<name>.vsa_sparsity` /
  `vsa_tile_size` or the same keys at the top level are read when present); the variant is chosen by name;
* a full checkpoint folder with `fastvideo_inference.json` (`h3render.checkpoint.contract`): v1's four students
  and V2, their gates `transformer_blocks.{i}.attn.to_gate_compress.weight` inside the transformer.

Attention: an adapter is VSA when it carries the 50 `attn.to_gate_compress.set_weight` gates (headers state no
sparsity); its sparsity comes from the bundle manifest, else the v1 release value (`spec.FASTH3_V1_VSA_SPARSITY`),
tile `kernels.vsa.TILE`. A full checkpoint is VSA when its contract's `attention_backend` is `VIDEO_SPARSE_ATTN_H3`,
with the contract's `vsa_sparsity` / `vsa_tile_size` (V2's release values where it states none). Another tile is an
error (the only one h3render's VSA runs, and the one the students were trained with). A gate missing or
zero-filled in some blocks is an error naming the blocks.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from h3render.checkpoint.adapter import RELEASED_BASE_MODEL, TINY_BASE_MODEL, Adapter, AdapterFusion, read_adapter
from h3render.checkpoint.contract import FastH3Contract, fasth3_schedule, read_contract
from h3render.checkpoint.errors import AdapterError, CheckpointError
from h3render.checkpoint.releases import BUILTIN
from h3render.checkpoint.stream import Entry
from h3render.kernels.vsa import TILE
from h3render.spec import FASTH3_V1_VSA_SPARSITY, FASTH3_V2_VSA_SPARSITY, POSITION_CHOICES

ADAPTER_FILE = "adapter_model.safetensors"
BUNDLE_MANIFEST = "adapter_manifest.json"
BUNDLE_SCHEMA = "fasth3-lora-bundle-v1"
BUNDLE_VARIANTS = ("vsa-datafree", "vsa-synthetic-step1300", "vsa-synthetic-step1900", "dense-datafree")
# Where a student states no VSA sparsity / tile, the release's (values: h3render.spec, h3render.kernels.vsa.TILE).
_V1_RELEASE = f"FastH3 v1 release notes (VSA {FASTH3_V1_VSA_SPARSITY}, tile {TILE})"
_V2_RELEASE = f"V2 release ({FASTH3_V2_VSA_SPARSITY}, tile {TILE})"
_GATE = re.compile(r"blocks\.(\d+)\.attn\.gate_proj\.weight")


# ---------------------------------------------------------------------------------------------- where the adapter is


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter file sits among the published layouts.

    Attributes:
        file: the `adapter_model.safetensors` (or other `.safetensors`) to read.
        layout: "file", "variant folder" or "bundle".
        variant: the variant folder's name (bundle or variant folder), else None.
        manifest: the bundle's `adapter_manifest.json` (parsed) when the file sits in a bundle, else None.
        manifest_path: its path, else None.
    """

    file: Path
    layout: str
    variant: str | None = None
    manifest: Mapping[str, Any] | None = None
    manifest_path: Path | None = None


def read_bundle_manifest(path: Path) -> dict[str, Any]:
    """A bundle root's `adapter_manifest.json`.

    Raises:
        AdapterError: unreadable, not an object, or another `schema_version` (names the file and field).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path}: unreadable adapter manifest: {exc}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    if data.get("schema_version") != BUNDLE_SCHEMA:
        raise AdapterError(f"{path}: schema_version={data.get('schema_version')!r}, expected {BUNDLE_SCHEMA!r}")
    return data


def bundle_variants(root: Path) -> list[str]:
    """Variant folder names of a bundle root (the folders holding an `adapter_model.safetensors`), sorted."""
    return sorted(d.name for d in root.iterdir() if (d / ADAPTER_FILE).is_file())


def resolve_adapter(path: str | Path, variant: str | None = None) -> AdapterSource:
    """Find the adapter file of any published layout.

    Args:
        path: an adapter file, a variant folder, or a bundle root (with `adapter_manifest.json`).
        variant: the variant of a bundle root (required there); for a variant folder it must be that folder's name.

    Raises:
        AdapterError: nothing there; a bundle root without (or with an unknown) variant, listing the variants; a
            variant given for a plain file or for another folder.
    """
    p = Path(path)
    if p.is_file():
        if variant is not None:
            raise AdapterError(f"{p}: --adapter-variant {variant!r} needs a bundle folder; this is one adapter file")
        return _in_bundle(AdapterSource(p, "file"), p.parent)
    if not p.is_dir():
        raise AdapterError(f"{p}: adapter file or folder not found")
    if (p / BUNDLE_MANIFEST).is_file():
        manifest = read_bundle_manifest(p / BUNDLE_MANIFEST)
        variants = bundle_variants(p)
        if variant is None or variant not in variants:
            close = difflib.get_close_matches(str(variant), variants, n=1) if variant is not None else []
            what = ("names several variants" if variant is None else
                    f"has no variant {variant!r}" + (f" (did you mean {close[0]}?)" if close else ""))
            raise AdapterError(f"{p}: a FastH3 LoRA bundle {what}; choose one with --adapter-variant "
                               f"(manifest `adapter_variant`): {', '.join(variants) or '(none found)'}")
        return AdapterSource(p / variant / ADAPTER_FILE, "bundle", variant, manifest, p / BUNDLE_MANIFEST)
    if (p / ADAPTER_FILE).is_file():
        if variant is not None and variant != p.name:
            raise AdapterError(f"{p}: a single-variant adapter folder ({p.name!r}); --adapter-variant {variant!r} "
                               f"names another")
        return _in_bundle(AdapterSource(p / ADAPTER_FILE, "variant folder", p.name), p)
    found = [d.name for d in sorted(p.iterdir()) if (d / ADAPTER_FILE).is_file()]
    raise AdapterError(f"{p}: no {ADAPTER_FILE} and no {BUNDLE_MANIFEST}"
                       + (f" (variant folders inside: {', '.join(found)})" if found else ""))


def _in_bundle(source: AdapterSource, folder: Path) -> AdapterSource:
    """A file or variant folder inside a bundle root takes the root's manifest (and the folder as variant)."""
    manifest_path = folder.parent / BUNDLE_MANIFEST
    if folder.name and manifest_path.is_file():
        return AdapterSource(source.file, source.layout, folder.name, read_bundle_manifest(manifest_path),
                             manifest_path)
    return source


def _manifest_field(source: AdapterSource, key: str) -> tuple[Any, str] | None:
    """(value, where) of `variants.<variant>.<key>` (variants an object or a list of {name|slug|variant}), else
    the top-level `<key>`, of the bundle manifest; None when it states neither."""
    manifest = source.manifest or {}
    variants = manifest.get("variants")
    entry = None
    if isinstance(variants, Mapping):
        entry = variants.get(source.variant)
    elif isinstance(variants, list):
        entry = next((v for v in variants if isinstance(v, Mapping) and source.variant in
                      (v.get("name"), v.get("slug"), v.get("variant"))), None)
    if isinstance(entry, Mapping) and key in entry:
        return entry[key], f"{source.manifest_path} variants.{source.variant}.{key}"
    if key in manifest:
        return manifest[key], f"{source.manifest_path} {key}"
    return None


# ---------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class StudentAttention:
    """How a student's DiT blocks attend, and where each fact came from (the sidecar's `attention`).

    Attributes:
        mode: "dense" or "vsa".
        sparsity, tile: VSA's fraction of video key tiles dropped and tile rows (None when dense).
        mode_source, sparsity_source, tile_source: what decided each.
    """

    mode: str
    mode_source: str
    sparsity: float | None = None
    sparsity_source: str | None = None
    tile: int | None = None
    tile_source: str | None = None

    @property
    def vsa(self) -> bool:
        return self.mode == "vsa"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "mode_source": self.mode_source}
        if self.vsa:
            out.update(sparsity=self.sparsity, sparsity_source=self.sparsity_source, tile=self.tile,
                       tile_source=self.tile_source)
        return out

    def budget(self, width: int, height: int, frames: int) -> dict[str, int]:
        """The top-k at one canvas: `{"video_tiles": V, "k": k}`, k = max(1, min(ceil((1 - s) V), V))
        (`kernels.vsa.topk_budget`); V from the job's patched latent grid cut into 4x4x4 tiles."""
        from h3render.kernels.vsa import tile_plan, topk_budget
        from h3render.packing import t2va_layout

        layout = t2va_layout(1, height, width, frames)
        pt, ph, pw = layout.patch
        grid = (layout.latent_frames // pt, layout.latent_height // ph, layout.latent_width // pw)
        video = tile_plan((1, layout.num_audio_rows), grid).num_video
        return {"video_tiles": video, "k": topk_budget(self.sparsity, video)}


def _vsa_value(value: Any, source: str, what: str) -> Any:
    if what == "sparsity":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
            raise AdapterError(f"{source}={value!r}: VSA sparsity must be a number in [0, 1)")
        return float(value)
    if value != TILE or isinstance(value, bool):
        raise AdapterError(f"{source}={value!r}: VSA tile size must be {TILE} (the students' trained "
                           f"geometry and the only tile h3render's VSA runs)")
    return int(value)


def adapter_attention(adapter: Adapter, source: AdapterSource) -> StudentAttention:
    """Dense without gates; VSA with them, sparsity / tile from the bundle manifest, else the v1 release values.

    Raises:
        AdapterError: a manifest sparsity outside [0, 1) or a tile other than 64 (names the file and field).
    """
    if not adapter.requires_vsa:
        return StudentAttention("dense", f"{adapter.path}: no attn.to_gate_compress gates (dense student)")
    facts = {}
    for what, key, default in (("sparsity", "vsa_sparsity", FASTH3_V1_VSA_SPARSITY), ("tile", "vsa_tile_size", TILE)):
        stated = _manifest_field(source, key)
        value, where = stated if stated else (default, _V1_RELEASE)
        facts[what] = (_vsa_value(value, where, what), where)
    return StudentAttention("vsa", f"{adapter.path}: {len(adapter.gate_blocks)} attn.to_gate_compress.set_weight "
                            f"gates", facts["sparsity"][0], facts["sparsity"][1], facts["tile"][0], facts["tile"][1])


def contract_attention(contract: FastH3Contract) -> StudentAttention:
    """Dense unless the contract's `attention_backend` is VSA-H3; then its sparsity / tile (V2's release values,
    else the v1 release values, where it states none).

    Raises:
        AdapterError: a tile other than 64, or a sparsity outside [0, 1).
        ValueError: an unknown attention backend.
    """
    where = contract.where
    if not contract.requires_vsa:
        stated = contract.attention_backend or "(not stated)"
        return StudentAttention("dense", f"{where} attention_backend={stated}")
    release = _V2_RELEASE if contract.is_v2 else _V1_RELEASE
    defaults = {"sparsity": FASTH3_V2_VSA_SPARSITY if contract.is_v2 else FASTH3_V1_VSA_SPARSITY, "tile": TILE}
    facts = {}
    for what, value, key in (("sparsity", contract.vsa_sparsity, "vsa_sparsity"),
                             ("tile", contract.vsa_tile_size, "vsa_tile_size")):
        value, source = (defaults[what], release) if value is None else (value, f"{where} {key}")
        facts[what] = (_vsa_value(value, source, what), source)
    return StudentAttention("vsa", f"{where} attention_backend={contract.attention_backend}", facts["sparsity"][0],
                            facts["sparsity"][1], facts["tile"][0], facts["tile"][1])


# ---------------------------------------------------------------------------------------------- the load hook


class StudentHook:
    """The DiT tensor hook of a student load (`stream_into`'s `tensor_hook`; `assemble_components` also calls
    `prepare(dit)` on the empty DiT and streams through `entries`), and of in-place fusion (`Engine.fuse_student`).

    * `prepare`: `dit.enable_vsa(sparsity, tile)` for a VSA student, so the gates exist before weights stream;
    * `entries`: the checkpoint's entries (with the adapter's gates added where the checkpoint has none); for a VSA
      full checkpoint, the blocks whose gate the stream lacks are named at its end;
    * `__call__`: the adapter fusion (when there is an adapter), noting every gate block and all-zero gates;
    * `finish`: the fusion's own check, then every gate present and non-zero, else an error naming the blocks.

    Args:
        attention: the student's `StudentAttention`.
        num_layers: DiT blocks (each must have a gate under VSA).
        fusion: the adapter's `AdapterFusion`, or None for a full checkpoint.
        where: the gates' origin, for messages.
    """

    def __init__(self, attention: StudentAttention, num_layers: int, fusion: AdapterFusion | None = None,
                 where: str = "checkpoint"):
        self.attention = attention
        self.fusion = fusion
        self.where = where
        self._blocks = set(range(num_layers))
        self._gates: set[int] = set()
        self._zero: set[int] = set()
        self._error = AdapterError if fusion is not None and fusion.assigned else CheckpointError

    def prepare(self, dit) -> None:
        """Turn VSA on in `dit` (meta or loaded) for a VSA student; a dense student leaves it unchanged."""
        if self.attention.vsa:
            dit.enable_vsa(self.attention.sparsity, self.attention.tile)

    def entries(self, stream: Iterable[Entry]) -> Iterator[Entry]:
        streamed = set()
        for entry in (self.fusion.entries(stream) if self.fusion is not None else stream):
            match = _GATE.fullmatch(entry.name)
            if match and not self.attention.vsa:
                raise CheckpointError(f"{entry.file}: tensor {entry.name!r} is a VSA gate but this student is dense "
                                      f"({self.attention.mode_source})")
            if match:
                streamed.add(int(match.group(1)))
            yield entry
        lacking = sorted(self._blocks - streamed) if self.attention.vsa else []
        if lacking:
            raise self._error(f"{self.where}: no VSA gate (attn.to_gate_compress) for blocks {lacking} "
                              f"({len(streamed)} of {len(self._blocks)} present); a VSA student needs all")

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor if self.fusion is None else self.fusion(name, tensor)
        match = _GATE.fullmatch(name)
        if match:
            block = int(match.group(1))
            self._gates.add(block)
            if not bool(torch.any(out != 0)):
                self._zero.add(block)
        return out

    def finish(self) -> None:
        """Raises: AdapterError / CheckpointError naming the blocks whose gate is missing or all zero."""
        if self.fusion is not None:
            self.fusion.finish()
        if not self.attention.vsa:
            return
        lacking = sorted(self._blocks - self._gates)
        if lacking:
            raise self._error(f"{self.where}: no VSA gate (attn.to_gate_compress) reached blocks {lacking}")
        if self._zero:
            raise self._error(f"{self.where}: the VSA gate (attn.to_gate_compress) of blocks {sorted(self._zero)} is "
                              f"all zero ({len(self._zero)} of {len(self._blocks)}): not a trained VSA student")


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class StudentPlan:
    """What `Engine.load` needs for a FastH3 student: the load hook, the few-step schedule, the sidecar facts.

    Attributes:
        hook: `StudentHook` (None: no student).
        schedule: the few-step `Schedule`.
        sidecar: the sidecar's `extra.fasth3` (attention under `attention`).
        attention: the `StudentAttention`.
        warnings: non-fatal findings to print.
    """

    hook: StudentHook | None = None
    schedule: Any = None
    sidecar: dict[str, Any] | None = None
    attention: StudentAttention | None = None
    warnings: tuple[str, ...] = ()


def locate_student(checkpoint: str | Path, adapter: str | Path | None = None, variant: str | None = None,
                   positions: str | None = None) -> tuple[FastH3Contract | None, AdapterSource | None]:
    """Which student a load fuses, from folder listings and small JSON files only (no tensor is read): the
    checkpoint's own contract, or where the adapter's file is (`resolve_adapter`). `plan_student` starts here, and
    the CLI's one check calls it before anything loads, so a mistake here is a usage error, not a failed job.

    Returns:
        (contract, None) for a full FastH3 checkpoint; (None, source) for an adapter; (None, None) for no student.
    Raises:
        AdapterError, ValueError: a bad contract; an adapter on a full FastH3 checkpoint; an adapter path of no
            published layout, a bundle root without its variant or with an unknown one; `positions` unknown, or
            `positions` / `variant` without a student (each names the file and field, or the option).
    """
    if positions is not None and positions not in POSITION_CHOICES:
        raise ValueError(f"--fasth3-positions {positions!r}: choose {' or '.join(POSITION_CHOICES)}")
    builtin = isinstance(checkpoint, str) and checkpoint in BUILTIN  # read_checkpoint_info's rule
    contract = None if builtin else read_contract(checkpoint)
    if adapter is not None:
        if contract is not None:
            raise AdapterError(f"{contract.where}: {checkpoint} is a full FastH3 student ({contract.model_id}); "
                               f"it takes no --adapter")
        return None, resolve_adapter(adapter, variant)
    if contract is None and (positions is not None or variant is not None):
        raise ValueError("--fasth3-positions / --adapter-variant need a FastH3 student (--adapter, or a full "
                         "FastH3 checkpoint)")
    return contract, None


@dataclass
class StudentParts:
    """A student as its headers state it (`read_student`): no tensor data read, no file hashed.

    Attributes:
        attention: the `StudentAttention`.
        schedule: the few-step `Schedule`.
        contract: the full checkpoint's `FastH3Contract`, or None for an adapter.
        source, adapter, fusion: the adapter's `AdapterSource`, `Adapter` (header) and `AdapterFusion` (checked
            against the DiT config), or None for a full checkpoint.
    """

    attention: StudentAttention
    schedule: Any
    contract: FastH3Contract | None = None
    source: AdapterSource | None = None
    adapter: Adapter | None = None
    fusion: AdapterFusion | None = None


def read_student(checkpoint: str, info, adapter: str | Path | None = None, *, variant: str | None = None,
                 positions: str | None = None, device: torch.device | str = "cpu") -> StudentParts | None:
    """The student of a load from headers, listings and JSON only (`plan_student`'s first half; the CLI's one check
    runs it before anything loads): where it is, its attention, its schedule, and the adapter's tensors checked
    against the DiT config. None: no student.

    Raises:
        AdapterError, CheckpointError, ValueError: as `plan_student`.
    """
    contract, source = locate_student(checkpoint, adapter, variant, positions)
    if source is not None:
        base = TINY_BASE_MODEL if info.layout == "builtin" or info.random_model is not None else RELEASED_BASE_MODEL
        ad = read_adapter(source.file, base_model=base)
        attention = adapter_attention(ad, source)
        fusion = AdapterFusion(ad, info.release.dit, device)
        sampling = source.manifest if "dmd_denoising_steps" not in ad.metadata and source.manifest else ad
        schedule = fasth3_schedule(sampling, info.video_shift, info.audio_shift, positions=positions)
        return StudentParts(attention, schedule, source=source, adapter=ad, fusion=fusion)
    if contract is not None:
        schedule = fasth3_schedule(contract, info.video_shift, info.audio_shift, positions=positions)
        return StudentParts(contract_attention(contract), schedule, contract=contract)
    return None


def plan_student(checkpoint: str, info, adapter: str | Path | None = None, *, variant: str | None = None,
                 positions: str | None = None, device: torch.device | str = "cpu",
                 sparsity: float | None = None) -> StudentPlan:
    """The student of a load: an adapter (any layout) over `checkpoint`, or the checkpoint's own contract.

    Args:
        checkpoint: as given to `read_checkpoint_info`; info: its `CheckpointInfo`.
        adapter: adapter file / variant folder / bundle root, or None.
        variant: bundle variant (`resolve_adapter`).
        positions: a `POSITION_CHOICES` name (`fasth3_schedule`'s named sets), or None for the student's own.
        device: where the fusion computes.
        sparsity: `--vsa-sparsity`, replacing a VSA student's own (V2: 0.8 from its contract; v1: 0.9), or None.

    Raises:
        AdapterError, CheckpointError, ValueError: a bad adapter / contract / layout, an adapter on a full FastH3
            checkpoint, `positions` / `variant` without a student, or `sparsity` for a dense student or outside
            [0, 1) (each names the file and field).
    """
    parts = read_student(checkpoint, info, adapter, variant=variant, positions=positions, device=device)
    if parts is None:
        if sparsity is not None:
            raise ValueError("--vsa-sparsity needs a VSA FastH3 student (an adapter with gates, or a VSA checkpoint)")
        return StudentPlan()
    attention, schedule, ad, source = parts.attention, parts.schedule, parts.adapter, parts.source
    if sparsity is not None:
        if not attention.vsa:
            raise ValueError(f"--vsa-sparsity {sparsity}: the student is dense ({attention.mode_source})")
        attention = replace(attention, sparsity=_vsa_value(sparsity, "--vsa-sparsity", "sparsity"),
                            sparsity_source="--vsa-sparsity")
    if ad is not None:
        sidecar = {"path": str(adapter), "file": str(source.file), "layout": source.layout, "variant": source.variant,
                   "sha256": ad.sha256, "base_model": ad.base_model, "rank": ad.rank}
        warnings = ad.warnings
        hook = StudentHook(attention, info.release.dit.num_layers, parts.fusion, str(source.file))
    else:
        sidecar, warnings = {"contract": parts.contract.where, "model_id": parts.contract.model_id}, ()
        hook = StudentHook(attention, info.release.dit.num_layers, None, f"{checkpoint} transformer")
    sidecar.update(positions=list(schedule.positions), source=schedule.source, positions_set=positions,
                   attention=attention.to_dict())
    if warnings:
        sidecar["warnings"] = list(warnings)
    return StudentPlan(hook, schedule, sidecar, attention, warnings)


def budgets(attention: StudentAttention | None, shapes: Iterable[tuple[int, int, int]]) -> dict[str, Any]:
    """`{"WxHxF": {"video_tiles": V, "k": k}}` per (width, height, frames) under VSA; {} when dense."""
    if attention is None or not attention.vsa:
        return {}
    return {f"{w}x{h}x{f}": attention.budget(w, h, f) for w, h, f in sorted(set(shapes))}


__all__ = ["ADAPTER_FILE", "BUNDLE_MANIFEST", "BUNDLE_SCHEMA", "BUNDLE_VARIANTS", "POSITION_CHOICES",
           "AdapterSource", "StudentAttention", "StudentHook", "StudentParts", "StudentPlan",
           "adapter_attention", "budgets", "bundle_variants", "contract_attention", "locate_student", "plan_student",
           "read_bundle_manifest", "read_student", "resolve_adapter"]
