"""Triton launchers + kernels for the anti-aliased SnakeBeta activation: two passes over the signal instead of ~9.

Pass 1 (`_upsample_snake_kernel`) reads x once and writes the activated x2 signal; pass 2 (`_lowpass_down_kernel`)
reads that once and writes the output. The replicate padding of both convolutions becomes clamped indices, the
transposed convolution its two polyphase 6-tap sums:

    u[2m]     = 2 * sum_{s=-3..2} f[5 - 2s] * x[clamp(m + s)]
    u[2m + 1] = 2 * sum_{s=-2..3} f[6 - 2s] * x[clamp(m + s)]          (f: 12-tap upsampling filter)
    a[n]      = u[n] + inv_beta[c] * sin(alpha[c] * u[n])^2
    y[m]      = sum_{k=0..11} g[k] * a[clamp(2m + k - 5)]               (g: 12-tap low-pass filter)

with clamp to the valid range of the signal indexed. A program covers BLOCK positions of one (batch, channel) row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3render.kernels.utils import interpreting

_BLOCK = 1024
_NUM_WARPS = 4
# The sine on the GPU is libdevice's `__nv_sinf`, the CUDA math library's accurate sinf that torch.sin calls too;
# the CPU interpreter (tests) has no libdevice and runs `tl.sin` (numpy's).
_PRECISE_SIN = not interpreting()


@triton.jit
def _upsample_snake_kernel(
    x_ptr,  # [R, L] rows of x [B, C, L] (contiguous), R = B * C
    f_ptr,  # [12] upsampling filter
    alpha_ptr,  # [C] e^alpha
    inv_beta_ptr,  # [C] 1 / (e^beta + 1e-9)
    out_ptr,  # [R, 2L] contiguous
    C,
    L,
    BLOCK: tl.constexpr,
    PRECISE_SIN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # input positions; outputs 2m and 2m + 1
    mask = m < L
    x_row = x_ptr + row * L
    even = tl.zeros([BLOCK], dtype=tl.float32)
    odd = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(7):  # s = t - 3 in -3..3
        idx = tl.minimum(tl.maximum(m + (t - 3), 0), L - 1)
        xv = tl.load(x_row + idx, mask=mask, other=0.0)
        if t <= 5:  # s <= 2: tap 5 - 2s = 11 - 2t
            even += (2.0 * tl.load(f_ptr + (11 - 2 * t))) * xv
        if t >= 1:  # s >= -2: tap 6 - 2s = 12 - 2t
            odd += (2.0 * tl.load(f_ptr + (12 - 2 * t))) * xv
    c = row % C
    alpha = tl.load(alpha_ptr + c)
    inv_beta = tl.load(inv_beta_ptr + c)
    if PRECISE_SIN:
        s_even = libdevice.sin(alpha * even)
        s_odd = libdevice.sin(alpha * odd)
    else:
        s_even = tl.sin(alpha * even)
        s_odd = tl.sin(alpha * odd)
    # [2 * BLOCK] outputs in order 2m, 2m + 1: one contiguous store
    activated = tl.interleave(even + inv_beta * (s_even * s_even), odd + inv_beta * (s_odd * s_odd))
    n = 2 * tl.program_id(1) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + row * (2 * L) + n, activated, mask=n < 2 * L)


@triton.jit
def _lowpass_down_kernel(
    a_ptr,  # [R, N] contiguous
    g_ptr,  # [12] low-pass filter
    out_ptr,  # [R, M] contiguous, M = ceil(N / 2)
    N,
    M,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = m < M
    a_row = a_ptr + row * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(12):
        idx = tl.minimum(tl.maximum(2 * m + (k - 5), 0), N - 1)
        acc += tl.load(g_ptr + k) * tl.load(a_row + idx, mask=mask, other=0.0)
    tl.store(out_ptr + row * M + m, acc, mask=mask)


def upsample_snake_triton(x: torch.Tensor, up_filter: torch.Tensor, alpha: torch.Tensor,
                          inv_beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, L] float32 contiguous; up_filter [12], alpha, inv_beta [C] float32 contiguous -> [B, C, 2L]."""
    b, c, length = x.shape
    out = torch.empty((b, c, 2 * length), dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    grid = (b * c, triton.cdiv(length, _BLOCK))
    _upsample_snake_kernel[grid](x, up_filter, alpha, inv_beta, out, c, length, BLOCK=_BLOCK,
                                 PRECISE_SIN=_PRECISE_SIN, num_warps=_NUM_WARPS)
    return out


def lowpass_downsample_triton(a: torch.Tensor, down_filter: torch.Tensor) -> torch.Tensor:
    """a [B, C, N] float32 contiguous; down_filter [12] -> [B, C, ceil(N / 2)]."""
    b, c, n = a.shape
    m = (n + 1) // 2
    out = torch.empty((b, c, m), dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    grid = (b * c, triton.cdiv(m, _BLOCK))
    _lowpass_down_kernel[grid](a, down_filter, out, n, m, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    return out
