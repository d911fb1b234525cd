"""Triton launcher + kernel for the fused per-head QK RMSNorm + partial RoPE.

One program handles one packed row s and BLOCK_H heads: it reads q and k straight from the qkv projection's
output (any row/head strides, unit stride along D), normalizes each head in fp32, rotates the leading R channels,
and writes q, k (and a copy of v) contiguously as [S, H, D], the layout FlashAttention and SDPA want.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import calculate_settings, next_power_of_2

# A program's tile is BLOCK_H x BLOCK_D elements; ~2048 keeps registers modest at D = 128 (16 heads).
_TILE_ELEMENTS = 2048


@triton.jit
def _norm_rope_tile(
    x_ptr,  # row s of one input, [H, D] at (stride_h, 1)
    w_ptr,  # [D] RMSNorm weight
    out_ptr,  # row s of the output, contiguous [H, D]
    stride_h,
    heads,  # [BLOCK_H] head indices
    dims,  # [BLOCK_D] channel indices
    partner,  # [BLOCK_D] rotate_half partner channel (itself outside the rotary part)
    cos,  # [BLOCK_D] fp32, 1 outside the rotary part
    sin_signed,  # [BLOCK_D] fp32, -sin for the first R/2 channels, +sin for the next R/2, 0 after
    mask,  # [BLOCK_H, BLOCK_D]
    D,
    eps,
):
    row_off = heads[:, None] * stride_h
    x = tl.load(x_ptr + row_off + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    # Masked lanes load 0, so the sum over BLOCK_D equals the sum over the D real channels.
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_H]
    w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
    # The partner channel is re-read from memory (an L1 hit) instead of shuffled across lanes.
    xp = tl.load(x_ptr + row_off + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dims < D, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    yp = xp * rstd[:, None] * wp[None, :]
    out = y * cos[None, :] + yp * sin_signed[None, :]
    out_off = heads[:, None] * D + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [S, H, D] strides (stride_q_s, stride_q_h, 1)
    k_ptr,  # [S, H, D] strides (stride_k_s, stride_k_h, 1)
    v_ptr,  # [S, H, D] strides (stride_v_s, stride_v_h, 1); unused unless HAS_V
    q_out_ptr,  # [S, H, D] contiguous
    k_out_ptr,
    v_out_ptr,
    q_w_ptr,  # [D]
    k_w_ptr,  # [D]
    cos_ptr,  # [S, R] strides (stride_cos_s, 1)
    sin_ptr,  # [S, R] strides (stride_sin_s, 1)
    stride_q_s,
    stride_q_h,
    stride_k_s,
    stride_k_h,
    stride_v_s,
    stride_v_h,
    stride_cos_s,
    stride_sin_s,
    H,
    D,
    R,
    eps,
    HAS_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 row index: S * (3 * H * D) passes 2**31 at about 100k rows of the released model.
    s = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (dims[None, :] < D)

    half = R // 2
    partner = tl.where(dims < half, dims + half, tl.where(dims < R, dims - half, dims))
    in_rot = dims < R
    cos = tl.load(cos_ptr + s * stride_cos_s + dims, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + s * stride_sin_s + dims, mask=in_rot, other=0.0).to(tl.float32)
    sin_signed = tl.where(dims < half, -sin, sin)

    out_row = s * H * D
    _norm_rope_tile(q_ptr + s * stride_q_s, q_w_ptr, q_out_ptr + out_row, stride_q_h,
                    heads, dims, partner, cos, sin_signed, mask, D, eps)
    _norm_rope_tile(k_ptr + s * stride_k_s, k_w_ptr, k_out_ptr + out_row, stride_k_h,
                    heads, dims, partner, cos, sin_signed, mask, D, eps)
    if HAS_V:
        v = tl.load(v_ptr + s * stride_v_s + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
        tl.store(v_out_ptr + out_row + heads[:, None] * D + dims[None, :], v, mask=mask)


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the fused kernel. Arguments as in `kernels.qk_norm_rope.qk_norm_rope_qkv`, already validated.

    Args:
        q, k, v: [S, H, D], unit stride along D; v may be None.
        q_weight, k_weight: [D].
        cos, sin: [S, R], unit stride along R, or None (R = 0: norm only).
        eps: RMSNorm epsilon.
        out: optional preallocated contiguous (q, k, v) outputs [S, H, D] (v entry None when v is None).

    Returns:
        (q, k, v) contiguous [S, H, D] in q's dtype; v is None when v was None.
    """
    S, H, D = q.shape
    R = 0 if cos is None else cos.shape[-1]
    if out is None:
        q_out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
        k_out = torch.empty((S, H, D), dtype=k.dtype, device=k.device)
        v_out = None if v is None else torch.empty((S, H, D), dtype=v.dtype, device=v.device)
    else:
        q_out, k_out, v_out = out
    if S == 0:
        return q_out, k_out, v_out
    block_d = next_power_of_2(D)
    block_h = min(next_power_of_2(H), max(1, _TILE_ELEMENTS // block_d))
    _, num_warps = calculate_settings(block_h * block_d)
    has_v = v is not None
    v_in = v if has_v else q  # placeholder pointer; never read when HAS_V is False
    v_dst = v_out if has_v else q_out
    if cos is None:  # R = 0: the kernel masks every cos/sin load, any pointer will do
        cos = sin = q_weight.new_zeros((1, 1), dtype=torch.float32)
    grid = (S, triton.cdiv(H, block_h))
    _qk_norm_rope_kernel[grid](
        q, k, v_in, q_out, k_out, v_dst, q_weight, k_weight, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_in.stride(0), v_in.stride(1),
        cos.stride(0), sin.stride(0),
        H, D, R, eps,
        HAS_V=has_v, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )
    return q_out, k_out, v_out
