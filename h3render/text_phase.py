"""The text phase of the phased and streamed memory plans (`h3render.memplan`): every prompt (fl2va presentation) of
the queue or shard encoded first, the states held in host memory, then the text encoder freed before the DiT loads.

`TextStore` holds what was encoded, by the task's `text_key(job)` (identical prompts are encoded once): up to
`HOST_BOUND_BYTES` in host memory, beyond that each new entry is written to a spill folder (a temporary folder,
removed when the store is closed or collected) and read back when its job runs. A prompt that failed to encode is
kept as its one-line error: its job fails alone with it (`TextStore.get` raises RenderError), the queue goes on.
Resume stays per job: the caller encodes only the jobs it will render.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Hashable, Sequence

import torch

from h3render.errors import RenderError
from h3render.tasks import task_of
from h3render.tasks.base import Encoded

# Host memory held by encoded prompts before entries spill to disk. Released conditioner: 5120 bf16 values per row,
# 10 KB a row, 2.6 MB for a 256-token prompt, so 8 GB holds about 3,000 such prompts (docs/performance.md §13).
HOST_BOUND_BYTES = 8 * 10**9


class TextStore:
    """Encoded prompts by key, in host memory up to `bound` bytes, spilled to `spill_dir` (made on first need)
    past it; failures by key as their one-line error."""

    def __init__(self, bound: int = HOST_BOUND_BYTES, spill_dir: str | Path | None = None):
        self.bound = bound
        self._spill_parent = spill_dir
        self._spill: Path | None = None
        self._memory: dict[Hashable, Encoded] = {}
        self._disk: dict[Hashable, Path] = {}
        self.failures: dict[Hashable, str] = {}
        self.host_bytes = 0
        self.disk_bytes = 0
        self.seconds = 0.0
        self._finalizer = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._memory or key in self._disk or key in self.failures

    def __len__(self) -> int:
        return len(self._memory) + len(self._disk)

    def put(self, key: Hashable, encoded: Encoded) -> None:
        """Keep `encoded` (its states moved to host memory), spilling to disk when the bound would be passed."""
        states = encoded.states.detach().to("cpu")
        size = states.numel() * states.element_size()
        encoded = Encoded(states, encoded.extra)
        if self.host_bytes + size <= self.bound:
            self._memory[key] = encoded
            self.host_bytes += size
            return
        path = self._spill_folder() / f"{len(self._disk):06d}.pt"
        torch.save({"states": states, "extra": encoded.extra}, path)
        self._disk[key] = path
        self.disk_bytes += path.stat().st_size

    def fail(self, key: Hashable, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        self.failures[key] = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__

    def get(self, key: Hashable, device: torch.device) -> Encoded:
        """The encoding of `key` with its states on `device`.

        Raises:
            RenderError: its prompt failed to encode in the text phase (the error), or was never encoded.
        """
        if key in self.failures:
            raise RenderError(f"the prompt failed to encode in the text phase: {self.failures[key]}")
        if key in self._memory:
            found = self._memory[key]
        elif key in self._disk:
            data = torch.load(self._disk[key], weights_only=False)  # our own file, written by `put`
            found = Encoded(data["states"], data["extra"])
        else:
            raise RenderError("this prompt was not encoded in the text phase (the text encoder is freed in the "
                              "phased and streamed memory plans)")
        return Encoded(found.states.to(device, non_blocking=True), found.extra)

    def _spill_folder(self) -> Path:
        if self._spill is None:
            self._spill = Path(tempfile.mkdtemp(prefix="h3render-text-", dir=self._spill_parent))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._spill, True)
        return self._spill

    def close(self) -> None:
        """Remove the spill folder (host entries go with the store)."""
        if self._finalizer is not None:
            self._finalizer()

    def record(self) -> dict[str, Any]:
        """The engine's warm-up record of the phase: prompts, failures, bytes held, seconds."""
        return {"prompts": len(self), "failed": len(self.failures), "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes, "seconds": round(self.seconds, 3),
                "seconds_per_prompt": round(self.seconds / max(1, len(self) + len(self.failures)), 4)}


def encode_jobs(host, jobs: Sequence, store: TextStore) -> TextStore:
    """Encode each distinct `task.text_key(job)` of `jobs` with `task.encode_text(host, job)` into `store`, on
    `host` (an object with `c.text_encoder`, `c.info`, `device` and `ensure_vision(timer)`: the engine, or
    `TextHost` in the text phase). A failure is recorded against its key; the others go on."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for job in jobs:
            task = task_of(job)
            key = task.text_key(job)
            if key in store:
                continue
            try:
                store.put(key, task.encode_text(host, job))
            except Exception as exc:
                store.fail(key, exc)
    if host.device.type == "cuda":
        torch.cuda.synchronize(host.device)
    store.seconds += time.perf_counter() - t0
    return store


class TextHost:
    """What a task's `encode_text` needs during the text phase, before the engine exists: the components (the text
    encoder alone), the device, and the fl2va vision tower's lazy load (`ensure_vision`)."""

    def __init__(self, components, device: torch.device):
        self.c, self.device = components, device
        self.warmup: dict[str, Any] = {}

    def ensure_vision(self, timer=None) -> None:
        ensure_vision(self, timer)


def ensure_vision(host, timer=None) -> None:
    """Load the conditioner's vision tower and keyframe image processor (fl2va) into `host.c.text_encoder` if not
    yet loaded, timed as warm-up `vision_load` on `timer` and recorded in `host.warmup["vision_load_s"]`.

    Raises:
        CheckpointError: the checkpoint has no vision tower config or no processor config.
        RenderError: the tower's output width is not the text width.
    """
    te = host.c.text_encoder
    if te.has_vision and te.image_processor is not None:
        return
    from contextlib import nullcontext

    from h3render.checkpoint.load import load_vision

    t0 = time.perf_counter()
    with timer.warmup("vision_load") if timer is not None else nullcontext():
        tower, processor = load_vision(host.c.info, host.device, te.embed_tokens.weight.dtype)
    if tower.config.out_hidden_size != te.text_dim:
        raise RenderError(f"vision tower out_hidden_size {tower.config.out_hidden_size} is not the text width "
                          f"{te.text_dim}")
    te.visual, te.image_processor = tower, processor
    host.warmup["vision_load_s"] = time.perf_counter() - t0


def run_text_phase(run, device: torch.device, jobs: Sequence, *, streamed: bool,
                   bound: int = HOST_BOUND_BYTES) -> tuple[TextStore, dict[str, Any]]:
    """The text phase of a phased / streamed plan: load the text encoder alone (streamed: its decoder layers in host
    memory, `block_stream.stream_layers_`), encode every job's text into a `TextStore`, free the encoder.

    Args:
        run: the `settings.RunSettings` (checkpoint, dtype, precision).
        jobs: the jobs that will render (skipped ones left out by the caller: resume stays per job).
    Returns:
        The store and the phase's record for the engine's warm-up (load and encode seconds, host bytes, the
        encoder's `precision_report` line).
    """
    from h3render.block_stream import stream_layers_
    from h3render.checkpoint.load import load_components
    from h3render.models.fp8 import precision_report

    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the phase's own peak (`peak_gb`)
    components = load_components(run.checkpoint, "cpu" if streamed else device, run.torch_dtype,
                                 parts=("text_encoder",), precision=run.precision)
    record: dict[str, Any] = {}
    if streamed:
        streamer = stream_layers_(components.text_encoder, components.text_encoder.layers, device)
        record["streamed"] = streamer.record()
    record["load_s"] = round(time.perf_counter() - t0, 3)
    record["precision"] = precision_report(components).get("text_encoder")
    # Parameters only, as `render.run_facts`' dtypes (FP8 weights are buffers): the embeddings' dtype.
    record["dtype"] = str(components.text_encoder.embed_tokens.weight.dtype).removeprefix("torch.")
    host = TextHost(components, device)
    store = encode_jobs(host, jobs, TextStore(bound))
    record.update(store.record(), **host.warmup)
    del host, components
    import gc

    gc.collect()
    if device.type == "cuda":
        record["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 3)
        torch.cuda.empty_cache()
    return store, record
