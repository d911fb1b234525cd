"""Per-head QK RMSNorm + partial RoPE, fused with the split of the qkv projection.

MiniMax-H3 (released checkpoint): head dim D = 128, RoPE on the leading R = 96 channels (16 frequencies x 3 axes,
doubled for rotate_half), RMSNorm eps 1e-5 with separate q and k weights. Math is fp32 whatever the input dtype;
the result is rounded once to the input dtype. (diffusers in bf16 rounds after the norm, the weight multiply and
each RoPE product, so bf16 results differ from it by a few bf16 ulps; fp32 results match it.)

The video VAE decoder (`models.video_vae.ViTAttention`) runs the same kernel on its batches: q, k [B, S, H, D] views of
its qkv projection, no norm weight, head dim D = 64 with R = 48, and B tiles sharing one [S, R] cos/sin table.
Both use the same rotate_half convention (cos/sin [S, R] with the R/2 angles duplicated; out[:R] = x[:R] * cos +
cat(-x[R/2:R], x[:R/2]) * sin; channels R..D pass through).
"""

from __future__ import annotations

import torch

from h3render.kernels.qk_norm_rope.naive import qk_norm_rope_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["qk_norm_rope", "qk_norm_rope_qkv", "qk_norm_rope_naive"]


def _check(q, k, v, q_weight, k_weight, cos, sin) -> None:
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be [S, H, D] or [B, S, H, D], got shape {tuple(q.shape)}")
    S, H, D = q.shape[-3:]
    for name, t in (("k", k), ("v", v)):
        if t is not None and (t.shape != q.shape or t.dtype != q.dtype or t.device != q.device):
            raise ValueError(f"{name} must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(t.shape)}, {t.dtype}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"{name} must be [D={D}], got shape {tuple(w.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must both be given or both be None")
    if cos is None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None:
                check_last_dim_contiguous(name, t)
        return
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] != S:
        raise ValueError(f"cos and sin must both be [S={S}, R], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    R = cos.shape[1]
    if R % 2 or R > D:
        raise ValueError(f"rotary width R={R} must be even and <= head dim D={D}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if t is not None:
            check_last_dim_contiguous(name, t)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k -> RoPE(RMSNorm_heads(.)); v, if given, copied alongside into the same contiguous layout.

    Args:
        q: [S, H, D] (the DiT) or [B, S, H, D] (B items of S rows: the video VAE decoder's batch of tiles),
            bf16/fp16/fp32, any strides over B, S and H, unit stride over D.
        k: like q.
        v: like q, or None; copied so that q, k, v come back in one layout.
        q_weight: [D] RMSNorm weight of the query heads, or None (no weight: the video VAE decoder).
        k_weight: [D] RMSNorm weight of the key heads; None exactly when q_weight is None.
        cos: [S, R] float32 cosines of the rotary angles, R even, R <= D (released DiT: R = 96, D = 128; video VAE
            decoder: R = 48, D = 64), one table for all B items (packed row b * S + s reads row s);
            None for no RoPE (the token refiner).
        sin: [S, R] float32 sines, None exactly when cos is None.
        eps: RMSNorm epsilon (released checkpoint: 1e-5).
        out: optional preallocated contiguous outputs shaped like q (q, k, and v or None).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one. Under
            `torch.compile` the Triton path is the `h3render::qk_norm_rope` op (`triton_impl.qk_norm_rope_op`),
            which Inductor launches as one kernel.

    Returns:
        (q, k, v): contiguous, shaped like q, in q's dtype (add a batch axis to [S, H, D] with `.unsqueeze(0)` for
        attention's [B, S, H, D]); v is None when v was None.

    Raises:
        ValueError: shapes, dtypes or strides do not fit the above.
    """
    _check(q, k, v, q_weight, k_weight, cos, sin)
    if use_triton_for(q, use_triton):
        if torch.compiler.is_compiling():
            # One opaque op (the video VAE decoder's compiled blocks): Dynamo traces none of the launcher's Python,
            # and Inductor launches this kernel as is instead of its own ~5 kernels (see triton_impl's docstring).
            from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_op

            q_out, k_out = qk_norm_rope_op(q, k, q_weight, k_weight, cos, sin, eps)
            result = (q_out, k_out, None if v is None else v.contiguous())
        else:
            from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_triton

            return qk_norm_rope_triton(q, k, v, q_weight, k_weight, cos, sin, eps, out=out)
    else:
        result = qk_norm_rope_naive(q, k, v, q_weight, k_weight, cos, sin, eps)
    if out is None:
        return result
    for dst, src in zip(out, result):
        if dst is not None:
            dst.copy_(src)
    return out


def qk_norm_rope_qkv(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-5,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused qkv projection output and return attention-ready q, k, v in one pass.

    Args:
        qkv: [S, H, 3, D], unit stride over D. The official checkpoint interleaves rows per head, so its
            projection output [S, H*3*D] is `.view(S, H, 3, D)`; a stacked [q; k; v] projection [S, 3*H*D] is
            `.view(S, 3, H, D).transpose(1, 2)` (a strided view, no copy).
        q_weight, k_weight: [D]; cos, sin: [S, R] float32 or None; eps: as in `qk_norm_rope`.
        out, use_triton: as in `qk_norm_rope`.

    Returns:
        (q, k, v): contiguous [S, H, D] each, in qkv's dtype.

    Raises:
        ValueError: qkv is not [S, H, 3, D] or the other arguments do not fit.
    """
    if qkv.ndim != 4 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [S, H, 3, D], got shape {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)  # [S, H, D] strided views
    return qk_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps, out=out, use_triton=use_triton)
