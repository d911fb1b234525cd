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
