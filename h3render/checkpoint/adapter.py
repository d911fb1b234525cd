"""FastH3: FastVideo's few-step DMD2 student of MiniMax-H3, fused into the DiT at load time.

FastH3 v1 ships as a ``fastvideo-lora-v2`` safetensors adapter over the base checkpoint (t2va only, 4 forwards).
It is not a switchable LoRA. The file's own ``application`` metadata states the reconstruction:

    W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned

- ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r]: rank-r factors, scale exactly 1 (the
  format carries no alpha; released rank 64).
- ``<module>.diff`` / ``<module>.diff_b``: full-rank deltas for a weight / bias (norms, biases, patch projections).
- ``<module>.set_weight``: a whole parameter assigned, used by the VSA variants for ``attn.to_gate_compress``, a
  module the base DiT (and ours) does not have.

Header metadata (all values strings), as written by FastVideo's ``finalize_adapter.py``: ``format``
(``"fastvideo-lora-v2"``), ``base_model`` (``"MiniMaxAI/MiniMax-H3"``), ``finetuned_model``, ``rank``,
``application``, ``low_rank_tensors`` (lora_A plus lora_B tensors), ``diff_tensors`` (.diff plus .diff_b),
``set_weight_tensors``, and provenance keys we do not use.

Tensor names are in the diffusers namespace (``transformer_blocks.{i}.attn.to_q``); our DiT uses the native
official names (``blocks.{i}.attn.qkv_proj`` with q/k/v rows interleaved per head, ``blocks.{i}.mlp.fc1``
gate-first). The mapping is the one table of ``h3render.checkpoint.names``.

Sampling: the student was distilled at pre-shift positions that the checkpoint's per-modality shifts (video 12,
audio 3) are applied on top of. V2 (``FastVideo/FastVideo-FastH3-8-Step-V2``) is a full checkpoint, 8 forwards,
video shift 10, described by its ``fastvideo_inference.json`` contract. ``fasth3_schedule`` turns either into the
few-step ``h3render.sampling.Schedule``. The synthetic adapter writer for the random models is
``h3render.make_checkpoint.write_synthetic_adapter``.

Sources: FastVideo 0.2.1 (``fastvideo/models/loader/lora_patch.py``, ``examples/inference/basic/basic_fasth3.py``),
FastVideo ``scripts/lora_extraction/finalize_adapter.py``, vLLM-Omni ``minimax_h3/fasth3.py`` and
``fasth3_checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from h3render.checkpoint.errors import AdapterError
from h3render.checkpoint.names import (GATE_VALUE, QKV, STACKS, VSA_GATE, Target, dit_shapes, native_module, qkv_slot,
                                       swap_halves)
from h3render.models.dit import DiTConfig
from h3render.sampling import Schedule
from h3render.spec import RELEASED_AUDIO_SHIFT, RELEASED_VIDEO_SHIFT

# Format tag FastVideo's writer stamps into the header (generic container, not FastH3-specific).
ADAPTER_FORMAT = "fastvideo-lora-v2"
# Base model id the released FastH3 adapters state (vLLM-Omni fasth3.py, FastVideo adapter headers).
RELEASED_BASE_MODEL = "MiniMaxAI/MiniMax-H3"
# Base model id the synthetic adapter for h3render's tiny/small random checkpoints states.
TINY_BASE_MODEL = "h3render/tiny-random-h3"
# The reconstruction the format states; an adapter stating another (e.g. an alpha scale) is refused.
APPLICATION = "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned"
COUNT_KEYS = ("low_rank_tensors", "diff_tensors", "set_weight_tensors")

# Pre-shift positions (sigma before the shift), terminal 0 included; N positions drive N-1 forwards.
# release: dmd_denoising_steps [999, 749, 500, 250] / 1000 (FastH3 release; vLLM-Omni FASTH3_BASE_SCHEDULE).
# fastvideo-example: FastVideo 0.2.1 basic_fasth3.py runs --steps 5 sigma-grid points = linspace(1, 0, 5).
# v2: dmd_denoising_steps [999, 874, 749, 624, 500, 375, 250, 125] / 1000 (V2 fastvideo_inference.json).
RELEASE_DMD_STEPS = (999, 749, 500, 250)
POSITION_SETS: dict[str, tuple[float, ...]] = {
    "release": tuple(step / 1000 for step in RELEASE_DMD_STEPS) + (0.0,),
    "fastvideo-example": (1.0, 0.75, 0.5, 0.25, 0.0),
    "v2": (0.999, 0.874, 0.749, 0.624, 0.5, 0.375, 0.25, 0.125, 0.0),
}

# V2 contract (fastvideo_inference.json of FastVideo/FastVideo-FastH3-8-Step-V2, as checked by vLLM-Omni).
V2_MODEL_ID = "FastVideo/FastVideo-FastH3-8-Step-V2"
V2_SCHEMA = "fasth3-inference-contract-v1"


# ---------------------------------------------------------------------------------------------- names

# Adapter key suffix -> role. ``.diff_b`` is tested before ``.diff``.
_ROLES = (
    (".lora_A.weight", "lora_A"),
    (".lora_B.weight", "lora_B"),
    (".diff_b", "diff_b"),
    (".diff", "diff"),
    (".set_weight", "set_weight"),
)


def native_target(module: str) -> Target:
    """Map a diffusers-namespace module path (``transformer_blocks.3.attn.to_q``) to its native target
    (``h3render.checkpoint.names``, the VSA gate ``attn.to_gate_compress`` included).

    Raises:
        AdapterError: the module names no known MiniMax-H3 DiT module.
    """
    target = native_module(module, vsa_gate=True)
    if target is None:
        raise AdapterError(f"adapter module {module!r} names no MiniMax-H3 DiT module (unknown target)")
    return target


def split_adapter_key(key: str) -> tuple[str, str]:
    """Split an adapter tensor name into (module path, role); role in lora_A/lora_B/diff/diff_b/set_weight.

    Raises:
        AdapterError: the key has none of the format's suffixes (e.g. a PEFT ``.alpha``: this format has none).
    """
    for suffix, role in _ROLES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    raise AdapterError(f"adapter tensor {key!r} is not a {ADAPTER_FORMAT} payload (unknown suffix)")


def native_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native parameter name -> shape of every parameter an adapter may target: the DiT's own (``dit_shapes``) plus
    ``blocks.{i}.attn.to_gate_compress.weight`` [H·D, hidden], the VSA gate our DiT does not have."""
    shapes = dit_shapes(config)
    inner = config.num_attention_heads * config.attention_head_dim
    for i in range(config.num_layers):
        shapes[f"blocks.{i}.{VSA_GATE}.weight"] = (inner, config.hidden_size)
    return shapes


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorEntry:
    """One adapter tensor as its header describes it (no data read)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Adapter:
    """A validated ``fastvideo-lora-v2`` adapter: header metadata and tensor index; data is read on demand.

    ``counts`` holds the metadata's declared (and verified) ``low_rank_tensors``, ``diff_tensors``,
    ``set_weight_tensors``. ``sha256`` is the hex digest of the whole file.
    """

    path: Path
    metadata: dict[str, str]
    sha256: str
    base_model: str
    finetuned_model: str
    rank: int
    counts: dict[str, int]
    entries: dict[str, TensorEntry] = field(repr=False)

    @property
    def requires_vsa(self) -> bool:
        """True for sparse-attention variants: they assign ``attn.to_gate_compress`` gates our DiT lacks."""
        return any(key.endswith(".attn.to_gate_compress.set_weight") for key in self.entries)

    def tensor(self, key: str) -> torch.Tensor:
        """Read one tensor from the file (CPU, stored dtype).

        Raises:
            AdapterError: the adapter has no tensor ``key``.
        """
        if key not in self.entries:
            raise AdapterError(f"{self.path}: no tensor {key!r}")
        with safe_open(self.path, framework="pt", device="cpu") as handle:
            return handle.get_tensor(key)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 23), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_adapter(path: str | Path, base_model: str = RELEASED_BASE_MODEL) -> Adapter:
    """Open and validate a FastH3 adapter (header only; tensor data stays on disk).

    Args:
        path: the adapter ``.safetensors`` file, or a directory holding ``adapter_model.safetensors``.
        base_model: the id of the checkpoint it will be fused into (released: ``"MiniMaxAI/MiniMax-H3"``;
            h3render's random checkpoints: ``TINY_BASE_MODEL``). Compared case-insensitively.

    Checks: format tag ``fastvideo-lora-v2``; ``base_model`` equals the checkpoint's; ``application`` (when stated)
    is the scale-1 reconstruction; every tensor name has a known suffix and maps to a DiT module; lora_A/lora_B
    come in pairs whose rank is at most ``rank`` and the largest equals it; the three tensor counts are stated
    and match the file.

    Raises:
        AdapterError: any check fails; the message names the file and the field or tensor.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"{path}: adapter file not found")
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            entries = {}
            for key in handle.keys():
                sliced = handle.get_slice(key)
                entries[key] = TensorEntry(tuple(sliced.get_shape()), str(sliced.get_dtype()))
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from exc

    fmt = metadata.get("format")
    if fmt != ADAPTER_FORMAT:
        raise AdapterError(f"{path}: metadata format={fmt!r}, expected {ADAPTER_FORMAT!r}")
    stated_base = metadata.get("base_model", "")
    if stated_base.casefold() != base_model.casefold():
        raise AdapterError(f"{path}: adapter base_model={stated_base!r} but the checkpoint is {base_model!r}")
    application = metadata.get("application")
    if application is not None and "W_base + lora_B @ lora_A" not in application:
        raise AdapterError(f"{path}: metadata application={application!r} is not the scale-1 '{APPLICATION}'")
    try:
        rank = int(metadata["rank"])
    except (KeyError, ValueError):
        raise AdapterError(f"{path}: metadata rank={metadata.get('rank')!r} is not an integer") from None

    seen = dict.fromkeys(COUNT_KEYS, 0)
    pair_ranks: dict[str, dict[str, int]] = {}
    for key, entry in entries.items():
        module, role = split_adapter_key(key)
        try:
            native_target(module)
        except AdapterError as exc:
            raise AdapterError(f"{path}: tensor {key!r}: {exc}") from None
        if role in ("lora_A", "lora_B"):
            seen["low_rank_tensors"] += 1
            if len(entry.shape) != 2:
                raise AdapterError(f"{path}: tensor {key!r} has shape {entry.shape}, expected a 2-D factor")
            pair_ranks.setdefault(module, {})[role] = entry.shape[0 if role == "lora_A" else 1]
        elif role in ("diff", "diff_b"):
            seen["diff_tensors"] += 1
        else:
            seen["set_weight_tensors"] += 1
    for module, ranks in sorted(pair_ranks.items()):
        if set(ranks) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(ranks)).pop()
            raise AdapterError(f"{path}: {module}.{missing}.weight is missing (unpaired LoRA factor)")
        if ranks["lora_A"] != ranks["lora_B"] or ranks["lora_A"] > rank:
            raise AdapterError(f"{path}: {module} factors have ranks A={ranks['lora_A']} B={ranks['lora_B']}, "
                               f"metadata rank={rank}")
    if pair_ranks and max(r["lora_A"] for r in pair_ranks.values()) != rank:
        raise AdapterError(f"{path}: metadata rank={rank} but the largest factor rank is "
                           f"{max(r['lora_A'] for r in pair_ranks.values())}")
    counts = {}
    for key in COUNT_KEYS:
        declared = metadata.get(key)
        if declared is None:
            raise AdapterError(f"{path}: metadata {key} is missing (the writer states every tensor count)")
        try:
            counts[key] = int(declared)
        except ValueError:
            raise AdapterError(f"{path}: metadata {key}={declared!r} is not an integer") from None
        if counts[key] != seen[key]:
            raise AdapterError(f"{path}: metadata {key}={counts[key]} but the file holds {seen[key]}")

    return Adapter(path=path, metadata=metadata, sha256=_file_sha256(path), base_model=stated_base,
                   finetuned_model=metadata.get("finetuned_model", ""), rank=rank, counts=counts, entries=entries)


# ---------------------------------------------------------------------------------------------- fusion


@dataclass
class _Patch:
    """Everything the adapter contributes to one native parameter."""

    layout: str
    # slot (None for plain/gate_value, 0/1/2 for q/k/v) -> adapter keys of (lora_A, lora_B) and of the diff
    lora: dict[int | None, tuple[str, str]] = field(default_factory=dict)
    diff: dict[int | None, str] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)


class AdapterFusion:
    """Per-tensor hook that fuses a FastH3 adapter into DiT weights while the checkpoint streams.

    Call it with every native DiT tensor; it returns the tensor to load. A targeted tensor is rebuilt in fp32 on
    ``device`` (``W + B·A + diff``, or the ``.set_weight`` value) and cast back to the input's dtype; the result
    lives on ``device``. Untargeted tensors come back unchanged. Then call ``finish()``.

    A ``.set_weight`` parameter (a VSA gate) is assigned when the stream carries it; our DiT has no such module, so
    a loader refuses ``adapter.requires_vsa`` before fusing (else ``finish()`` names the gate never streamed).

    Args:
        adapter: from ``read_adapter``.
        dit_config: the checkpoint's DiT config.
        device: where deltas are computed (the GPU the shards stream to).

    Raises:
        AdapterError: at construction, when a tensor's shape does not fit the config or a block / refiner block
            is left untouched or does not exist; at call, on a repeated name or a shape mismatch.
    """

    def __init__(self, adapter: Adapter, dit_config: DiTConfig, device: torch.device | str = "cpu"):
        self.adapter = adapter
        self.device = torch.device(device)
        self._heads = dit_config.num_attention_heads
        self._head_dim = dit_config.attention_head_dim
        self._shapes = native_shapes(dit_config)
        self._patches: dict[str, _Patch] = {}
        self._assign: dict[str, str] = {}
        touched: dict[str, set[int]] = {}
        for key, entry in adapter.entries.items():
            module, role = split_adapter_key(key)
            target = native_target(module)
            param = f"{target.native}.{'bias' if role == 'diff_b' else 'weight'}"
            if param not in self._shapes:
                raise AdapterError(f"{adapter.path}: tensor {key!r} targets {param!r}, which this DiT config "
                                   f"does not have (unknown target)")
            self._check_shape(key, entry.shape, role, target, self._shapes[param])
            if target.block is not None:
                touched.setdefault(target.block[0], set()).add(target.block[1])
            if role == "set_weight":
                self._assign[param] = key
                continue
            patch = self._patches.setdefault(param, _Patch(target.layout))
            patch.keys.append(key)
            if role in ("diff", "diff_b"):
                patch.diff[target.slot] = key
            else:
                lora_a, lora_b = (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
                patch.lora[target.slot] = (lora_a, lora_b)
        for param in self._assign:
            if param in self._patches:
                raise AdapterError(f"{adapter.path}: {param!r} is both assigned (.set_weight) and patched")
        for native_prefix, _, count_field in STACKS:
            count = getattr(dit_config, count_field)
            untouched = sorted(set(range(count)) - touched.get(native_prefix, set()))
            if untouched:
                raise AdapterError(f"{adapter.path}: adapter leaves {native_prefix}{untouched[0]} untouched "
                                   f"({len(untouched)} of {count} {native_prefix}* blocks; {count_field}={count})")
        self._applied: set[str] = set()
        self._handle = None

    def _check_shape(self, key: str, shape: tuple[int, ...], role: str, target: Target,
                     native: tuple[int, ...]) -> None:
        # The delta one adapter tensor describes, before placement into a fused layout.
        out, inp = (native[0] // 3, native[1]) if target.layout == QKV else (native + (None,))[:2]
        if role == "lora_A":
            ok = len(shape) == 2 and shape[1] == inp
        elif role == "lora_B":
            ok = len(shape) == 2 and shape[0] == out
        elif role == "diff_b" or target.layout != QKV:
            ok = shape == native
        else:
            ok = shape == (out, inp)
        if not ok:
            raise AdapterError(f"{self.adapter.path}: tensor {key!r} has shape {shape}, which does not fit "
                               f"{target.native} {native} of this DiT config")

    def _read(self, key: str) -> torch.Tensor:
        if self._handle is None:
            self._handle = safe_open(self.adapter.path, framework="pt", device="cpu")
        return self._handle.get_tensor(key).to(self.device).to(torch.float32)

    def _slot_delta(self, patch: _Patch, slot: int | None) -> torch.Tensor | None:
        """fp32 delta in the diffusers row order of one slot: B·A (+ diff). [out, in] or [out]."""
        delta = None
        if slot in patch.lora:
            key_a, key_b = patch.lora[slot]
            delta = self._read(key_b) @ self._read(key_a)  # [out, r] @ [r, in] -> [out, in]
        if slot in patch.diff:
            diff = self._read(patch.diff[slot])
            delta = diff if delta is None else delta.add_(diff)
        return delta

    def __call__(self, native_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Return ``tensor`` with the adapter's contribution; unchanged when the adapter does not target it."""
        if native_name not in self._patches and native_name not in self._assign:
            return tensor
        if native_name in self._applied:
            raise AdapterError(f"{self.adapter.path}: checkpoint streamed {native_name!r} twice")
        if tuple(tensor.shape) != self._shapes[native_name]:
            raise AdapterError(f"{self.adapter.path}: checkpoint tensor {native_name!r} has shape "
                               f"{tuple(tensor.shape)}, the DiT config says {self._shapes[native_name]}")
        self._applied.add(native_name)
        if native_name in self._assign:
            return self._read(self._assign[native_name]).to(tensor.dtype)
        patch = self._patches[native_name]
        # Move in the stored dtype, widen on the device; copy=True so the caller's tensor is never updated.
        weight = tensor.to(self.device).to(torch.float32, copy=True)
        if patch.layout == QKV:
            for slot in (0, 1, 2):
                delta = self._slot_delta(patch, slot)
                if delta is not None:  # [H·D, in] -> [H, D, in], into rows `slot` of every head
                    rows = qkv_slot(weight, slot, self._heads, self._head_dim)
                    rows += delta.view(self._heads, self._head_dim, -1)
        else:
            delta = self._slot_delta(patch, None)
            if patch.layout == GATE_VALUE and native_name.endswith(".weight"):
                delta = swap_halves(delta)  # diffusers [value; gate] -> native [gate; value]
            weight += delta
        return weight.to(tensor.dtype)

    def finish(self) -> None:
        """Close the fusion: every adapter tensor must have reached its parameter.

        Raises:
            AdapterError: naming the first parameter the stream never provided (and how many).
        """
        self._handle = None
        missing = sorted((set(self._patches) | set(self._assign)) - self._applied)
        if missing:
            raise AdapterError(f"{self.adapter.path}: the checkpoint never provided {missing[0]!r} "
                               f"({len(missing)} adapter targets unconsumed)")


# ---------------------------------------------------------------------------------------------- schedules


def positions_from_steps(steps: Sequence[int], where: str = "dmd_denoising_steps") -> tuple[float, ...]:
    """DMD timestep indices out of 1000 (e.g. [999, 749, 500, 250]) -> positions with the terminal 0 appended.

    Raises:
        ValueError: not integers in 1..1000 strictly decreasing (names ``where``).
    """
    values = list(steps)
    if (not values or any(not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1000 for v in values)
            or any(b >= a for a, b in zip(values, values[1:]))):
        raise ValueError(f"{where}={values!r}: expected strictly decreasing integers in 1..1000")
    return tuple(v / 1000 for v in values) + (0.0,)


def _parse_steps(raw: Any, where: str) -> tuple[float, ...]:
    # Header metadata values are strings: "[999, 749, 500, 250]" or "999,749,500,250".
    if isinstance(raw, str):
        text = raw.strip()
        try:
            raw = json.loads(text) if text.startswith("[") else [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"{where}={text!r}: not a list of integers") from None
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}={raw!r}: not a list of integers")
    return positions_from_steps(raw, where)


@dataclass(frozen=True)
class FastH3V2Contract:
    """V2's ``fastvideo_inference.json``: the full 8-forward checkpoint's own sampling contract.

    Identified by ``schema_version == "fasth3-inference-contract-v1"`` and ``model_id ==
    "FastVideo/FastVideo-FastH3-8-Step-V2"``. It was trained with video sparse attention (``attention_backend``,
    ``vsa_sparsity``); h3render runs dense attention.
    """

    positions: tuple[float, ...]
    video_shift: float
    audio_shift: float
    attention_backend: str
    vsa_sparsity: float | None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> FastH3V2Contract:
        """Validate the contract.

        Raises:
            ValueError: a field disagrees with the V2 release (names the field).
        """
        required = {"model_id": V2_MODEL_ID, "schema_version": V2_SCHEMA, "transformer_forwards": 8,
                    "guidance_scale": 1.0, "task": "t2av"}
        for key, expected in required.items():
            if metadata.get(key) != expected:
                raise ValueError(f"FastH3 V2 contract: {key}={metadata.get(key)!r}, expected {expected!r}")
        positions = _parse_steps(metadata.get("dmd_denoising_steps"), "FastH3 V2 contract dmd_denoising_steps")
        if len(positions) - 1 != metadata["transformer_forwards"]:
            raise ValueError(f"FastH3 V2 contract: {len(positions) - 1} dmd_denoising_steps for "
                             f"transformer_forwards={metadata['transformer_forwards']}")
        shifts = []
        for key in ("video_scheduler_shift", "audio_scheduler_shift"):
            value = metadata.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"FastH3 V2 contract: {key}={value!r} is not a positive number")
            shifts.append(float(value))
        return cls(positions, shifts[0], shifts[1], str(metadata.get("attention_backend", "")),
                   metadata.get("vsa_sparsity"))


V2_CONTRACT_FILE = "fastvideo_inference.json"


def read_v2_contract(checkpoint: str | Path) -> dict[str, Any] | None:
    """V2's inference contract if `checkpoint` (a folder, or a partition inside one) carries a valid one, else None.

    Raises:
        ValueError: the file exists and claims to be V2 but a field disagrees with the release (names the field).
    """
    path = Path(checkpoint)
    for folder in (path, path.parent):
        candidate = folder / V2_CONTRACT_FILE
        if folder.is_dir() and candidate.is_file():
            try:
                meta = json.loads(candidate.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{candidate}: unreadable FastH3 contract: {exc}") from None
            if is_fasth3_v2(meta):
                FastH3V2Contract.from_metadata(meta)
                return meta
    return None


def is_fasth3_v2(metadata: Mapping[str, Any] | None) -> bool:
    """Whether ``metadata`` is V2's inference contract (by its schema_version and model_id)."""
    return bool(metadata) and metadata.get("schema_version") == V2_SCHEMA and metadata.get("model_id") == V2_MODEL_ID


def fasth3_schedule(metadata: Adapter | Mapping[str, Any] | None = None,
                    video_shift: float = RELEASED_VIDEO_SHIFT, audio_shift: float = RELEASED_AUDIO_SHIFT,
                    *, positions: str | None = None) -> Schedule:
    """Build the FastH3 schedule: pre-shift positions, then the per-modality shift on top.

    Positions, first that applies:
      1. ``positions`` names a set in ``POSITION_SETS`` (e.g. ``"fastvideo-example"`` = linspace(1, 0, 5));
      2. ``metadata`` is V2's contract: its 9 positions and ITS shifts (video 10, audio 3) — the arguments are not
         used, since V2 was distilled at those;
      3. ``metadata`` (adapter header, checkpoint json, or an ``adapter_manifest.json`` with
         ``sampling.base_timesteps``) states ``dmd_denoising_steps`` -> source ``"adapter metadata"``;
      4. otherwise the release default [999, 749, 500, 250] -> (0.999, 0.749, 0.5, 0.25, 0), ``"release default"``.

    Args:
        video_shift / audio_shift: the checkpoint's shifts (released 12 / 3).

    Raises:
        ValueError: unknown named set, malformed steps, or an invalid V2 contract.
    """
    meta: Mapping[str, Any] = (metadata.metadata if isinstance(metadata, Adapter) else metadata) or {}
    if positions is not None:
        if positions not in POSITION_SETS:
            raise ValueError(f"unknown FastH3 position set {positions!r}; known: {sorted(POSITION_SETS)}")
        chosen, source = POSITION_SETS[positions], f"named set {positions!r}"
    elif is_fasth3_v2(meta):
        contract = FastH3V2Contract.from_metadata(meta)
        chosen, source = contract.positions, "FastH3 V2 contract"
        video_shift, audio_shift = contract.video_shift, contract.audio_shift
    elif "dmd_denoising_steps" in meta:
        chosen, source = _parse_steps(meta["dmd_denoising_steps"], "dmd_denoising_steps"), "adapter metadata"
    elif isinstance(meta.get("sampling"), Mapping) and "base_timesteps" in meta["sampling"]:
        chosen = _parse_steps(meta["sampling"]["base_timesteps"], "sampling.base_timesteps")
        source = "adapter metadata"
    else:
        chosen, source = positions_from_steps(RELEASE_DMD_STEPS), "release default"
    return Schedule.few_step(chosen, video_shift, audio_shift, source)
