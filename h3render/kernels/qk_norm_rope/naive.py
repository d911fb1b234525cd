"""Plain-torch reference for the per-head QK RMSNorm + partial RoPE (MiniMax-H3 attention input)."""

from __future__ import annotations

import torch


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, fp32 math.

    Args:
        x: [(B,) S, H, D] any float dtype.
        weight: [D], or None for no weight (the video VAE decoder).
        eps: added to the mean square (released checkpoint: 1e-5).

    Returns:
        [(B,) S, H, D] float32.
    """
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight.float()


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading R channels of every head (rotate_half convention), pass the rest through.

    With x1, x2 = x[..., :R/2], x[..., R/2:R]: out[..., :R] = x[..., :R] * cos + cat(-x2, x1) * sin.

    Args:
        x: [(B,) S, H, D] float32.
        cos, sin: [S, R] angles' cosine and sine (shared by the B items), R even and <= D (released DiT: R = 96 of
            D = 128; video VAE decoder: R = 48 of D = 64).

    Returns:
        [(B,) S, H, D] float32.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # [S, H, R/2] each
    cos = cos.float()[:, None, :]  # [S, 1, R]
    sin = sin.float()[:, None, :]
    x_rot = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def qk_norm_rope_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    *,
    v_out: torch.Tensor | None = None,
    v_slot: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference: q, k -> RoPE(RMSNorm(.)) in fp32 (no RoPE when cos is None), cast back; v copied contiguous, or
    scattered by row into `v_out` with `v_slot`.

    Args:
        q, k, v: [S, H, D] or [B, S, H, D] (views of the qkv projection are fine); v may be None.
        q_weight, k_weight: [D] per-head RMSNorm weights, or both None (no weight).
        cos, sin: [S, R] float32 shared by the B items, or None for no RoPE.
        eps: RMSNorm epsilon.
        v_out: [N, H, D] with N >= S, given exactly with v_slot (3-D v only; checked by `qk_norm_rope`).
        v_slot: [S] int32/int64, distinct rows of v_out: v row s goes to `v_out[v_slot[s]]`; other rows untouched.

    Returns:
        (q, k, v): q, k contiguous, shaped like q, in the input dtype; v contiguous like q, or v_out itself with
        v_slot, or None when v was None.
    """
    q_out, k_out = rms_norm_heads(q, q_weight, eps), rms_norm_heads(k, k_weight, eps)
    if cos is not None:
        q_out, k_out = rope_rotate_half(q_out, cos, sin), rope_rotate_half(k_out, cos, sin)
    q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
    if v_slot is not None:
        v_out[v_slot] = v  # a row scatter, as the Triton kernel's v store with a row map
        return q_out, k_out, v_out
    return q_out, k_out, None if v is None else v.contiguous()
