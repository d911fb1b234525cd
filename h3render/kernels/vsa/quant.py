"""INT8 keys for the fine kernels' QKᵀ (`fine_attention_triton(..., qk_int8=True)`), SageAttention's scheme.

Keys are smoothed (the head's mean key subtracted: softmax over keys is unchanged, since q·(k - k̄) differs from q·k
by q·k̄, the same for every key of a query row) and quantized per row and head to int8 with a symmetric scale
`amax / 127`; queries are quantized the same way (no smoothing) inside the fine kernel's prologue. The scores are
then the int32 product of the codes times both scales: Hopper runs an int8 MMA at twice the bf16 rate, and a key
tile is 8 KB instead of 16 KB. Source of the scheme: SageAttention (Zhang et al., ICLR 2025, arXiv 2410.02367): int8
Q and K with K smoothing, P and V in 16 bits.

Rounding, here and in the kernels: `code = floor(x * (127 / amax) + 0.5)` with IEEE division (`div_rn`), `scale =
amax / 127`, amax clamped to >= 1e-20 so an all-zero row gives zero codes (never 0 * inf).

This module is torch only (the CPU path imports it); the Triton side is `quant_triton.py`.
"""

from __future__ import annotations

import torch

from h3render.kernels.vsa.tiles import TILE, TilePlan

AMAX_FLOOR = 1e-20  # an all-zero row: codes 0, scale 1e-20 / 127 (finite)


def rows_int8_naive(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of every row over the last dim. `x [..., D]` -> (codes `[..., D]` int8, scale `[...]`
    fp32), `x ≈ codes * scale[..., None]`."""
    x = x.float()
    amax = x.abs().amax(-1).clamp_min(AMAX_FLOOR)
    q127 = torch.full_like(amax, 127.0)  # tensor / tensor: IEEE division (`127.0 / t` is `t.reciprocal() * 127`,
    # and CUDA divides a tensor by a Python scalar as a multiply by its reciprocal)
    codes = torch.floor(x * (q127 / amax)[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return codes, amax / q127


def key_tiles_int8_naive(k: torch.Tensor, plan: TilePlan, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `key_tiles_int8`.

    Args:
        k: `[S, H, D]` packed key rows (post-norm, post-RoPE), any float dtype.
        mean: `[H, D]` fp32, the head's mean key (subtracted before quantizing).
    Returns:
        codes `[n * 64, H, D]` int8 in tile order (pad slots 0) and scales `[H, n * 64]` fp32 (pad slots 0).
    """
    codes, scale = rows_int8_naive(k.float() - mean[None].float())  # [S, H, D], [S, H]
    out = torch.zeros(plan.padded_len, *k.shape[1:], dtype=torch.int8, device=k.device)
    out[plan.slot] = codes
    scales = torch.zeros(k.shape[1], plan.padded_len, dtype=torch.float32, device=k.device)
    scales[:, plan.slot] = scale.t()
    return out, scales


def head_mean_from_pooled(pooled: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """The mean key of each head from the tile means: `[H, n, D]` fp32 -> `[H, D]` fp32 (size-weighted)."""
    sizes = plan.sizes.to(pooled.dtype)
    return (pooled * sizes[None, :, None]).sum(1) / sizes.sum()


def fine_attention_int8_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, plan: TilePlan,
                              mean: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of the fine stage with `qk_int8`: `fine_attention_naive` (fp32 math) on the dequantized codes.

    Args:
        q, k, v: `[S, H, D]` packed rows; mask: `[H, n, n]` bool kept pairs; mean: `[H, D]` fp32 or None (zeros).
    Returns:
        `[S, H, D]` in q's dtype.
    """
    from h3render.kernels.vsa.naive import fine_attention_naive

    if mean is None:
        mean = torch.zeros(q.shape[1], q.shape[2], device=q.device)
    qc, qs = rows_int8_naive(q)
    kc, ks = rows_int8_naive(k.float() - mean[None].float())
    out = fine_attention_naive(qc.float() * qs[..., None], kc.float() * ks[..., None], v.float(), mask, plan)
    return out.to(q.dtype)
