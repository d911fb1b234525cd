"""CUDA graphs for fixed-shape inference calls: capture once per input shape, replay per job.

A call such as the audio VAE decode runs hundreds of small kernels for a 10 s clip (BigVGAN's anti-aliased
activations). `ShapeGraphs` records the whole call once per input shape (dtype, device) into a `torch.cuda.CUDAGraph`
and afterwards replays it with one launch (1x H200, 2 x 405 latents: 0.0362 s eager -> 0.0233 s replayed with the
Triton activations; with the torch activations only 0.0778 -> 0.0747 s, there the kernels themselves dominated;
docs/performance.md §6.6):

    decode = ShapeGraphs(audio_vae.decode, name="audio_vae.decode")
    decode.capture(torch.zeros(2, 32, 405, device="cuda"))  # warm-up, outside job timings
    wave = decode(latent)  # [2, 32, 405] -> copy into the static input, replay, clone the static output

Replay runs exactly the kernels that eager mode ran at capture, on the same weights, so the output equals the eager
call's bit for bit (cuDNN's algorithm choice is made during the warm-up and kept). What a graph does not see:
anything decided in Python at capture time (shapes, control flow) and tensors replaced after capture. Parameters
changed in place after capture are read by the replay, but tensors the wrapped function derived from them and kept
(e.g. a cached weight-norm weight) are not: call `reset()` after loading new weights.

Off CUDA (or when disabled) the wrapper calls the function eagerly; so does it after a capture failed (`failure` says
why, and a warning is issued): a graph is a speed-up, never a reason for a render to fail. A `backend` object can stand in for CUDA graphs
(tests use one on CPU that recomputes into the same static output buffer, as a replay does).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

# Eager runs on a side stream before capture (the PyTorch CUDA-graph recipe): cuDNN/cuBLAS handles, workspaces,
# algorithm choices and lazily built caches are settled there, so the capture records only the steady-state kernels.
WARMUP_CALLS = 2


class CudaGraphBackend:
    """Capture `fn(static_in)` into a `torch.cuda.CUDAGraph`.

    Every graph of one backend shares one memory pool. That is safe here because the wrapper replays one graph at
    a time on the caller's stream and clones the static output before the next replay: a later graph may reuse an
    earlier graph's intermediates (and clobber its static output), never while that output is still unread.
    """

    def __init__(self) -> None:
        self._pool = None

    def capture(self, fn: Callable[[torch.Tensor], torch.Tensor], static_in: torch.Tensor
                ) -> tuple[Callable[[], None], torch.Tensor]:
        device = static_in.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn(static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe CUDA calls break the capture; other threads may legitimately sync
        # meanwhile (an MP4 writer waiting on its staging event, NCCL's watchdog querying events).
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_out = fn(static_in)
        return graph.replay, static_out


@dataclass
class _Captured:
    static_in: torch.Tensor
    static_out: torch.Tensor
    replay: Callable[[], None]
    seconds: float


class ShapeGraphs:
    """`fn(x) -> Tensor` replayed from a graph captured per `(shape, dtype, device)` of `x`.

    Args:
        fn: a function of one tensor returning one tensor; it must run without host synchronization (no `.item()`,
            no data-dependent shapes) and must not keep references to its input. Called under `torch.no_grad()`.
        name: for messages.
        enabled: False always calls `fn` eagerly.
        backend: what captures a graph; None means CUDA graphs for CUDA inputs and eager for the rest. Any other
            backend is used for every input (tests pass a CPU stand-in).

    A shape seen for the first time in `__call__` is captured then (the call takes the capture's time); `capture`
    does it ahead, and `captures` lists what was captured with its seconds.
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], *, name: str = "graph", enabled: bool = True,
                 backend=None) -> None:
        self.fn, self.name, self.enabled = fn, name, enabled
        self._backend = backend
        self._cuda_backend: CudaGraphBackend | None = None
        self._graphs: dict[tuple, _Captured] = {}
        self.failure: str | None = None  # why a capture failed (the wrapper is eager from then on)

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return tuple(x.shape), x.dtype, x.device

    def _backend_for(self, device: torch.device):
        if not self.enabled:
            return None
        if self._backend is not None:
            return self._backend
        if device.type == "cuda":
            if self._cuda_backend is None:
                self._cuda_backend = CudaGraphBackend()
            return self._cuda_backend
        return None

    def graphs_on(self, device: torch.device | str) -> bool:
        """Whether calls with inputs on `device` replay graphs (rather than run eagerly)."""
        return self._backend_for(torch.device(device)) is not None

    def captured(self, x: torch.Tensor) -> bool:
        """Whether a graph for `x`'s shape, dtype and device exists already."""
        return self._key(x) in self._graphs

    def needs_capture(self, x: torch.Tensor) -> bool:
        """Whether calling with `x` would capture a graph first."""
        return self.graphs_on(x.device) and not self.captured(x)

    @property
    def captures(self) -> list[dict]:
        """One entry per captured graph: input shape, dtype, device and capture seconds (warm-up calls included)."""
        return [{"shape": list(k[0]), "dtype": str(k[1]).removeprefix("torch."), "device": str(k[2]),
                 "seconds": c.seconds} for k, c in self._graphs.items()]

    @torch.no_grad()
    def capture(self, x: torch.Tensor) -> float:
        """Capture the graph for `x`'s shape (x's values are only warm-up input). Returns the seconds it took, or
        0.0 when nothing was captured (already captured, or this input runs eagerly)."""
        backend = self._backend_for(x.device)
        key = self._key(x)
        if backend is None or key in self._graphs:
            return 0.0
        t0 = time.perf_counter()
        static_in = torch.empty_like(x, memory_format=torch.contiguous_format)
        static_in.copy_(x)
        try:
            replay, static_out = backend.capture(self.fn, static_in)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
        except Exception as exc:  # e.g. an op that syncs with the host inside the function
            self.enabled = False
            self.failure = f"{tuple(x.shape)}: {type(exc).__name__}: {exc}"[:500]
            warnings.warn(f"{self.name}: CUDA graph capture failed, running eagerly from now on: {self.failure}",
                          RuntimeWarning, stacklevel=2)
            return 0.0
        seconds = time.perf_counter() - t0
        self._graphs[key] = _Captured(static_in, static_out, replay, seconds)
        return seconds

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._backend_for(x.device) is None:
            return self.fn(x)
        key = self._key(x)
        if key not in self._graphs:
            self.capture(x)
            if key not in self._graphs:  # the capture failed (warned, `failure` says why): this call runs eagerly too
                return self.fn(x)
        entry = self._graphs[key]
        entry.static_in.copy_(x)
        entry.replay()
        # The static output is overwritten by the next replay (of this graph or, through the shared pool, another):
        # hand out a copy.
        return entry.static_out.clone()

    def reset(self) -> None:
        """Drop every captured graph (e.g. after new weights were loaded); the next calls capture again."""
        self._graphs.clear()
        self._cuda_backend = None
