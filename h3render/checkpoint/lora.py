"""Per-job LoRAs (issue #25): read a LoRA file in any published MiniMax-H3 layout and normalise it to
(native module, down, up, scale) - the factors `h3render.checkpoint.lora_apply` fuses or runs beside the linears.

Formats (`LoraFile.format`), told apart by their key names; the reference is diffusers 0.42.1
``MiniMaxH3LoraLoaderMixin.lora_state_dict`` and ``_convert_non_diffusers_minimax_h3_lora_to_diffusers``:

| format       | key spelling (one pair)                                                | namespace | fused qkv rows   |
|--------------|------------------------------------------------------------------------|-----------|------------------|
| `diffusers`  | ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight`` (or bare)  | diffusers | split to_q/k/v   |
| `peft`       | ``base_model.model.transformer_blocks.0...lora_A.weight``, or bare      | diffusers | split to_q/k/v   |
|              | diffusers names with PEFT's ``.lora_A.<adapter>.weight`` infix         |           |                  |
| `ai-toolkit` | ``diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight``               | native    | [q_all;k_all;v_all] |
| `comfy`      | ``blocks.0.attn.qkv_proj.lora_A.weight`` (reference ``generate.py``)   | native    | [q_all;k_all;v_all] |
| `diffsynth`  | ``blocks.0.attn.qkv_proj.lora_A.default.weight``                       | native    | per-head interleaved (ours) |
| `kohya`      | ``...lora_down.weight`` / ``...lora_up.weight`` / ``....alpha`` over any of the above | as named | as named |
| `musubi`     | ``lora_unet_blocks_0_attn_qkv_proj.lora_down.weight`` (flattened kohya) | native    | [q_all;k_all;v_all] |
| `fastvideo`  | ``fastvideo-lora-v2`` header; diffusers names, bare                    | diffusers | split to_q/k/v   |

The turbo LoRAs are files of these layouts: lightx2v's MiniMax-H3 Turbo (``minimax_h3_fl2v_turbo_*``: a
"Diffusers" file and a "ComfyUI" one, ModelTC/Minimax-H3-Turbo README) and larryvrh's Turbo LoRA (alpha-less,
scale 1); what makes them turbo is their schedule (`h3render.checkpoint.lora_schedule`).

Scale of a pair: a per-module ``.alpha`` / ``.lora_alpha`` scalar gives alpha / rank (kohya); else a header
``alpha`` (lightx2v's 8-step file records its training alpha there; diffusers honours it as a network alpha) gives
alpha / rank per module; else 1 (the ``alpha == rank`` convention the published alpha-less files state). Mixed
ranks are normal (released LoRAs: 64 on attention/FFN, 16 on the AdaLN projections). A job's strength multiplies
the whole product: W + strength * scale * up @ down.

Which modules a LoRA may target: the DiT's linears (block and refiner attention q/k/v/out, FFN fc1/fc2, the AdaLN
projections, and the model-level projections: patch, condition, time embedder, final AdaLN and heads). Refused,
naming the file and key: a norm (no linear), FastH3's VSA gate ``attn.to_gate_compress`` (FastVideo never wraps it;
no base weight), a FastVideo-format pair on a module FastVideo never wraps (`adapter.UNWRAPPED_MODULES`), a
``transformer_ref.`` partition key (ref2va's DiT: not in this engine), DoRA's ``dora_scale``, full-rank
``.diff`` / ``.set_weight`` payloads (a FastH3 adapter: ``--adapter``), and any key of no known spelling.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from h3render.checkpoint.adapter import ADAPTER_FORMAT, UNWRAPPED_MODULES, _file_sha256
from h3render.checkpoint.adapter_checks import check_dtypes, check_values
from h3render.checkpoint.errors import AdapterError
from h3render.checkpoint.names import (GATE_VALUE, PLAIN, QKV, STACKS, TOP_MODULES, VSA_GATE,
                                       VSA_GATE_NATIVE, diffusers_modules, dit_shapes, interleave_qkv, native_module,
                                       swap_halves)
from h3render.models.dit_config import DiTConfig

FORMATS = ("diffusers", "peft", "ai-toolkit", "comfy", "diffsynth", "kohya", "musubi", "fastvideo")


class LoraError(AdapterError):
    """A LoRA file cannot be read or placed; the message names the file and the key (or field)."""


# Native linears a LoRA may target (module paths inside a block / refiner block, and model-level).
_BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")
_TOP_LINEARS = tuple(native for native, _ in TOP_MODULES if not native.endswith("norm"))
# Roles of a key suffix, tried in order (PEFT's adapter-name infix is folded first).
_ROLES = ((".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_down.weight", "down"),
          (".lora_up.weight", "up"), (".lora_alpha", "alpha"), (".alpha", "alpha"))
_INFIX = re.compile(r"\.(lora_[AB])\.([^.]+)\.weight$")
# musubi-tuner's flattened `lora_unet_` names -> native dotted paths (the vocabulary diffusers 0.42.1 matches).
_FLAT = (
    (r"blocks_(\d+)_attn_(qkv|out)_proj", r"blocks.\1.attn.\2_proj"),
    (r"blocks_(\d+)_mlp_fc([12])", r"blocks.\1.mlp.fc\2"),
    (r"blocks_(\d+)_adaln_proj_linear", r"blocks.\1.adaln_proj.linear"),
    (r"token_refiner_blocks_(\d+)_attn_(qkv|out)_proj", r"token_refiner.blocks.\1.attn.\2_proj"),
    (r"token_refiner_blocks_(\d+)_mlp_fc([12])", r"token_refiner.blocks.\1.mlp.fc\2"),
    (r"(video|audio)_patch_proj", r"\1_patch_proj"),
    (r"condition_proj", "condition_proj"),
    (r"time_embedder_proj_(in|out)", r"time_embedder.proj_\1"),
    (r"final_layer_adaln_proj_linear", "final_layer.adaln_proj.linear"),
    (r"final_layer_(video|audio)_out", r"final_layer.\1_out"),
)
# How a pair's up rows enter its native parameter.
NATIVE = "native"  # rows already in our order (a native-named pair, or a diffusers PLAIN one)
QKV_CONCAT = "qkv_concat"  # native qkv_proj named, rows [q_all; k_all; v_all] -> interleave per head


@dataclass(frozen=True)
class LoraPair:
    """One low-rank pair of a LoRA file, placed.

    Attributes:
        key_down, key_up: its tensors' names in the file ([r, in] and [out, r]).
        key_alpha: its per-module alpha scalar's name, or None.
        native: the native module it changes (``blocks.3.attn.qkv_proj``); the parameter is ``native + ".weight"``.
        rows: how ``up``'s rows enter that weight: NATIVE, QKV_CONCAT, QKV (with ``slot`` 0/1/2 for q/k/v: rows
            of one projection, scattered per head) or GATE_VALUE (diffusers [value; gate] -> native [gate; value]).
        rank: r.
    """

    key_down: str
    key_up: str
    key_alpha: str | None
    native: str
    rows: str
    slot: int | None
    rank: int
    shape_down: tuple[int, ...]
    shape_up: tuple[int, ...]


@dataclass(frozen=True)
class LoraFile:
    """A validated LoRA file: format, header metadata, placed pairs and their scales (data read on demand)."""

    path: Path
    format: str
    metadata: dict[str, str]
    pairs: tuple[LoraPair, ...]
    scales: tuple[float, ...]  # per pair: alpha / rank, or 1
    warnings: tuple[str, ...] = ()

    @functools.cached_property
    def sha256(self) -> str:
        return _file_sha256(self.path)

    @property
    def modules(self) -> tuple[str, ...]:
        """Native module paths the file changes, sorted."""
        return tuple(sorted({p.native for p in self.pairs}))

    def record(self, strength: float) -> dict:
        """The sidecar's entry of this LoRA at ``strength`` (docs/sidecar.md ``extra.loras``)."""
        ranks = sorted({p.rank for p in self.pairs})
        return {"file": str(self.path), "sha256": self.sha256, "strength": strength, "format": self.format,
                "ranks": ranks, "modules": len(self.modules), "modules_touched": list(self.modules)}

    def factors(self, config: DiTConfig, device: torch.device | str = "cpu") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The file's contribution per native weight, in fp32 on ``device``: ``{param: (down [R, in], up [out, R])}``
        with ``scale`` folded into ``up``'s columns and each pair's rows placed in our native row order, so that
        ``W_native + up @ down`` is the merged weight (strength 1). Pairs of one weight are concatenated along R
        (q, k and v of a qkv_proj: ``up`` holds each in its own rows, zeros elsewhere, exactly summing).

        Raises:
            LoraError: a factor's shape does not fit this DiT config, or its values are non-finite / out of bounds.
        """
        heads, head_dim = config.num_attention_heads, config.attention_head_dim
        shapes = _linear_shapes(config)
        grouped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        with safe_open(self.path, framework="pt", device="cpu") as handle:
            for pair, scale in zip(self.pairs, self.scales):
                param = pair.native + ".weight"
                if param not in shapes:
                    raise LoraError(f"{self.path}: tensor {pair.key_up!r} targets {pair.native!r}, which this DiT "
                                    f"config does not have (block index beyond num_layers / num_refiner_layers?)")
                out, inp = shapes[param]
                down = handle.get_tensor(pair.key_down).to(torch.float32)
                up = handle.get_tensor(pair.key_up).to(torch.float32)
                for key, t in ((pair.key_down, down), (pair.key_up, up)):
                    try:
                        check_values(self.path, key, t)
                    except AdapterError as exc:
                        raise LoraError(str(exc)) from None
                rows = out // 3 if pair.rows == QKV else out
                if down.shape[1] != inp or up.shape[0] != rows:
                    raise LoraError(f"{self.path}: pair {pair.key_down!r} [{tuple(down.shape)}] / {pair.key_up!r} "
                                    f"[{tuple(up.shape)}] does not fit {param} {shapes[param]} of this DiT config")
                up = up * scale
                if pair.rows == QKV:
                    placed = torch.zeros(out, pair.rank)
                    placed.view(heads, 3, head_dim, -1)[:, pair.slot] = up.view(heads, head_dim, -1)
                    up = placed
                elif pair.rows == QKV_CONCAT:
                    up = interleave_qkv(*up.chunk(3, dim=0), heads, head_dim)
                elif pair.rows == GATE_VALUE:
                    up = swap_halves(up)
                grouped.setdefault(param, []).append((down, up))
        return {param: (torch.cat([d for d, _ in parts]).to(device), torch.cat([u for _, u in parts], 1).to(device))
                for param, parts in grouped.items()}


@functools.lru_cache(maxsize=8)
def _linear_shapes(config: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Native weight name -> [out, in] of every linear a LoRA may target (the DiT built on the meta device)."""
    return {name: shape for name, shape in dit_shapes(config).items()
            if name.endswith(".weight") and _native_linear(name[: -len(".weight")])}


def with_alpha(lora: LoraFile, alpha: float) -> LoraFile:
    """``lora`` run at a network ``alpha`` (scale alpha / rank for every pair without a per-module alpha), as a
    publisher's instructions may say (lightx2v's 768p turbo file: ``--lora-alpha 128``)."""
    scales = tuple(s if p.key_alpha is not None else alpha / p.rank for p, s in zip(lora.pairs, lora.scales))
    return replace(lora, scales=scales, warnings=lora.warnings + (f"alpha {alpha:g} applied",))


def _unflatten(key: str, path: Path) -> str:
    """musubi-tuner's ``lora_unet_blocks_0_attn_qkv_proj.lora_down.weight`` -> ``blocks.0.attn.qkv_proj.lora_down
    .weight`` (H3's own names hold underscores, so the whole flat name is matched against the vocabulary)."""
    module, _, suffix = key.removeprefix("lora_unet_").partition(".")
    for pattern, replacement in _FLAT:
        if re.fullmatch(pattern, module):
            return f"{re.sub(pattern, replacement, module)}.{suffix}"
    raise LoraError(f"{path}: tensor {key!r} names no MiniMax-H3 module in musubi-tuner's flattened lora_unet_ layout")


def _native_linear(module: str) -> bool:
    for prefix, _, _ in STACKS:
        if module.startswith(prefix):
            index, _, rest = module[len(prefix):].partition(".")
            return index.isdigit() and rest in _BLOCK_LINEARS and not (rest == "adaln_proj.linear"
                                                                         and prefix != "blocks.")
    return module in _TOP_LINEARS


def _place(module: str, key: str, path: Path, fmt: str) -> tuple[str, str, int | None, str]:
    """(native module, rows, slot, namespace) of a module path in either namespace.

    Raises:
        LoraError: naming the file and key: no DiT module, a norm, the VSA gate, or an unwrapped FastVideo module.
    """
    if module.endswith(VSA_GATE) or module.endswith(VSA_GATE_NATIVE):
        raise LoraError(f"{path}: tensor {key!r} is a LoRA pair on the VSA gate {VSA_GATE} (FastVideo never wraps "
                        f"it with a LoRA layer and the base model has no such weight); state it as .set_weight")
    target = native_module(module)
    if target is not None:  # diffusers namespace
        if fmt == "fastvideo" and any(module == m or module.startswith(m + ".") for m in UNWRAPPED_MODULES):
            raise LoraError(f"{path}: tensor {key!r} is a LoRA pair on {module}, a module FastVideo never wraps "
                            f"(it would drop the pair); state its change as .diff/.diff_b")
        if not _native_linear(target.native):
            raise LoraError(f"{path}: tensor {key!r} targets {module} ({target.native}), which has no linear weight "
                            f"a LoRA can change (a norm)")
        rows = {QKV: QKV, GATE_VALUE: GATE_VALUE, PLAIN: NATIVE}[target.layout]
        return target.native, rows, target.slot, "diffusers"
    if diffusers_modules(module):  # native namespace
        if not _native_linear(module):
            raise LoraError(f"{path}: tensor {key!r} targets {module}, which has no linear weight a LoRA can change "
                            f"(a norm)")
        rows = QKV_CONCAT if module.endswith("attn.qkv_proj") and fmt != "diffsynth" else NATIVE
        return module, rows, None, "native"
    raise LoraError(f"{path}: tensor {key!r}: module {module!r} names no MiniMax-H3 DiT module (unknown key)")


def _detect(keys: list[str], metadata: dict[str, str]) -> str:
    """The file's format from its key spellings (see the module docstring)."""
    if metadata.get("format") == ADAPTER_FORMAT:
        return "fastvideo"
    if any(k.startswith("lora_unet_") for k in keys):
        return "musubi"
    if any(".lora_down." in k or k.endswith(".lora_down.weight") for k in keys):
        return "kohya"
    stripped = [k.removeprefix("diffusion_model.") for k in keys]
    native = any(k.startswith(("blocks.", "token_refiner.blocks.", "final_layer.")) for k in stripped)
    infix = any(_INFIX.search(k) for k in keys)
    if native:
        if infix:
            return "diffsynth"
        return "ai-toolkit" if any(k.startswith("diffusion_model.") for k in keys) else "comfy"
    if any(k.startswith("base_model.model.") for k in keys) or infix:
        return "peft"
    return "diffusers"


def _split(key: str, path: Path) -> tuple[str, str]:
    """A key without prefixes -> (module path, role down/up/alpha).

    Raises:
        LoraError: a DoRA magnitude, a full-rank FastH3 payload, or a suffix of no LoRA spelling.
    """
    name = _INFIX.sub(r".\1.weight", key)
    for suffix, role in _ROLES:
        if name.endswith(suffix):
            return name[: -len(suffix)], role
    if "dora_scale" in key or key.endswith(".lora_magnitude_vector"):
        raise LoraError(f"{path}: tensor {key!r} is a DoRA magnitude; DoRA LoRAs are not supported")
    if key.endswith((".diff", ".diff_b", ".set_weight")):
        raise LoraError(f"{path}: tensor {key!r} is a full-rank FastH3 adapter payload; a per-job LoRA carries "
                        f"low-rank pairs only (fuse a FastH3 adapter with --adapter)")
    raise LoraError(f"{path}: tensor {key!r} is not a LoRA tensor (no lora_A/lora_B/lora_down/lora_up/alpha suffix)")


def read_lora(path: str | Path) -> LoraFile:
    """Open and validate a LoRA file: header, key names and alpha scalars only (factor data stays on disk).

    Checks: a readable safetensors header; every key placed (format rules above); down/up pairs complete, 2-D, of
    one rank; an alpha a positive finite scalar of a pair; floating-point factors; a header ``alpha``, when
    used, a positive number.

    Raises:
        LoraError: the first problem, one line naming the file and the key or field.
    """
    path = Path(path)
    if not path.is_file():
        raise LoraError(f"{path}: LoRA file not found")
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            keys = list(handle.keys())
            slices = {key: handle.get_slice(key) for key in keys}
            shapes = {key: tuple(s.get_shape()) for key, s in slices.items()}
            dtypes = {key: str(s.get_dtype()) for key, s in slices.items()}
            alpha_keys = [k for k in keys if k.endswith((".alpha", ".lora_alpha"))]
            alpha_values = {k: handle.get_tensor(k) for k in alpha_keys}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise LoraError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())})") from exc
    if not keys:
        raise LoraError(f"{path}: holds no tensors")
    try:
        check_dtypes(path, {k: _Dtype(d) for k, d in dtypes.items()}, frozenset(alpha_keys))
    except AdapterError as exc:
        raise LoraError(str(exc)) from None
    fmt = _detect(keys, metadata)

    found: dict[str, dict[str, str]] = {}  # module (prefix-free, own namespace) -> role -> file key
    for key in keys:
        name = key
        if name.startswith("transformer_ref."):
            raise LoraError(f"{path}: tensor {key!r} targets transformer_ref (ref2va's DiT partition), which this "
                            f"engine does not hold")
        for prefix in ("transformer.", "base_model.model.", "diffusion_model."):
            name = name.removeprefix(prefix)
        if fmt == "musubi":
            name = _unflatten(name, path)
        module, role = _split(name, path)
        roles = found.setdefault(module, {})
        if role in roles:
            raise LoraError(f"{path}: tensors {roles[role]!r} and {key!r} are the same {module}.{role}")
        roles[role] = key

    header_alpha = None
    if "alpha" in metadata and not alpha_keys:
        try:
            header_alpha = float(metadata["alpha"])
        except ValueError:
            raise LoraError(f"{path}: metadata alpha={metadata['alpha']!r} is not a number") from None
        if not (math.isfinite(header_alpha) and header_alpha > 0):
            raise LoraError(f"{path}: metadata alpha={metadata['alpha']!r} must be a positive number")

    pairs, scales = [], []
    for module, roles in sorted(found.items()):
        any_key = next(iter(roles.values()))
        if "down" not in roles or "up" not in roles:
            missing = "down (lora_A/lora_down)" if "down" not in roles else "up (lora_B/lora_up)"
            raise LoraError(f"{path}: tensor {any_key!r} has no {missing} partner (unpaired LoRA factor)")
        native, rows, slot, _ = _place(module, roles["down"], path, fmt)
        down, up = shapes[roles["down"]], shapes[roles["up"]]
        if len(down) != 2 or len(up) != 2 or down[0] != up[1]:
            raise LoraError(f"{path}: {roles['down']!r} {down} and {roles['up']!r} {up} are not a rank-r pair "
                            f"(down [r, in], up [out, r])")
        rank = down[0]
        scale = 1.0
        if "alpha" in roles:
            value = alpha_values[roles["alpha"]]
            alpha = float(value.reshape(-1)[0]) if value.numel() == 1 else math.nan
            if not (math.isfinite(alpha) and alpha > 0):
                raise LoraError(f"{path}: tensor {roles['alpha']!r} (alpha) must be one positive finite number")
            scale = alpha / rank
        elif header_alpha is not None:
            scale = header_alpha / rank
        pairs.append(LoraPair(roles["down"], roles["up"], roles.get("alpha"), native, rows, slot, rank, down, up))
        scales.append(scale)
    _check_unique_targets(path, pairs)
    return LoraFile(path, fmt, metadata, tuple(pairs), tuple(scales))


def _check_unique_targets(path: Path, pairs: list[LoraPair]) -> None:
    """Two pairs on one weight are an error unless they are q, k and v of it (a file naming both a fused qkv_proj
    and its to_q would count the change twice)."""
    seen: dict[tuple[str, int | None], str] = {}
    for pair in pairs:
        slots = (0, 1, 2) if pair.rows == QKV_CONCAT or (pair.native.endswith("qkv_proj") and pair.slot is None) \
            else (pair.slot,)
        for slot in slots:
            other = seen.setdefault((pair.native, slot), pair.key_up)
            if other != pair.key_up:
                raise LoraError(f"{path}: tensors {other!r} and {pair.key_up!r} both change {pair.native}")


@dataclass(frozen=True)
class _Dtype:
    dtype: str


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA of a job: its file and strength (any finite number; 0 leaves the model untouched)."""

    path: str
    strength: float = 1.0


@dataclass
class LoraCache:
    """read_lora once per path (the queue's LoRA sets share files)."""

    files: dict[str, LoraFile] = field(default_factory=dict)

    def get(self, path: str | Path) -> LoraFile:
        key = str(Path(path).resolve())
        if key not in self.files:
            self.files[key] = read_lora(path)
        return self.files[key]

