"""Full non-causal self-attention over one packed sequence, with a backend chosen once per process.

Backends, fastest first on an H200 at the released size (S = 73,642, 56 heads x 128; DESIGN.md §3):
  "fa3"   FlashAttention-3 forward: `flash_attn_interface.flash_attn_func` (the upstream hopper build) or
          `fa3_fwd_interface.flash_attn_func` (PyPI `fa3-fwd`); Hopper only. Measured 0.2245 s / layer (693 TFLOP/s).
  "cudnn" torch SDPA restricted to the cuDNN kernel. Measured 0.274 s / layer (568 TFLOP/s).
  "sdpa"  torch SDPA with torch's own kernel choice; the only backend on CPU. Measured 0.431 s / layer on GPU.

Each backend is one `AttentionBackend` record (name, available(), run) in `REGISTRY`, whose keys are exactly
`h3render.spec.ATTENTION_BACKENDS` (the torch-free name list the CLI offers); `available_backends`, `runner`,
`preferred_for` and `select_backend` all read the registry. The backend is picked once, by `select_backend(name)`
with a name from the config/CLI, or automatically on first use: the first backend in the registry's order (fastest
first on an H200) whose output on a small probe agrees with "sdpa". The choice is not timed: timing picked FA3 in one
process and cuDNN in another on the same GPU under load (the GPU suite, 2026-12-03: two renders of one seed differed
in the last bits), and a render must not depend on which process ran it. No mask, no padding: every backend here
takes any sequence length.

`SparseAttention` is the other kind: FastH3's video sparse attention (VSA-H3, `h3render.kernels.vsa`) over one packed
layout, called with the block's gate; `DiT.enable_vsa` builds the gates with `gate_projection`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from h3render.kernels.vsa import TILE, TilePlan, fine_backend, tile_plan, vsa_attention
from h3render.spec import ATTENTION_BACKENDS

# Modules that provide FlashAttention-3's `flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...)`
# over [B, S, H, D]: the upstream hopper build's name first, then the PyPI `fa3-fwd` 0.0.3 wheel's.
_FA3_MODULES = ("flash_attn_interface", "fa3_fwd_interface")

# Auto-selection probe: [1, 16384, 16, 128] bf16 (2.2 TFLOP, ~3 ms per call on an H200), a check of agreement, not
# a timing. A backend whose output differs from plain SDPA by more than _PROBE_REL_TOL is passed over (FA3 vs SDPA
# measured 3e-3 in bf16).
_PROBE_SHAPE = (1, 16384, 16, 128)
_PROBE_REL_TOL = 2e-2

# CPU attention runs in query-row chunks of about this much work (query rows x key rows x heads x head dim, times
# the batch): Python runs a signal handler only between bytecodes, and one SDPA call at the tiny model's largest canvas
# (24k video rows, 8 heads x 16) held SIGTERM for ~11 s on a 2-core host (issue #28 item 5). Any attention below it
# (every test render) is one call, as before. Chunks start at multiples of CPU_CHUNK_ALIGN rows and hold at least
# CPU_CHUNK_MIN_ROWS (the last one takes the remainder): torch's CPU flash kernel cuts queries into blocks of 256 rows
# once a call has 768 or more (32 or 64 below), so each chunk is cut into the very blocks the whole call is cut into,
# and the output is bit-identical to one call. A short last chunk was not: its blocks of 32 rows gave other fp32 bits
# than the whole call's one partial block (measured, torch 2.13 CPU; tests/unit/test_attention.py).
CPU_CHUNK_WORK = 1 << 31
CPU_CHUNK_ALIGN, CPU_CHUNK_MIN_ROWS = 256, 768

_selected: str | None = None
_fa3_func: Callable | None = None


def _load_fa3() -> Callable | None:
    """FlashAttention-3's `flash_attn_func`, or None when no provider imports or the GPU is not Hopper (sm90)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    for module_name in _FA3_MODULES:
        try:
            return importlib.import_module(module_name).flash_attn_func
        except (ImportError, OSError, AttributeError):
            # OSError: a wheel built for another torch/CUDA fails while loading its shared library.
            continue
    return None


def _cudnn_usable() -> bool:
    return torch.cuda.is_available() and torch.backends.cudnn.is_available()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(D)) v in fp32: the test reference (S x S memory; small inputs only).

    Args:
        q, k, v: [B, S, H, D].

    Returns:
        [B, S, H, D] in q's dtype.
    """
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, S, S]
    return (scores.softmax(-1) @ vf).transpose(1, 2).to(q.dtype)  # [B, S, H, D]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full non-causal attention, no mask, default scale 1/sqrt(head_dim) (the DiT's default attention). Host
    tensors go through `cpu_attention` (query chunks, so a signal is handled within a chunk; bit-identical).

    Args:
        q, k, v: `[B, S, H, D]`.
    Returns:
        `[B, S, H, D]`, dtype of `q`.
    """
    if q.device.type == "cpu":
        return cpu_attention(q, k, v)
    return _sdpa(q, k, v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # SDPA wants [B, H, S, D]; transposed views avoid a copy on the way in and out.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)



def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """cuDNN's attention first, PyTorch's other SDPA kernels where cuDNN cannot take the inputs. cuDNN alone
    failed ("No available kernel") on inputs it has no kernel for, which failed the job: the built-in tiny
    model's heads of dim 16 on the H200 whenever the probe at the released shape had picked cuDNN (its two fastest
    backends are within noise of each other there: 4 of the 5 runs seen on 2026-12-02), and host tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        return sdpa_attention(q, k, v)


def _fa3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    global _fa3_func
    if _fa3_func is None:  # first call through the registry (select_backend loads it up front)
        _fa3_func = _load_fa3()
    out = _fa3_func(q, k, v, causal=False)
    # Older upstream FA3 builds return (out, softmax_lse); fa3-fwd 0.0.3 returns out alone.
    return out[0] if isinstance(out, tuple) else out


Runner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """One dense attention backend.

    Attributes:
        name: the name the CLI, manifests and the sidecar's `run.attention` use (`h3render.spec.ATTENTION_BACKENDS`).
        available: whether it can run on this machine (checked each call: it looks at the GPU and the installed
            providers).
        run: `(q, k, v) -> out`, each `[B, S, H, D]`, non-causal, unmasked, scale 1/sqrt(D).
    """

    name: str
    available: Callable[[], bool]
    run: Runner


# Preference order = ATTENTION_BACKENDS order, fastest first on an H200: at the released DiT size FA3 0.2249 s, SDPA
# 0.2781, cuDNN 0.2794 s per layer (torch 2.11, 2026-11-30); at the video VAE decoder's [8, 1797, 32, 64] FA3
# 0.536 ms, SDPA 0.624, cuDNN 0.654 (2026-12-02, docs/performance.md §23.2).
# The lambdas look `_load_fa3` / `_cudnn_usable` up at call time, so a test can stand in for a provider.
REGISTRY: dict[str, AttentionBackend] = {backend.name: backend for backend in (
    AttentionBackend("fa3", lambda: _load_fa3() is not None, _fa3),
    AttentionBackend("cudnn", lambda: _cudnn_usable(), _cudnn),
    AttentionBackend("sdpa", lambda: True, sdpa_attention),
)}
if tuple(REGISTRY) != ATTENTION_BACKENDS:  # the CLI's choices come from spec without importing torch
    raise ImportError(f"h3render/models/attention.py: REGISTRY names {tuple(REGISTRY)} != h3render.spec."
                      f"ATTENTION_BACKENDS {ATTENTION_BACKENDS}")


def available_backends() -> list[str]:
    """Names of the backends that can run here, in preference order (always ends with "sdpa")."""
    return [name for name, backend in REGISTRY.items() if backend.available()]


def _probe_rel_err(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of backend `name` against SDPA's `ref` on the probe, or inf if it fails (NaN counts as inf)."""
    try:
        out = REGISTRY[name].run(q, k, v)
    except RuntimeError:
        return math.inf
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return rel if rel == rel else math.inf


def preferred_for(shape: tuple[int, int, int, int], device: torch.device | str = "cuda"
                  ) -> tuple[str, dict[str, float]]:
    """The first available backend, in the registry's order, whose output on random bf16 q/k/v of `shape`
    `[B, S, H, D]` agrees with plain SDPA (rel. error <= _PROBE_REL_TOL), and the rel. error of each backend checked
    (inf: failed). "sdpa" without a GPU. Deterministic for a given GPU and install: no timing.

    The DiT's long sequences and the video VAE decoder's short ones (8 x 1,797 tokens, head dim 64) may not run on
    every kernel alike, so each call site checks at its own shape.
    """
    candidates = available_backends()
    if candidates == ["sdpa"]:
        return "sdpa", {}
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, generator=gen).to(torch.bfloat16) for _ in range(3))
    ref = sdpa_attention(q, k, v)
    errors: dict[str, float] = {}
    for name in candidates[:-1]:
        errors[name] = _probe_rel_err(name, q, k, v, ref)
        if errors[name] <= _PROBE_REL_TOL:
            return name, errors
    return "sdpa", errors


def runner(name: str) -> Runner:
    """The attention function of backend `name` (`[B, S, H, D]` in and out), bypassing the process-wide choice.

    Raises:
        ValueError: unknown or unavailable backend.
    """
    if name not in available_backends():
        raise ValueError(f"attention backend {name!r} is not available here; available: {available_backends()}")
    return REGISTRY[name].run


def _auto_select() -> str:
    return preferred_for(_PROBE_SHAPE)[0]


def select_backend(name: str | None = None) -> str:
    """Choose the attention backend for the rest of the process.

    Args:
        name: a `REGISTRY` name ("fa3", "cudnn", "sdpa"), or None / "auto" for the first available one in the
            registry's order that agrees with plain SDPA on a small probe (`preferred_for`; "sdpa" without a GPU).

    Returns:
        The chosen backend's name.

    Raises:
        ValueError: unknown name, or the named backend cannot run on this machine.
    """
    global _selected, _fa3_func
    if name not in (*REGISTRY, None, "auto"):
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(REGISTRY)} or auto")
    _fa3_func = _load_fa3()
    if name in (None, "auto"):
        name = _auto_select()
    elif name not in available_backends():
        raise ValueError(f"attention backend {name!r} is not available here; available: {available_backends()}")
    _selected = name
    return name


def current_backend() -> str:
    """The backend `attention` uses; selects automatically on first call if none was chosen."""
    return _selected if _selected is not None else select_backend(None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the whole sequence: non-causal, unmasked, scale 1/sqrt(D).

    Args:
        q: [B, S, H, D] (bf16 on GPU; D = 128 in the released model), unit stride over D.
        k: [B, S, H, D] like q.
        v: [B, S, H, D] like q.

    Returns:
        [B, S, H, D] in q's dtype (possibly a strided view; `.flatten(2)` / `.reshape` it for the out-projection).

    Raises:
        ValueError: q, k, v are not 4-D tensors of one shape, dtype and device.
    """
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"attention wants q, k, v as [B, S, H, D] of one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"attention wants q, k, v of one dtype and device, got {q.dtype}/{k.dtype}/{v.dtype}")
    if q.device.type != "cuda":
        # The process-wide choice is measured on the GPU; a CPU render on a GPU host (`--device cpu`, gloo ranks)
        # must not run cuDNN / FA3 on host tensors.
        return sdpa_attention(q, k, v)
    return REGISTRY[current_backend()].run(q, k, v)


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_work: int = CPU_CHUNK_WORK) -> torch.Tensor:
    """`sdpa_attention` in query-row chunks of about `chunk_work` (`CPU_CHUNK_WORK`; whole `CPU_CHUNK_ALIGN` row
    blocks, at least `CPU_CHUNK_MIN_ROWS`), so a signal is handled between chunks instead of after the whole call
    (seconds at a large canvas on CPU). Each query row's output depends only on that row and all keys, so the chunks
    concatenate to the whole call's output, bit for bit.

    Args:
        q, k, v: `[B, S, H, D]` host tensors.
    Returns:
        `[B, S, H, D]` in q's dtype.
    """
    batch, rows, heads, dim = q.shape
    per_chunk = chunk_work // max(1, batch * rows * heads * dim) // CPU_CHUNK_ALIGN * CPU_CHUNK_ALIGN
    per_chunk = max(per_chunk, CPU_CHUNK_MIN_ROWS)
    if per_chunk + CPU_CHUNK_MIN_ROWS > rows:
        return _sdpa(q, k, v)
    out = torch.empty_like(q)
    start = 0
    while start < rows:
        end = start + per_chunk if rows - (start + per_chunk) >= CPU_CHUNK_MIN_ROWS else rows
        out[:, start:end] = _sdpa(q[:, start:end], k, v)
        start = end
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Video sparse attention (FastH3 students).


def check_vsa_settings(sparsity: float, tile: int) -> float:
    """The VSA sparsity as a float after checking it and the tile size.

    Raises:
        ValueError: sparsity outside [0, 1), or a tile other than `kernels.vsa.TILE` (64: the only tile the students
            were trained with and the only one FastVideo runs outside Blackwell).
    """
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"VSA sparsity must be in [0, 1), got {sparsity}")
    if int(tile) != TILE:
        raise ValueError(f"VSA tile size must be {TILE}, got {tile}")
    return float(sparsity)


def gate_projection(like: torch.Tensor, width: int) -> nn.Linear:
    """Zero-filled gate projection `hidden -> width` without bias (FastVideo `to_gate_compress`, 5376 -> 7168
    released), on the device and dtype of the weight `like` `[*, hidden]` (meta included)."""
    proj = nn.Linear(like.shape[1], width, bias=False, device=like.device, dtype=like.dtype)
    nn.init.zeros_(proj.weight)
    return proj


def vsa_qk_int8_pays(precision: str, device: torch.device) -> bool:
    """Whether an engine of `precision` on `device` runs VSA's QKᵀ on int8 codes (`SparseAttention.qk_int8`): fp8 on
    a CUDA GPU of compute capability >= 9.0 (the TMA fine kernel, the one that gains: docs/performance.md §22.1)."""
    if precision != "fp8" or device.type != "cuda":
        return False
    from h3render.kernels.vsa.triton_hopper import tma_supported

    return tma_supported(torch.empty(0, device=device))


@dataclass(frozen=True, eq=False)
class SparseAttention:
    """VSA-H3 attention of one packed layout: `(q, k, v, gate) -> out`, each `[S, h, D]` (any head subset).

    Attributes:
        plan: the layout's tile plan (prefix segments text, audio; the patched video grid).
        sparsity: fraction of video key tiles dropped per query tile.
        fine: fine-stage backend for `kernels.vsa.vsa_attention` (None: Triton on CUDA, torch elsewhere).
        qk_int8: the fine stage's QKᵀ from int8 codes (`kernels.vsa.quant`).
    """

    plan: TilePlan
    sparsity: float
    fine: str | None = None
    qk_int8: bool = False

    @classmethod
    def for_layout(cls, layout, sparsity: float, device: torch.device | str, fine: str | None = None,
                   qk_int8: bool = False):
        """From a `h3render.packing.PackedLayout` (rows `[text | audio | video]`, no pad rows). The plan is cached
        by shape (`kernels.vsa.tile_plan`), so building this every forward costs nothing after the first.

        Raises:
            ValueError: when the layout's row counts do not add up to `[text | audio | video]`.
        """
        pt, ph, pw = layout.patch
        grid = (layout.latent_frames // pt, layout.latent_height // ph, layout.latent_width // pw)
        prefix = (layout.text_len, layout.num_audio_rows)
        if sum(prefix) + math.prod(grid) != layout.seq_len or layout.num_video_rows != math.prod(grid):
            raise ValueError(f"h3render/models/attention.py: VSA needs a [text | audio | video] layout; got "
                             f"{layout.seq_len} rows for prefix {prefix} and video grid {grid}")
        return cls(tile_plan(prefix, grid, str(torch.device(device))), float(sparsity), fine, qk_int8)

    def triton_fine(self, x: torch.Tensor) -> bool:
        """Whether the fine stage on tensors like `x` is the Triton kernel, the one that reads v in tile order
        as is: then a caller gains by writing v so (`__call__(..., v_tiles=True)`); elsewhere it costs a copy back.
        """
        return fine_backend(x, self.fine) == "triton"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, *,
                 v_tiles: bool = False, pooled: tuple | None = None) -> torch.Tensor:
        """q, k, gate `[S, h, D]` packed rows; v the same, or with `v_tiles` `[plan.padded_len, h, D]` in tile order
        (`kernels.vsa.empty_tiles` written through `plan.slot`) -> `[S, h, D]` in q's dtype. `pooled`: the fp32 tile
        means (q̄, k̄, v̄) `[h, n, D]` when the caller has them (`kernels.vsa.vsa_prep`): no pooling pass then."""
        return vsa_attention(q, k, v, gate, self.plan, self.sparsity, fine=self.fine, qk_int8=self.qk_int8,
                             v_tiles=v_tiles, pooled=pooled)
