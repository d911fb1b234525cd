"""The helpers every stage of scripts/bench.py shares: the result rows, timing, errors, GPU memory, and random
real-size components built directly on the GPU.

`RESULTS` holds every row `rec` printed (scripts/bench.py writes them to `--out` and tabulates them). The stages in
scripts/bench_fp8.py, bench_e2e.py and bench_fl2va.py receive this module as their `bench` argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

RESULTS: list[dict] = []


def rec(**row) -> None:
    RESULTS.append(row)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(row, default=str), flush=True)


def cuda_time(fn, reps: int = 3, warm: int = 1) -> float:
    """Median wall seconds of `fn()` with device synchronization."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): the edges of a wall-clock timing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_canvas(text: str) -> tuple[int, int, int]:
    """"WxHxFRAMES" (the --*-canvas flags) -> (width, height, frames)."""
    width, height, frames = (int(v) for v in text.lower().split("x"))
    return width, height, frames


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double(), ref.double()
    return float((ours - ref).norm() / ref.norm())


def gb(n_bytes: float) -> float:
    return round(n_bytes / 1e9, 2)


def peak_reset() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return gb(torch.cuda.max_memory_allocated())


# ---------------------------------------------------------------------------------------------------------------------
# random real-size components, built on the GPU


@torch.no_grad()
def random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """O(1)-scaled random weights in place (norm weights ~1, matrices ~1/sqrt(fan_in), small biases): keeps 50 random
    blocks finite, which default initialisations do not guarantee in bf16."""
    torch.manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32))
        elif p.ndim == 1:
            p.copy_(0.02 * torch.randn_like(p, dtype=torch.float32))
        else:
            fan_in = p[0].numel()
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.5 / fan_in ** 0.5))
    return module


def build_on_gpu(factory, dtype=torch.bfloat16):
    """Construct a module directly on the GPU in `dtype` (no host copy of the weights)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            return factory().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)


def released_dit(num_layers: int = 50, seed: int = 0):
    from h3render.models.dit import DiT
    from h3render.models.dit_config import DiTConfig

    cfg = dataclasses.replace(DiTConfig(), num_layers=num_layers)
    dit = build_on_gpu(lambda: DiT(cfg))
    random_(dit, seed)
    return dit.apply_precision_(torch.bfloat16)


def dit_inputs(dit, height: int, width: int, frames: int, text_len: int = 256, seed: int = 0):
    from h3render import sampling
    from h3render.packing import patchify_video, t2va_layout

    layout = t2va_layout(text_len, height, width, frames).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    text = torch.randn(text_len, dit.cfg.text_dim, device="cuda", generator=g).bfloat16()
    video, audio = sampling.draw_noise(seed, layout)
    return layout, text, patchify_video(video[0]).cuda(), audio.cuda()


def dit_flops(seq: int, cfg, layers: int) -> tuple[float, float]:
    """(attention, linear) FLOP of one forward (DESIGN.md §3 accounting)."""
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    lin = 2 * seq * (3 * cfg.hidden_size * inner + inner * cfg.hidden_size + 3 * cfg.hidden_size * cfg.ffn_dim)
    att = 4 * seq * seq * inner
    return att * layers, lin * layers


PROMPT = ("A lighthouse keeper climbs the spiral stairs at dusk, camera tracking upward; wind, waves, the creak of "
          "iron steps. [Speaker 1]: \"Storm's coming.\"")


@torch.no_grad()
def released_vsa_case(sparsity: float, canvas: tuple[int, int, int] = (1344, 768, 243)):
    """One VSA layer of the released DiT at `canvas` (width, height, frames; default the released geometry,
    1344x768x243 with 300 text rows: S = 73,686, 56 heads x 128, 1,206 tiles) on CUDA: random bf16 q, k, v, gate
    (seed 0, drawn in that order) and the kept sets from their tile scores.

    Returns a namespace: plan, q, k, v, gate `[S, H, D]`, pooled_k `[H, n, D]` fp32, scores `[H, n, n]`, sel
    `[H, V, K]` int32, k_kept, k_mean `[H, D]` (the int8 smoothing), flop (effective: 4 S^2 H D x block density).
    """
    from types import SimpleNamespace

    from h3render.kernels.vsa import select_tiles
    from h3render.kernels.vsa.naive import tile_scores
    from h3render.kernels.vsa.quant import head_mean_from_pooled
    from h3render.kernels.vsa.triton_impl import pool_tiles_triton
    from h3render.models.attention import SparseAttention
    from h3render.packing import t2va_layout

    width, height, frames = canvas
    plan = SparseAttention.for_layout(t2va_layout(300, height, width, frames), sparsity, "cuda").plan
    heads, dim, n = 56, 128, plan.num_tiles
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, gate = (torch.randn(plan.seq_len, heads, dim, device="cuda", generator=g).bfloat16() for _ in range(4))
    pooled_k = pool_tiles_triton(k, plan)
    scores = tile_scores(pool_tiles_triton(q, plan), pooled_k)
    sel = select_tiles(scores, plan, sparsity)
    k_kept = sel.shape[-1]
    density = (plan.num_prefix * n + plan.num_video * (plan.num_prefix + k_kept)) / n ** 2
    return SimpleNamespace(plan=plan, q=q, k=k, v=v, gate=gate, pooled_k=pooled_k, scores=scores, sel=sel,
                           k_kept=k_kept, k_mean=head_mean_from_pooled(pooled_k, plan),
                           flop=4 * plan.seq_len ** 2 * heads * dim * density)
