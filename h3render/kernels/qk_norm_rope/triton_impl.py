"""Triton launcher + kernel for the fused per-head QK RMSNorm + partial RoPE.

One program handles one packed row and BLOCK_H heads: it reads q and k straight from the qkv projection's output
(any item/row/head strides, unit stride along D), normalizes each head in fp32 (times the RMSNorm weight if
HAS_WEIGHT), rotates the leading R channels, and writes q, k (and a copy of v) contiguously as [B, S, H, D], the
layout FlashAttention and SDPA want. With V_SLOT (B = 1) the copy of v row s goes to row `v_slot[s]` of its buffer
instead: the DiT's sparse attention has v written straight into the fine kernels' tile order, saving them a second
pass over v (`kernels.vsa.tiles.empty_tiles`).

Two users: the DiT (one item, B = 1: q [S, H, D], weighted norm, R = 96 of D = 128) and the video VAE decoder
(B tiles per batch sharing one cos/sin table of S rows, no norm weight, R = 48 of D = 64). The program of packed row
`row` reads table row `row % S`, so a batch never needs B copies of cos/sin.

`qk_norm_rope_op` is the launcher as a `torch.library.triton_op`: under `torch.compile` (the video VAE decoder's
blocks) Inductor launches this one kernel as is instead of its own ~5 kernels for the norm, casts and RoPE
concatenations (5.7 ms of a ~100 ms decode batch on an H200, against ~2.5 ms for q and k read and written once at
HBM bandwidth; docs/performance.md §27).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from h3render.kernels.utils import calculate_settings, next_power_of_2

# A program's tile is BLOCK_H x BLOCK_D elements; ~2048 keeps registers modest at D = 128 (16 heads).
_TILE_ELEMENTS = 2048


@triton.jit
def norm_rope(x, xp, w, wp, cos, sin_signed, D, eps, HAS_WEIGHT: tl.constexpr):
    """The fp32 math of one block of heads: RMSNorm over the last axis (times the weight with HAS_WEIGHT), then
    rotate_half RoPE. Shared by this file's kernel (x [BLOCK_H, BLOCK_D], one packed row) and VSA's prep kernel
    (`kernels.vsa.prep_triton`, x [ROWS, BLOCK_H, BLOCK_D]), so that both write the same bits.

    x: [..., BLOCK_D] fp32, masked lanes 0; xp: x at each channel's rotate_half partner (same mask); w, wp: [BLOCK_D]
    fp32 weight at the channel and at its partner (ignored unless HAS_WEIGHT); cos, sin_signed: fp32, broadcastable
    to x (cos 1 and sin_signed 0 past the rotary part, sin_signed = -sin on the first R/2 channels). Returns fp32 like
    x; the caller rounds it once to the output dtype."""
    # Masked lanes load 0, so the sum over BLOCK_D equals the sum over the D real channels.
    rstd = tl.expand_dims(tl.rsqrt(tl.sum(x * x, axis=-1) / D + eps), -1)  # [..., 1]
    y = x * rstd
    yp = xp * rstd
    if HAS_WEIGHT:
        y = y * w
        yp = yp * wp
    return y * cos + yp * sin_signed


@triton.jit
def _norm_rope_tile(
    x_ptr,  # row s of one input, [H, D] at (stride_h, 1)
    w_ptr,  # [D] RMSNorm weight (read only if HAS_WEIGHT)
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
    HAS_WEIGHT: tl.constexpr,
):
    row_off = heads[:, None] * stride_h
    x = tl.load(x_ptr + row_off + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    # The partner channel is re-read from memory (an L1 hit) instead of shuffled across lanes.
    xp = tl.load(x_ptr + row_off + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w = cos  # placeholders: `norm_rope` reads the weights only with HAS_WEIGHT
    wp = cos
    if HAS_WEIGHT:
        w = tl.load(w_ptr + dims, mask=dims < D, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=dims < D, other=0.0).to(tl.float32)
    out = norm_rope(x, xp, w, wp, cos[None, :], sin_signed[None, :], D, eps, HAS_WEIGHT)
    out_off = heads[:, None] * D + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [B, S, H, D] strides (stride_q_b, stride_q_s, stride_q_h, 1)
    k_ptr,  # [B, S, H, D] strides (stride_k_b, stride_k_s, stride_k_h, 1)
    v_ptr,  # [B, S, H, D] strides (stride_v_b, stride_v_s, stride_v_h, 1); unused unless HAS_V
    q_out_ptr,  # [B, S, H, D] contiguous
    k_out_ptr,
    v_out_ptr,  # [B, S, H, D] contiguous; with V_SLOT [N, H, D] contiguous, N >= S (B = 1)
    v_slot_ptr,  # [S] int32/int64 output row of each v row; unused unless V_SLOT
    q_w_ptr,  # [D]; unused unless HAS_WEIGHT
    k_w_ptr,  # [D]; unused unless HAS_WEIGHT
    cos_ptr,  # [S, R] strides (stride_cos_s, 1), shared by the B items
    sin_ptr,  # [S, R] strides (stride_sin_s, 1)
    stride_q_b,
    stride_q_s,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_cos_s,
    stride_sin_s,
    S,  # rows per item = rows of the cos/sin table
    H,
    D,
    R,
    eps,
    HAS_V: tl.constexpr,
    V_SLOT: tl.constexpr,  # v row s to row v_slot[s] of v_out (B = 1); False compiles the plain copy as before
    HAS_WEIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 row index: S * (3 * H * D) passes 2**31 at about 100k rows of the released model.
    row = tl.program_id(0).to(tl.int64)  # packed row b * S + s
    b = row // S
    s = row - b * S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (dims[None, :] < D)

    half = R // 2
    partner = tl.where(dims < half, dims + half, tl.where(dims < R, dims - half, dims))
    in_rot = dims < R
    cos = tl.load(cos_ptr + s * stride_cos_s + dims, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + s * stride_sin_s + dims, mask=in_rot, other=0.0).to(tl.float32)
    sin_signed = tl.where(dims < half, -sin, sin)

    out_row = row * H * D
    _norm_rope_tile(q_ptr + b * stride_q_b + s * stride_q_s, q_w_ptr, q_out_ptr + out_row, stride_q_h,
                    heads, dims, partner, cos, sin_signed, mask, D, eps, HAS_WEIGHT)
    _norm_rope_tile(k_ptr + b * stride_k_b + s * stride_k_s, k_w_ptr, k_out_ptr + out_row, stride_k_h,
                    heads, dims, partner, cos, sin_signed, mask, D, eps, HAS_WEIGHT)
    if HAS_V:
        v_row = v_ptr + b * stride_v_b + s * stride_v_s
        v = tl.load(v_row + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
        if V_SLOT:  # one scalar load per program; int64: N * H * D may pass 2**31
            v_out_row = tl.load(v_slot_ptr + s).to(tl.int64) * H * D
        else:
            v_out_row = out_row
        tl.store(v_out_ptr + v_out_row + heads[:, None] * D + dims[None, :], v, mask=mask)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, S, H, D] view (the DiT's single item); [B, S, H, D] unchanged."""
    return t if t.ndim == 4 else t.unsqueeze(0)


def _launch(kernel, q, k, v, q_weight, k_weight, cos, sin, eps, q_out, k_out, v_out, v_slot=None) -> None:
    """Run `kernel` (`_qk_norm_rope_kernel`, or its `wrap_triton` form inside the op) over q, k (v) [(B,) S, H, D]
    into contiguous outputs of the same shape (v_out [N, H, D] with a v_slot [S] row map, B = 1): one program per
    packed row and block of heads."""
    q, k, q_out, k_out = _as_4d(q), _as_4d(k), _as_4d(q_out), _as_4d(k_out)
    B, S, H, D = q.shape
    if B * S == 0:
        return
    R = 0 if cos is None else cos.shape[-1]
    block_d = next_power_of_2(D)
    block_h = min(next_power_of_2(H), max(1, _TILE_ELEMENTS // block_d))
    _, num_warps = calculate_settings(block_h * block_d)
    has_v = v is not None
    v_in = _as_4d(v) if has_v else q  # placeholder pointer; never read when HAS_V is False
    v_dst = _as_4d(v_out) if has_v else q_out  # only its pointer is passed: any row count with a row map
    has_weight = q_weight is not None
    if not has_weight:  # placeholder pointers; never read when HAS_WEIGHT is False
        q_weight = k_weight = q
    if cos is None:  # R = 0: the kernel masks every cos/sin load, any pointer will do
        cos = sin = q.new_zeros((1, 1), dtype=torch.float32)
    grid = (B * S, triton.cdiv(H, block_h))
    kernel[grid](
        q, k, v_in, q_out, k_out, v_dst, q if v_slot is None else v_slot, q_weight, k_weight, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v_in.stride(0), v_in.stride(1), v_in.stride(2), cos.stride(0), sin.stride(0),
        S, H, D, R, eps,
        HAS_V=has_v, V_SLOT=v_slot is not None, HAS_WEIGHT=has_weight, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=num_warps,
    )


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    v_slot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the fused kernel. Arguments as in `kernels.qk_norm_rope.qk_norm_rope`, already validated.

    Args:
        q, k, v: [S, H, D] or [B, S, H, D], unit stride along D; v may be None.
        q_weight, k_weight: [D], or both None (no norm weight).
        cos, sin: [S, R], unit stride along R, shared by the B items, or None (R = 0: norm only).
        eps: RMSNorm epsilon.
        out: optional preallocated contiguous (q, k, v) outputs shaped like q (v entry None when v is None); with
            v_slot the v entry is a contiguous [N, H, D] buffer, N >= S.
        v_slot: [S] int32/int64 or None: v row s goes to row v_slot[s] of out[2] ([S, H, D] inputs, out given).

    Returns:
        (q, k, v) contiguous, shaped like q, in q's dtype (v: out[2] itself with v_slot); v is None when v was None.
    """
    if out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        v_out = None if v is None else torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        q_out, k_out, v_out = out
    _launch(_qk_norm_rope_kernel, q, k, v, q_weight, k_weight, cos, sin, eps, q_out, k_out, v_out, v_slot)
    return q_out, k_out, v_out


@triton_op("h3render::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope_triton` for q and k only (new outputs) as one operator that `torch.compile(fullgraph=True)`
    traces to one Triton kernel launch (`wrap_triton`); eager callers launch `qk_norm_rope_triton` directly.

    Args:
        q, k: [S, H, D] or [B, S, H, D] (bf16 on GPU), unit stride along D (views of the qkv projection's output).
        q_weight, k_weight: [D] or both None; cos, sin: [S, R] or both None; eps: RMSNorm epsilon.

    Returns:
        (q, k): contiguous, shaped like q, in q's dtype.
    """
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    # `wrap_triton(<kernel name>)` spelled out here: torch finds the op's kernels by reading this source, and their
    # code then keys the AOTAutograd cache (an edited kernel is not served from a stale compiled graph).
    _launch(wrap_triton(_qk_norm_rope_kernel), q, k, None, q_weight, k_weight, cos, sin, eps, q_out, k_out, None)
    return q_out, k_out
