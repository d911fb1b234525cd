"""FastH3: FastVideo's few-step DMD2 student of MiniMax-H3, fused into the DiT at load time.

FastH3 v1 ships as a ``fastvideo-lora-v2`` safetensors adapter over the base checkpoint (t2va only, 4 forwards).
It is not a switchable LoRA. The file's own ``application`` metadata states the reconstruction:

    W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned

- ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r]: rank-r factors (released rank 64).
  The released files carry no alpha (scale 1); a ``<module>.alpha`` / ``.lora_alpha`` scalar scales that module's
  product by alpha / r, as FastVideo 0.2.1 does (``layers/lora/linear.py``: ``lora_alpha / lora_rank``).
- ``<module>.diff`` / ``<module>.diff_b``: full-rank deltas for a weight / bias (norms, biases, patch projections).
- ``<module>.set_weight``: a whole parameter assigned, used by the VSA variants for ``attn.to_gate_compress``
  (our ``attn.gate_proj``, built by ``DiT.enable_vsa``).

Key spellings folded as FastVideo 0.2.1 ``models/loader/lora_patch.normalize_lora_key`` does: a ``diffusion_model.``
prefix, PEFT's adapter-name infix ``.lora_A.<name>.weight``, kohya's ``lora_down`` / ``lora_up`` and bare
``.alpha``; also PEFT's ``base_model.model.`` prefix (FastVideo leaves it on and then matches no layer).

Header metadata (all values strings), as written by FastVideo's ``finalize_adapter.py``: ``format``
(``"fastvideo-lora-v2"``), ``base_model`` (``"MiniMaxAI/MiniMax-H3"``), ``finetuned_model``, ``rank``,
``application``, ``low_rank_tensors`` (lora_A plus lora_B tensors), ``diff_tensors`` (.diff plus .diff_b),
``set_weight_tensors``. A file without the ``fastvideo-lora-v2`` tag (a plain PEFT/kohya LoRA) is read with the
same tensor rules; its counts and rank are checked only where it states them.

Tensor names are in the diffusers namespace (``transformer_blocks.{i}.attn.to_q``); our DiT uses the native
official names (``blocks.{i}.attn.qkv_proj`` with q/k/v rows interleaved per head, ``blocks.{i}.mlp.fc1``
gate-first). The mapping is the one table of ``h3render.checkpoint.names``.

Sampling: the student was distilled at pre-shift positions that the checkpoint's per-modality shifts (video 12,
audio 3) are applied on top of; ``fasth3_schedule`` turns them (or a full checkpoint's contract,
``h3render.checkpoint.contract``) into the few-step ``h3render.sampling.Schedule`` (both in ``contract``).

Sources: FastVideo 0.2.1 (``fastvideo/models/loader/lora_patch.py``, ``fastvideo/pipelines/lora_pipeline.py``,
``examples/inference/basic/basic_fasth3.py``), FastVideo ``scripts/lora_extraction/finalize_adapter.py``,
vLLM-Omni ``minimax_h3/fasth3.py`` and ``fasth3_checkpoint.py``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from h3render.checkpoint.adapter_checks import check_dtypes, check_fused, check_values, known_digest, scan_file
from h3render.checkpoint.contract import CONTRACT_FILE
from h3render.checkpoint.errors import AdapterError
from h3render.checkpoint.names import (GATE_VALUE, QKV, STACKS, VSA_GATE, VSA_GATE_NATIVE, Target, dit_shapes,
                                       native_module, qkv_slot, swap_halves)
from h3render.checkpoint.stream import Entry
from h3render.models.dit_config import DiTConfig

# Format tag FastVideo's writer stamps into the header (generic container, not FastH3-specific).
ADAPTER_FORMAT = "fastvideo-lora-v2"
# Base model id the released FastH3 adapters state (vLLM-Omni fasth3.py, FastVideo adapter headers).
RELEASED_BASE_MODEL = "MiniMaxAI/MiniMax-H3"
# Base model id the synthetic adapter for h3render's tiny/small random checkpoints states.
TINY_BASE_MODEL = "h3render/tiny-random-h3"
# The reconstruction the format states; an adapter stating another is refused.
APPLICATION = "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned"
COUNT_KEYS = ("low_rank_tensors", "diff_tensors", "set_weight_tensors")
# Diffusers modules FastVideo 0.2.1 never wraps with a LoRA layer (its H3 pipeline silently drops factors on them):
# a low-rank pair there is an error. Their .diff/.diff_b deltas apply as usual.
UNWRAPPED_MODULES = ("proj_in", "audio_proj_in", "context_embedder", "time_embedder", "proj_out", "audio_proj_out")
V2_CONTRACT_FILE = CONTRACT_FILE

# ---------------------------------------------------------------------------------------------- names

# Adapter key suffix (after `normalize_key`) -> role. ``.diff_b`` is tested before ``.diff``.
_ROLES = (
    (".lora_A.weight", "lora_A"),
    (".lora_B.weight", "lora_B"),
    (".lora_alpha", "lora_alpha"),
    (".diff_b", "diff_b"),
    (".diff", "diff"),
    (".set_weight", "set_weight"),
)
_LOW_RANK_ROLES = ("lora_A", "lora_B", "lora_alpha")
_PREFIXES = ("base_model.model.", "diffusion_model.")
_ADAPTER_NAME_INFIX = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # PEFT `.lora_A.<adapter name>.weight`
_ALIASES = ((".lora_down.weight", ".lora_A.weight"), (".lora_up.weight", ".lora_B.weight"))


def normalize_key(key: str) -> str:
    """An adapter tensor name in this module's spelling: ``base_model.model.`` / ``diffusion_model.`` prefixes
    dropped, ``.lora_A.<name>.weight`` -> ``.lora_A.weight``, ``lora_down``/``lora_up`` -> ``lora_A``/``lora_B``,
    ``.alpha`` -> ``.lora_alpha`` (the spellings FastVideo 0.2.1 folds, plus PEFT's prefix)."""
    name = key
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    name = _ADAPTER_NAME_INFIX.sub(r".\1.weight", name)
    for alias, canonical in _ALIASES:
        if name.endswith(alias):
            name = name[: -len(alias)] + canonical
    if name.endswith(".alpha") and not name.endswith(".lora_alpha"):
        name = name[: -len(".alpha")] + ".lora_alpha"
    return name


def native_target(module: str) -> Target:
    """Map a diffusers-namespace module path (``transformer_blocks.3.attn.to_q``) to its native target
    (``h3render.checkpoint.names``, the VSA gate ``attn.to_gate_compress`` -> ``attn.gate_proj`` included).

    Raises:
        AdapterError: the module names no known MiniMax-H3 DiT module.
    """
    target = native_module(module)
    if target is None:
        raise AdapterError(f"adapter module {module!r} names no MiniMax-H3 DiT module (unknown target)")
    return target


def split_adapter_key(key: str) -> tuple[str, str]:
    """Split a normalized adapter tensor name into (module path, role); role in lora_A/lora_B/lora_alpha/diff/
    diff_b/set_weight.

    Raises:
        AdapterError: the key has none of the format's suffixes.
    """
    for suffix, role in _ROLES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    raise AdapterError(f"adapter tensor {key!r} is not a LoRA / {ADAPTER_FORMAT} payload (unknown suffix)")


def native_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native parameter name -> shape of every parameter an adapter may target: the dense DiT's own
    (``dit_shapes``) plus the VSA gates ``blocks.{i}.attn.gate_proj.weight`` [H·D, hidden] (``DiT.enable_vsa``)."""
    shapes = dit_shapes(config)
    inner = config.num_attention_heads * config.attention_head_dim
    for i in range(config.num_layers):
        shapes[f"blocks.{i}.{VSA_GATE_NATIVE}.weight"] = (inner, config.hidden_size)
    return shapes


def _unwrapped(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in UNWRAPPED_MODULES)


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class TensorEntry:
    """One adapter tensor as its header describes it (no data read); ``key`` is its name in the file."""

    shape: tuple[int, ...]
    dtype: str
    key: str = ""


@dataclass(frozen=True)
class Adapter:
    """A validated adapter: header metadata and tensor index (normalized names); data is read on demand.

    ``counts`` holds the tensor counts (stated ones verified). ``alphas`` maps a module to its alpha (its
    product is scaled by alpha / rank). ``warnings`` are non-fatal findings (an unstated or local-path
    ``base_model``). ``sha256`` is the hex digest of the whole file, read when first asked for (the sidecar):
    the CLI's one check reads the header only.
    """

    path: Path
    metadata: dict[str, str]
    base_model: str
    finetuned_model: str
    rank: int
    counts: dict[str, int]
    entries: dict[str, TensorEntry] = field(repr=False)
    alphas: dict[str, float] = field(default_factory=dict, repr=False)
    warnings: tuple[str, ...] = ()

    @functools.cached_property
    def sha256(self) -> str:
        return _file_sha256(self.path)

    @property
    def gate_blocks(self) -> tuple[int, ...]:
        """Block indices whose ``attn.to_gate_compress`` gate the adapter assigns (``.set_weight``)."""
        found = []
        for key in self.entries:
            module, role = split_adapter_key(key)
            target = native_target(module)
            if role == "set_weight" and target.native.endswith(VSA_GATE_NATIVE):
                found.append(target.block[1])
        return tuple(sorted(found))

    @property
    def requires_vsa(self) -> bool:
        """True for sparse-attention variants: they assign ``attn.to_gate_compress`` gates."""
        return bool(self.gate_blocks)

    def scale(self, module: str) -> float:
        """The factor of ``module``'s ``lora_B @ lora_A``: alpha / rank, 1 without an alpha."""
        if module not in self.alphas:
            return 1.0
        return self.alphas[module] / self.entries[f"{module}.lora_A.weight"].shape[0]

    def tensor(self, key: str) -> torch.Tensor:
        """Read one tensor (normalized name) from the file (CPU, stored dtype).

        Raises:
            AdapterError: the adapter has no tensor ``key``.
        """
        if key not in self.entries:
            raise AdapterError(f"{self.path}: no tensor {key!r}")
        with safe_open(self.path, framework="pt", device="cpu") as handle:
            return handle.get_tensor(self.entries[key].key or key)


def _file_sha256(path: Path) -> str:
    known = known_digest(path)  # the one check's scan hashed this very file already
    if known is not None:
        return known
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 23), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _looks_local(model: str) -> bool:
    # A hub id is "org/name"; anything path-like is a local folder whose identity cannot be checked.
    return model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") != 1 or Path(model).exists()


def check_base_model(stated: str, expected: str, where: str) -> str | None:
    """FastVideo-compatible ``base_model`` policy: the checkpoint's id (case-insensitive) passes; empty or a local
    path is a warning (returned); another model id is an error.

    Raises:
        AdapterError: ``stated`` names another model.
    """
    if not stated.strip():
        return f"{where}: adapter states no base_model; assuming it fits {expected!r}"
    if stated.casefold() == expected.casefold():
        return None
    if _looks_local(stated):
        return f"{where}: adapter base_model={stated!r} is a local path; assuming it is {expected!r}"
    raise AdapterError(f"{where}: adapter base_model={stated!r} but the checkpoint is {expected!r}")


def _count(metadata: Mapping[str, str], key: str, path: Path) -> int | None:
    declared = metadata.get(key)
    if declared is None:
        return None
    try:
        return int(declared)
    except ValueError:
        raise AdapterError(f"{path}: metadata {key}={declared!r} is not an integer") from None


def read_adapter(path: str | Path, base_model: str = RELEASED_BASE_MODEL) -> Adapter:
    """Open and validate a FastH3 adapter file (header and alpha scalars only; tensor data stays on disk).

    Args:
        path: the adapter ``.safetensors`` file, or a folder holding ``adapter_model.safetensors`` (bundles and
            variants: ``h3render.checkpoint.students.resolve_adapter``).
        base_model: the id of the checkpoint it will be fused into (released: ``"MiniMaxAI/MiniMax-H3"``;
            h3render's random checkpoints: ``TINY_BASE_MODEL``).

    Checks: ``format`` is ``fastvideo-lora-v2`` (then ``rank`` and the three counts are required) or absent/"pt"
    (a plain LoRA); ``base_model`` as ``check_base_model``; ``application`` (when stated) is the B·A
    reconstruction; every name has a known suffix, maps to a DiT module, and is unique after normalizing; no
    low-rank pair on ``UNWRAPPED_MODULES``; pairs complete, ranks ≤ ``rank`` with the largest equal to it; an alpha
    is a positive finite scalar of a pair; stated counts match the file.

    Raises:
        AdapterError: any check fails; the message names the file and the field or tensor(s).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterError(f"{path}: adapter file not found")
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            raw = {key: handle.get_slice(key) for key in handle.keys()}
            entries = {key: TensorEntry(tuple(s.get_shape()), str(s.get_dtype()), key) for key, s in raw.items()}
            alpha_values = {key: handle.get_tensor(key) for key in raw
                            if split_role(normalize_key(key)) == "lora_alpha"}
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from exc
    check_dtypes(path, entries, frozenset(alpha_values))

    fmt = metadata.get("format")
    fastvideo = fmt == ADAPTER_FORMAT
    if not fastvideo and fmt not in (None, "pt"):
        raise AdapterError(f"{path}: metadata format={fmt!r}, expected {ADAPTER_FORMAT!r} (or a plain LoRA)")
    warnings = [w for w in [check_base_model(metadata.get("base_model", ""), base_model, str(path))] if w]
    if not fastvideo:
        warnings.append(f"{path}: no {ADAPTER_FORMAT!r} header; read as a plain LoRA (counts unchecked)")
    application = metadata.get("application")
    if application is not None and "W_base + lora_B @ lora_A" not in application:
        raise AdapterError(f"{path}: metadata application={application!r} is not '{APPLICATION}'")

    normalized: dict[str, TensorEntry] = {}
    for key, entry in entries.items():
        name = normalize_key(key)
        if name in normalized:
            raise AdapterError(f"{path}: tensors {normalized[name].key!r} and {key!r} are the same {name!r}")
        normalized[name] = entry
    seen = dict.fromkeys(COUNT_KEYS, 0)
    pair_ranks: dict[str, dict[str, int]] = {}
    alphas: dict[str, float] = {}
    unwrapped: set[str] = set()
    for name, entry in normalized.items():
        module, role = split_adapter_key(name)
        try:
            native_target(module)
        except AdapterError as exc:
            raise AdapterError(f"{path}: tensor {entry.key!r}: {exc}") from None
        if role in _LOW_RANK_ROLES and (_unwrapped(module) or module.endswith(VSA_GATE)):
            unwrapped.add(module)
        if role in ("lora_A", "lora_B"):
            seen["low_rank_tensors"] += 1
            if len(entry.shape) != 2:
                raise AdapterError(f"{path}: tensor {entry.key!r} has shape {entry.shape}, expected a 2-D factor")
            pair_ranks.setdefault(module, {})[role] = entry.shape[0 if role == "lora_A" else 1]
        elif role == "lora_alpha":
            value = alpha_values[entry.key]
            alpha = float(value.reshape(-1)[0]) if value.numel() == 1 else math.nan
            if not (math.isfinite(alpha) and alpha > 0):
                raise AdapterError(f"{path}: tensor {entry.key!r} (alpha) must be one positive finite number, got "
                                   f"shape {tuple(value.shape)} value {value.flatten()[:3].tolist()}")
            alphas[module] = alpha
        elif role in ("diff", "diff_b"):
            seen["diff_tensors"] += 1
        else:
            seen["set_weight_tensors"] += 1
    if unwrapped:
        raise AdapterError(f"{path}: LoRA factors on modules FastVideo never wraps (it would drop them): "
                           f"{', '.join(sorted(unwrapped))}; state their change as .diff/.diff_b")
    for module in sorted(alphas):
        if module not in pair_ranks:
            raise AdapterError(f"{path}: {module}.lora_alpha has no lora_A/lora_B pair")
    for module, ranks in sorted(pair_ranks.items()):
        if set(ranks) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(ranks)).pop()
            raise AdapterError(f"{path}: {module}.{missing}.weight is missing (unpaired LoRA factor)")
        if ranks["lora_A"] != ranks["lora_B"]:
            raise AdapterError(f"{path}: {module} factors have ranks A={ranks['lora_A']} B={ranks['lora_B']}")
    largest = max((r["lora_A"] for r in pair_ranks.values()), default=0)
    if "rank" in metadata or fastvideo:
        try:
            rank = int(metadata["rank"])
        except (KeyError, ValueError):
            raise AdapterError(f"{path}: metadata rank={metadata.get('rank')!r} is not an integer") from None
        if pair_ranks and largest != rank:
            raise AdapterError(f"{path}: metadata rank={rank} but the largest factor rank is {largest}")
    else:
        rank = largest
    counts = {}
    for key in COUNT_KEYS:
        declared = _count(metadata, key, path)
        if declared is None and fastvideo:
            raise AdapterError(f"{path}: metadata {key} is missing (the writer states every tensor count)")
        if declared is not None and declared != seen[key]:
            raise AdapterError(f"{path}: metadata {key}={declared} but the file holds {seen[key]}")
        counts[key] = seen[key]

    return Adapter(path=path, metadata=metadata, base_model=metadata.get("base_model", ""),
                   finetuned_model=metadata.get("finetuned_model", ""), rank=rank, counts=counts,
                   entries=normalized, alphas=alphas, warnings=tuple(warnings))


def check_adapter(path: str | Path, base_model: str = RELEASED_BASE_MODEL) -> Adapter:
    """The up-front check of an adapter file, before any weights load: `read_adapter`'s header checks (a corrupt
    safetensors header, names, shapes, counts, dtypes), then every tensor's values (`scan_adapter`).

    Raises:
        AdapterError: the first problem, one line.
    """
    adapter = read_adapter(path, base_model=base_model)
    scan_adapter(adapter)
    return adapter


def scan_adapter(adapter: Adapter) -> str:
    """Every tensor's values of a read adapter (`adapter_checks.check_values`: finite, within `MAX_ABS`; a
    ``.set_weight`` named as a VSA gate), in the one pass that also hashes the file (`adapter_checks.scan_file`):
    the digest becomes ``adapter.sha256``, so the check costs no read of the file the sidecar's hash did not.

    Returns: the sha256. Raises: AdapterError naming the file and the tensor.
    """
    gates = {entry.key or key for key, entry in adapter.entries.items() if split_adapter_key(key)[1] == "set_weight"}
    digest = scan_file(adapter.path, lambda key: "a VSA gate" if key in gates else "")
    adapter.__dict__["sha256"] = digest  # the cached_property's slot (a frozen dataclass has no setter)
    return digest


def split_role(name: str) -> str | None:
    """The role of a normalized name, or None for an unknown suffix (no error)."""
    return next((role for suffix, role in _ROLES if name.endswith(suffix)), None)


# ---------------------------------------------------------------------------------------------- fusion


@dataclass
class _Patch:
    """Everything the adapter contributes to one native parameter."""

    layout: str
    # slot (None for plain/gate_value, 0/1/2 for q/k/v) -> (module, key of lora_A, key of lora_B) and the diff key
    lora: dict[int | None, tuple[str, str, str]] = field(default_factory=dict)
    diff: dict[int | None, str] = field(default_factory=dict)


class AdapterFusion:
    """Per-tensor hook that fuses a FastH3 adapter into DiT weights while the checkpoint streams.

    Call it with every native DiT tensor; it returns the tensor to load. A targeted tensor is rebuilt in fp32 on
    ``device`` (``W + scale·B·A + diff``, or the ``.set_weight`` value) and cast back to the input's dtype; the
    result lives on ``device``. Untargeted tensors come back unchanged. Then call ``finish()``.

    The VSA gates a ``.set_weight`` assigns are absent from base checkpoints: ``entries(stream)`` passes a
    checkpoint's entries through and then adds one entry per gate the stream lacked, read from the adapter (the
    DiT must have the gates: ``DiT.enable_vsa`` before streaming). In-place fusion (``named_parameters`` of a DiT
    with VSA enabled) streams the zero gates itself.

    Args:
        adapter: from ``read_adapter``.
        dit_config: the checkpoint's DiT config.
        device: where deltas are computed (the GPU the shards stream to).

    Raises:
        AdapterError: at construction, when a tensor's shape does not fit the config, a block / refiner block is
            left untouched or does not exist, or a VSA adapter lacks some blocks' gates (named); at call, on a
            repeated name or a shape mismatch.
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
            if role == "lora_alpha":
                continue
            target = native_target(module)
            param = f"{target.native}.{'bias' if role == 'diff_b' else 'weight'}"
            if param not in self._shapes:
                raise AdapterError(f"{adapter.path}: tensor {entry.key!r} targets {param!r}, which this DiT config "
                                   f"does not have (unknown target)")
            if role == "set_weight" and not target.native.endswith(VSA_GATE_NATIVE):
                # FastVideo assigns whole weights only to the gates the base lacks; assigning one the base has
                # (to_q/k/v: a slot of our fused qkv) replaces trained weights and failed later as a size mismatch.
                raise AdapterError(f"{adapter.path}: tensor {entry.key!r} [{', '.join(map(str, entry.shape))}] "
                                   f"assigns {param} {list(self._shapes[param])}, a weight the base model has; "
                                   f".set_weight is for {VSA_GATE} only (state a change as .diff or a LoRA pair)")
            self._check_shape(entry.key, entry.shape, role, target, self._shapes[param])
            if target.block is not None:
                touched.setdefault(target.block[0], set()).add(target.block[1])
            if role == "set_weight":
                self._assign[param] = key
                continue
            patch = self._patches.setdefault(param, _Patch(target.layout))
            if role in ("diff", "diff_b"):
                patch.diff[target.slot] = key
            else:
                patch.lora[target.slot] = (module, f"{module}.lora_A.weight", f"{module}.lora_B.weight")
        for param in self._assign:
            if param in self._patches:
                raise AdapterError(f"{adapter.path}: {param!r} is both assigned (.set_weight) and patched")
        for native_prefix, _, count_field in STACKS:
            count = getattr(dit_config, count_field)
            untouched = sorted(set(range(count)) - touched.get(native_prefix, set()))
            if untouched:
                raise AdapterError(f"{adapter.path}: adapter leaves {native_prefix}{untouched[0]} untouched "
                                   f"({len(untouched)} of {count} {native_prefix}* blocks; {count_field}={count})")
        gates = adapter.gate_blocks
        if gates:
            lacking = sorted(set(range(dit_config.num_layers)) - set(gates))
            if lacking:
                raise AdapterError(f"{adapter.path}: a VSA adapter without the attn.to_gate_compress.set_weight gate "
                                   f"of blocks {lacking} ({len(gates)} of {dit_config.num_layers} present)")
        self._applied: set[str] = set()
        self._injected: set[str] = set()
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
        """One adapter tensor in fp32 on the device, its values checked (the loader refuses a corrupt one)."""
        if self._handle is None:
            self._handle = safe_open(self.adapter.path, framework="pt", device="cpu")
        tensor = self._handle.get_tensor(self.adapter.entries[key].key).to(self.device).to(torch.float32)
        check_values(self.adapter.path, self.adapter.entries[key].key or key, tensor,
                     "a VSA gate" if key in self._assign.values() else "")
        return tensor

    def _slot_delta(self, patch: _Patch, slot: int | None) -> torch.Tensor | None:
        """fp32 delta in the diffusers row order of one slot: scale·B·A (+ diff). [out, in] or [out]."""
        delta = None
        if slot in patch.lora:
            module, key_a, key_b = patch.lora[slot]
            delta = self._read(key_b) @ self._read(key_a)  # [out, r] @ [r, in] -> [out, in]
            scale = self.adapter.scale(module)
            if scale != 1.0:
                delta.mul_(scale)
        if slot in patch.diff:
            diff = self._read(patch.diff[slot])
            delta = diff if delta is None else delta.add_(diff)
        return delta

    def _gate(self, key: str) -> torch.Tensor:
        """An injected VSA gate (stored dtype, CPU), its values checked."""
        tensor = self.adapter.tensor(key)
        check_values(self.adapter.path, self.adapter.entries[key].key or key, tensor, "a VSA gate")
        return tensor

    @property
    def assigned(self) -> frozenset[str]:
        """Native names the adapter assigns whole (the VSA gates)."""
        return frozenset(self._assign)

    def entries(self, stream: Iterable[Entry]) -> Iterator[Entry]:
        """``stream`` unchanged, then an entry (read from the adapter) per assigned parameter it lacked."""
        seen = set()
        for entry in stream:
            seen.add(entry.name)
            yield entry
        for name in sorted(set(self._assign) - seen):
            self._injected.add(name)
            yield Entry(str(self.adapter.path), name, lambda key=self._assign[name]: self._gate(key))

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
        if native_name in self._injected:
            return tensor  # already the adapter's own value (`entries`)
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
        check_fused(self.adapter.path, native_name, weight)
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
