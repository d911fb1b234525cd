"""On-disk cache of the DiT's AdaLN modulation tables (issue 26, item 4): a second run's prepare reads them back.

Building the tables of a released schedule runs every block's AdaLN projection (≈13 B parameters, brought from host
memory block by block) over the schedule's timesteps: 21–27 s of the first prepare on one H200 (docs/performance.md
§9.4), paid again by every SLURM array task. The tables themselves are small (`[K*3, 6, 5376]` bf16 per block: K × 9.7
MB for the 50 blocks, ≈ 0.5 GB for a 50-timestep schedule), so they are kept on disk and read back.

Where: `$H3RENDER_ADALN_CACHE` (a folder; "off" turns the cache off), else `$XDG_CACHE_HOME/h3render/adaln`, else
`~/.cache/h3render/adaln`. One file per key, `<sha256 of the key>.safetensors`.

Key (what the tables are a function of): the checkpoint's identity (its resolved path, its config hash and the name,
size and mtime of each DiT weight file; a built-in model's name), the `--transformer` file's the same way, the fused
adapter's sha256 (None before a deferred fusion), a content fingerprint of the weights the tables are computed from
(shape, dtype and 256 strided samples of every time-embedder and AdaLN-projection tensor: it tells a fused student
from its base and one random model from another whatever the file stats say), the timesteps (exact float32), the
tables' dtype and the device kind (the tables are built on the device; another GPU model could round differently).

Written atomically (a unique temp name in the same folder, then `os.replace`), so concurrent ranks or array tasks
never see half a file; verified on read: the key is stored in the file's metadata and compared, and a sha256 over
every tensor's bytes (over the tensors' own sha256s) is stored and recomputed. A file that fails either check (or
cannot be parsed) is reported on stderr and recomputed, never trusted. Nothing is ever evicted: delete the folder to reclaim the space.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

from h3render.models.dit import ModulationTables

__all__ = ["ENV", "FORMAT", "cache_root", "cached_tables", "checkpoint_identity", "table_key", "weights_fingerprint"]

ENV = "H3RENDER_ADALN_CACHE"
# Bump when the file layout, the stored digest or what the tables mean changes: old files then simply stop matching.
# 2: the stored sha256 is over each tensor's own sha256 (computed in parallel), not over the raw bytes in one stream.
FORMAT = 2
_SAMPLES = 256  # strided samples per tensor in the weight fingerprint
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def cache_root() -> Path | None:
    """The cache folder (not created here), or None when `$H3RENDER_ADALN_CACHE` is "off" / "0" / "none"."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "none", "false", "no"):
        return None
    if value:
        return Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "h3render" / "adaln"


def _file_stats(path: Path) -> list[list[Any]]:
    """[name, bytes, mtime_ns] of a weight file, or of each weight file directly in a folder (sorted)."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    else:
        return []
    out = []
    for f in files:
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def checkpoint_identity(info, transformer_file: str | Path | None = None) -> dict[str, Any]:
    """What names the DiT weights on disk, cheaply (no weight bytes are read).

    Args:
        info: the `checkpoint.info.CheckpointInfo` the engine loaded.
        transformer_file: the `--transformer` single-file DiT that replaced the checkpoint's, or None.
    """
    ident: dict[str, Any] = {"path": info.recorded_path, "layout": info.layout, "config": info.config_hash}
    if info.layout != "builtin" and info.transformer is not None:
        ident["transformer"] = _file_stats(Path(info.transformer))
    if transformer_file is not None:
        path = Path(transformer_file).resolve()
        ident["transformer_file"] = [str(path), _file_stats(path)]
    return ident


def _sample(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLES)
    return flat[::step][:_SAMPLES].to(device="cpu", dtype=torch.float32).numpy().tobytes()


@torch.no_grad()
def weights_fingerprint(dit) -> str:
    """sha256 hex over name, shape, dtype and 256 strided values of every tensor the tables are computed from
    (`time_embedder.*`, `blocks.*.adaln_proj.*`, `final_layer.adaln_proj.*`): ≈ 200 small reads, a few ms at
    release, wherever the projections live (GPU or host memory)."""
    digest = hashlib.sha256()
    modules = [("time_embedder", dit.time_embedder), ("final_layer.adaln_proj", dit.final_layer.adaln_proj)]
    modules += [(f"blocks.{i}.adaln_proj", b.adaln_proj) for i, b in enumerate(dit.blocks)]
    for prefix, module in modules:
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            digest.update(f"{prefix}.{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            digest.update(_sample(tensor))
    return digest.hexdigest()


def table_key(identity: dict[str, Any], fingerprint: str, timesteps: torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> str:
    """The canonical JSON string the tables are cached under (its sha256 names the file)."""
    device = torch.device(device)
    where = device.type
    if device.type == "cuda":
        where = f"cuda:{torch.cuda.get_device_name(device)}"
    return json.dumps({"format": FORMAT, "identity": identity, "weights": fingerprint,
                       "timesteps": [float(t) for t in timesteps.reshape(-1).float().cpu().tolist()],
                       "dtype": str(dtype), "device": where}, sort_keys=True)


def _tensors(tables: ModulationTables) -> dict[str, torch.Tensor]:
    out = {"timesteps": tables.timesteps, "final": tables.final}
    out.update({f"block.{i:04d}": b for i, b in enumerate(tables.blocks)})
    return {name: t.detach().to("cpu").contiguous() for name, t in out.items()}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over name, shape, dtype and the sha256 of the raw bytes of every tensor, in name order.

    The per-tensor digests run on a thread pool: hashlib lets go of the GIL on large buffers, and one stream over a
    K = 97 table file (0.94 GB) took 0.8 s of a new process's 7.6 s prepare on the H200 host (docs/performance.md
    §22)."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(tensors)

    def raw(name: str) -> bytes:
        return hashlib.sha256(memoryview(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())).digest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        parts = list(pool.map(raw, names))
    digest = hashlib.sha256()
    for name, part in zip(names, parts):
        t = tensors[name]
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(part)
    return digest.hexdigest()


def _write(path: Path, key: str, tables: ModulationTables) -> None:
    from safetensors.torch import save_file

    tensors = _tensors(tables)
    metadata = {"h3render_adaln_key": key, "sha256": _digest(tensors), "format": str(FORMAT)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path, key: str, blocks: int) -> tuple[ModulationTables | None, str | None]:
    """(tables on the CPU, None) from a file that passes both checks, else (None, why it was not used)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("h3render_adaln_key") != key:
                return None, "its key differs from this run's (a digest collision or a foreign file)"
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001  a truncated or garbled file is a miss, whatever the parser raises
        return None, f"unreadable ({type(exc).__name__}: {exc})"[:200]
    if _digest(tensors) != meta.get("sha256"):
        return None, "its content does not match the sha256 stored in it"
    names = [f"block.{i:04d}" for i in range(blocks)]
    if not all(n in tensors for n in names + ["timesteps", "final"]):
        return None, "tensors are missing"
    return ModulationTables(tensors["timesteps"], tuple(tensors[n] for n in names), tensors["final"]), None


def cached_tables(dit, timesteps: torch.Tensor, device: torch.device | str, identity: dict[str, Any],
                  root: Path | None = None) -> tuple[ModulationTables, dict[str, Any]]:
    """`dit.modulation_tables(timesteps, device=device)`, read from the cache when a verified file holds them, else
    built and written there.

    Args:
        dit: the `models.dit.DiT` with its AdaLN projections (anywhere: GPU or host memory).
        timesteps: `[K]` float32.
        device: where the tables are built and returned.
        identity: `checkpoint_identity(...)` plus the fused adapter's sha256 (the caller's: see `Engine.tables`).
        root: the cache folder; default `cache_root()` (None there turns the cache off).

    Returns:
        (tables on `device`, a record for the warm-up log: {"cache": "hit" | "built" | "off" | "rejected", "file",
        "seconds" of the read or of the write, "why" a file was rejected or could not be written}).
    """
    root = cache_root() if root is None else root
    device = torch.device(device)
    if root is None or not dit.has_adaln_weights or any(
            p.is_meta for b in [*dit.blocks, dit.final_layer] for p in b.adaln_proj.parameters()):
        # Off, or no weights to fingerprint (dropped, or never loaded): `modulation_tables` says what is missing.
        return dit.modulation_tables(timesteps, device=device), {"cache": "off"}
    import time

    timesteps = torch.as_tensor(timesteps, dtype=torch.float32).reshape(-1)
    dtype = dit.final_layer.adaln_proj.linear.weight.dtype  # the tables' (the projections') dtype
    key = table_key(identity, weights_fingerprint(dit), timesteps, dtype, device)
    path = root / f"{hashlib.sha256(key.encode()).hexdigest()}.safetensors"
    record: dict[str, Any] = {"file": str(path)}
    if path.exists():
        t0 = time.perf_counter()
        tables, why = _read(path, key, len(dit.blocks))
        if tables is not None:
            record.update(cache="hit", seconds=round(time.perf_counter() - t0, 3))
            return tables.to(device), record
        print(f"h3render: warning: AdaLN table cache {path}: {why}; recomputing the tables", file=sys.stderr)
        record.update(cache="rejected", why=why)
    tables = dit.modulation_tables(timesteps, device=device)
    t0 = time.perf_counter()
    try:
        _write(path, key, tables)
    except Exception as exc:  # noqa: BLE001  a read-only or full cache folder costs the cache, never the run
        print(f"h3render: warning: AdaLN table cache {path} not written: {exc}", file=sys.stderr)
        record["why"] = f"not written: {exc}"[:200]
    record.setdefault("cache", "built")
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return tables, record
