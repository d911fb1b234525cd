"""FastH3 full-checkpoint contracts (`fastvideo_inference.json`) and the few-step positions they state.

A FastVideo full FastH3 checkpoint (v1 `FastVideo/FastVideo-FastH3-4-step-Preview-v1-{VSA-DataFree,
VSA-Synthetic-Step1300, VSA-Synthetic-Step1900, Dense-DataFree}` and V2 `FastVideo/FastVideo-FastH3-8-Step-V2`)
carries a `fastvideo_inference.json` with `schema_version = "fasth3-inference-contract-v1"`. Fields used here:

| field | V2 (vLLM-Omni `fasth3_checkpoint.py` requires exactly) | v1 (third-party validators; unverified) |
|---|---|---|
| `dmd_denoising_steps` | [999, 874, 749, 624, 500, 375, 250, 125] | [999, 749, 500, 250] |
| `transformer_forwards` | 8 | 4 |
| `video_scheduler_shift` / `audio_scheduler_shift` | 10 / 3 | not stated: the checkpoint's (12 / 3) |
| `attention_backend` | `"VIDEO_SPARSE_ATTN_H3"` | same (the Dense-DataFree student: a dense backend) |
| `vsa_sparsity`, `vsa_tile_size` | 0.8, 64 | 0.9, 64 |
| `guidance_scale`, `task` | 1.0, `"t2av"` | same when stated |

V2 is held to every value above (as vLLM-Omni does; `attention_backend` and the VSA fields only when stated); any
other model id with the schema is checked field by field (types, ranges, steps vs forwards). Sources: vsa.md §2,
FastVideo `docs/inference/fasth3-distilled.md`, vLLM-Omni `fasth3_checkpoint.py`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from h3render.spec import RELEASED_AUDIO_SHIFT, RELEASED_VIDEO_SHIFT

if TYPE_CHECKING:  # torch: the schedule is built only when a student is planned (`fasth3_schedule`)
    from h3render.sampling import Schedule

CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
V2_MODEL_ID = "FastVideo/FastVideo-FastH3-8-Step-V2"
V2_SCHEMA = CONTRACT_SCHEMA
# FastVideo's attention backend enum name of the H3 video sparse attention (fastvideo 0.2.1 `platforms`).
VSA_BACKEND = "VIDEO_SPARSE_ATTN_H3"
# Backends that are plain dense attention (FastVideo 0.2.1 AttentionBackendEnum members a student may name).
DENSE_BACKENDS = ("TORCH_SDPA", "FLASH_ATTN", "FLASH_ATTN_4", "FA4", "SAGE_ATTN", "CUDNN_ATTN")
# V2's exact values (vLLM-Omni FastH3CheckpointSpec.from_metadata).
V2_REQUIRED: dict[str, Any] = {
    "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250, 125], "transformer_forwards": 8,
    "video_scheduler_shift": 10.0, "audio_scheduler_shift": 3.0, "guidance_scale": 1.0, "task": "t2av",
}
V2_VSA: dict[str, Any] = {"attention_backend": VSA_BACKEND, "vsa_sparsity": 0.8, "vsa_tile_size": 64}

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


def parse_steps(raw: Any, where: str) -> tuple[float, ...]:
    """`positions_from_steps` of a list, or of a header string ("[999, 749, 500, 250]" or "999,749,500,250")."""
    if isinstance(raw, str):
        text = raw.strip()
        try:
            raw = json.loads(text) if text.startswith("[") else [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise ValueError(f"{where}={text!r}: not a list of integers") from None
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}={raw!r}: not a list of integers")
    return positions_from_steps(raw, where)


def _positive(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{where}={value!r} is not a positive number")
    return float(value)


@dataclass(frozen=True)
class FastH3Contract:
    """One full FastH3 checkpoint's `fastvideo_inference.json`, validated.

    Attributes:
        model_id: e.g. "FastVideo/FastVideo-FastH3-8-Step-V2".
        positions: pre-shift positions, terminal 0 included (N points drive N - 1 forwards).
        video_shift, audio_shift: stated shifts, or None (then the checkpoint's own apply).
        attention_backend: as stated ("" when absent).
        vsa_sparsity, vsa_tile_size: as stated, or None.
        where: the file, for messages and the sidecar.
    """

    model_id: str
    positions: tuple[float, ...]
    video_shift: float | None
    audio_shift: float | None
    attention_backend: str
    vsa_sparsity: float | None
    vsa_tile_size: int | None
    where: str = CONTRACT_FILE

    @property
    def is_v2(self) -> bool:
        return self.model_id == V2_MODEL_ID

    @property
    def source(self) -> str:
        """The schedule source the sidecar records."""
        return "FastH3 V2 contract" if self.is_v2 else "FastH3 contract"

    @property
    def requires_vsa(self) -> bool:
        """Whether the student was trained with (and must run) VSA.

        Raises:
            ValueError: a backend that is neither VSA-H3 nor a known dense one (e.g. Wan's VIDEO_SPARSE_ATTN).
        """
        if self.attention_backend in ("", *DENSE_BACKENDS):
            return False
        if self.attention_backend == VSA_BACKEND:
            return True
        raise ValueError(f"{self.where}: attention_backend={self.attention_backend!r}: h3render runs "
                         f"{VSA_BACKEND!r} or dense attention ({', '.join(DENSE_BACKENDS)})")

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], where: str = CONTRACT_FILE) -> "FastH3Contract":
        """Validate a contract.

        Raises:
            ValueError: a field disagrees with the V2 release (V2) or is malformed (names the file and field).
        """
        if metadata.get("schema_version") != CONTRACT_SCHEMA:
            raise ValueError(f"{where}: schema_version={metadata.get('schema_version')!r}, expected "
                             f"{CONTRACT_SCHEMA!r}")
        model_id = metadata.get("model_id")
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"{where}: model_id={model_id!r} is not a model id")
        if model_id == V2_MODEL_ID:
            label = "FastH3 V2 contract"
            for key, expected in V2_REQUIRED.items():
                if metadata.get(key) != expected:
                    raise ValueError(f"{label}: {key}={metadata.get(key)!r}, expected {expected!r}")
            for key, expected in V2_VSA.items():
                if key in metadata and metadata[key] != expected:
                    raise ValueError(f"{label}: {key}={metadata[key]!r}, expected {expected!r}")
        else:
            label = where
            for key, expected in (("guidance_scale", 1.0), ("task", "t2av")):
                if key in metadata and metadata[key] != expected:
                    raise ValueError(f"{label}: {key}={metadata[key]!r}, expected {expected!r} (FastH3 is "
                                     f"t2va without guidance)")
        positions = parse_steps(metadata.get("dmd_denoising_steps"), f"{label} dmd_denoising_steps")
        forwards = metadata.get("transformer_forwards", len(positions) - 1)
        if forwards != len(positions) - 1:
            raise ValueError(f"{label}: {len(positions) - 1} dmd_denoising_steps for transformer_forwards={forwards}")
        shifts = [None if metadata.get(key) is None else _positive(metadata[key], f"{label} {key}")
                  for key in ("video_scheduler_shift", "audio_scheduler_shift")]
        sparsity = metadata.get("vsa_sparsity")
        if sparsity is not None and (not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool)
                                     or not 0.0 <= sparsity < 1.0):
            raise ValueError(f"{label}: vsa_sparsity={sparsity!r} is not in [0, 1)")
        tile = metadata.get("vsa_tile_size")
        if tile is not None and (not isinstance(tile, int) or isinstance(tile, bool)):
            raise ValueError(f"{label}: vsa_tile_size={tile!r} is not an integer")
        backend = metadata.get("attention_backend", "")
        if not isinstance(backend, str):
            raise ValueError(f"{label}: attention_backend={backend!r} is not a string")
        contract = cls(model_id, positions, shifts[0], shifts[1], backend,
                       None if sparsity is None else float(sparsity), tile, where)
        contract.requires_vsa  # noqa: B018 -- raises on an unknown backend
        return contract


def is_fasth3_contract(metadata: Mapping[str, Any] | None) -> bool:
    """Whether ``metadata`` claims to be a FastH3 full-checkpoint contract (by its schema_version)."""
    return bool(metadata) and isinstance(metadata, Mapping) and metadata.get("schema_version") == CONTRACT_SCHEMA


def is_fasth3_v2(metadata: Mapping[str, Any] | None) -> bool:
    """Whether ``metadata`` is V2's inference contract (by its schema_version and model_id)."""
    return is_fasth3_contract(metadata) and metadata.get("model_id") == V2_MODEL_ID


def contract_path(checkpoint: str | Path) -> Path | None:
    """The `fastvideo_inference.json` of a checkpoint folder (at its root, or beside a partition given as the
    checkpoint), or None."""
    path = Path(checkpoint)
    for folder in (path, path.parent):
        if folder.is_dir() and (folder / CONTRACT_FILE).is_file():
            return folder / CONTRACT_FILE
    return None


def read_contract(checkpoint: str | Path) -> FastH3Contract | None:
    """The validated contract of a full FastH3 checkpoint, or None when it has no FastH3 `fastvideo_inference.json`.

    Raises:
        ValueError: the file is unreadable, or claims the schema and a field is wrong (names the file and field).
    """
    path = contract_path(checkpoint)
    if path is None:
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable FastH3 contract: {exc}") from None
    if not is_fasth3_contract(meta):
        return None
    return FastH3Contract.from_metadata(meta, str(path))


def read_v2_contract(checkpoint: str | Path) -> dict[str, Any] | None:
    """The raw `fastvideo_inference.json` of any full FastH3 checkpoint (v1 or V2; the name predates v1 support),
    validated, or None.

    Raises:
        ValueError: as `read_contract`.
    """
    contract = read_contract(checkpoint)
    return None if contract is None else json.loads(Path(contract.where).read_text())


# ---------------------------------------------------------------------------------------------- schedules


def fasth3_schedule(metadata: Any = None,
                    video_shift: float = RELEASED_VIDEO_SHIFT, audio_shift: float = RELEASED_AUDIO_SHIFT,
                    *, positions: str | None = None) -> Schedule:
    """Build the FastH3 schedule: pre-shift positions, then the per-modality shift on top.

    ``metadata``: an ``adapter.Adapter`` (its header), a ``FastH3Contract`` or its raw json, a mapping, or None.

    Positions, first that applies:
      1. ``positions`` names a set in ``POSITION_SETS`` (e.g. ``"fastvideo-example"`` = linspace(1, 0, 5)); with a
         contract, its forward count must match the contract's;
      2. ``metadata`` is a full checkpoint's contract (``FastH3Contract`` or its raw json): its positions, and its
         shifts where stated (V2: video 10, audio 3) in place of the arguments -> source "FastH3 V2 contract" /
         "FastH3 contract";
      3. ``metadata`` (adapter header, or an ``adapter_manifest.json`` with ``sampling.base_timesteps``) states
         ``dmd_denoising_steps`` -> source ``"adapter metadata"``;
      4. otherwise the release default [999, 749, 500, 250] -> (0.999, 0.749, 0.5, 0.25, 0), ``"release default"``.

    Args:
        video_shift / audio_shift: the checkpoint's shifts (released 12 / 3).

    Raises:
        ValueError: unknown named set (or one of another length than the contract's), malformed steps, or an
            invalid contract.
    """
    if isinstance(metadata, Mapping) and is_fasth3_contract(metadata):
        metadata = FastH3Contract.from_metadata(metadata)
    contract = metadata if isinstance(metadata, FastH3Contract) else None
    if contract is not None:
        video_shift = contract.video_shift or video_shift
        audio_shift = contract.audio_shift or audio_shift
    header = getattr(metadata, "metadata", None)  # an adapter.Adapter (not imported: it imports this module)
    meta: Mapping[str, Any] = (header if isinstance(header, Mapping) else
                               {} if contract is not None else metadata) or {}
    if positions is not None:
        if positions not in POSITION_SETS:
            raise ValueError(f"unknown FastH3 position set {positions!r}; known: {sorted(POSITION_SETS)}")
        chosen, source = POSITION_SETS[positions], f"named set {positions!r}"
        if positions == "fastvideo-example" and contract is not None and len(chosen) != len(contract.positions):
            # FastVideo 0.2.1's example runs `--steps N` sigma-grid points linspace(1, 0, N) (N - 1 forwards): for
            # V2's 8 forwards that is linspace(1, 0, 9), the V2 example schedule (issue #25 item 5).
            n = len(contract.positions)
            chosen = tuple(1.0 - i / (n - 1) for i in range(n - 1)) + (0.0,)
            source = f"named set {positions!r} (linspace(1, 0, {n}): {n - 1} forwards)"
        if contract is not None and len(chosen) != len(contract.positions):
            raise ValueError(f"FastH3 position set {positions!r} drives {len(chosen) - 1} forwards but "
                             f"{contract.where} states {len(contract.positions) - 1} ({contract.model_id})")
    elif contract is not None:
        chosen, source = contract.positions, contract.source
    elif "dmd_denoising_steps" in meta:
        chosen, source = parse_steps(meta["dmd_denoising_steps"], "dmd_denoising_steps"), "adapter metadata"
    elif isinstance(meta.get("sampling"), Mapping) and "base_timesteps" in meta["sampling"]:
        chosen = parse_steps(meta["sampling"]["base_timesteps"], "sampling.base_timesteps")
        source = "adapter metadata"
    else:
        chosen, source = positions_from_steps(RELEASE_DMD_STEPS), "release default"
    from h3render.sampling import Schedule

    return Schedule.few_step(chosen, video_shift, audio_shift, source)
