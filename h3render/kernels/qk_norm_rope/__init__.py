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

__all__ = ["check_inputs", "qk_norm_rope", "qk_norm_rope_qkv", "qk_norm_rope_naive"]


def check_inputs(q, k, v, q_weight, k_weight, cos, sin) -> None:
    """Raise ValueError unless the arguments fit `qk_norm_rope` (shapes, dtypes, unit stride over D and R); also
    `kernels.vsa.vsa_prep`'s check, which takes the same inputs."""
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


def _check_v_slot(q, v, out, v_slot) -> None:
    """The row map of v (`qk_norm_rope(..., v_slot=)`): [S] integers with out's v buffer [N >= S, H, D] contiguous.
    Its values (distinct, in [0, N)) are the caller's promise: checking them would sync the host with the GPU."""
    where = "qk_norm_rope: v_slot"
    if q.ndim != 3:
        raise ValueError(f"{where} takes [S, H, D] inputs (one item), got q of shape {tuple(q.shape)}")
    if v is None or out is None or out[2] is None:
        raise ValueError(f"{where} needs v and out=(q_out, k_out, v_out) with a v buffer to write into")
    S, H, D = q.shape
    if v_slot.ndim != 1 or v_slot.shape[0] != S or v_slot.dtype not in (torch.int32, torch.int64) \
            or v_slot.device != q.device:
        raise ValueError(f"{where} must be [S={S}] int32/int64 on {q.device}, got {tuple(v_slot.shape)} "
                         f"{v_slot.dtype} on {v_slot.device}")
    v_out = out[2]
    if v_out.ndim != 3 or v_out.shape[0] < S or v_out.shape[1:] != (H, D) or v_out.dtype != v.dtype \
            or v_out.device != v.device or not v_out.is_contiguous():
        raise ValueError(f"{where}: the v buffer must be contiguous [N >= {S}, {H}, {D}] {v.dtype} on {v.device}, "
                         f"got {tuple(v_out.shape)} {v_out.dtype} on {v_out.device}"
                         f"{'' if v_out.is_contiguous() else ' (not contiguous)'}")


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
    v_slot: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k -> RoPE(RMSNorm_heads(.)); v, if given, copied alongside into the same contiguous layout (or, with
    `v_slot`, row by row into a buffer of another row order).

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
        out: optional preallocated contiguous outputs shaped like q (q, k, and v or None); with v_slot the v entry
            is any contiguous [N, H, D] buffer, N >= S.
        v_slot: [S] int32/int64 or None (3-D inputs with `out` only): v row s is written to row `v_slot[s]` of
            out[2] instead of row s, in the same pass (the DiT's VSA path: `TilePlan.slot`, so v lands in the fine
            kernels' tile order, `kernels.vsa.tiles.empty_tiles`). Rows of out[2] not in v_slot are left as they
            are. The entries must be distinct and in [0, N): not checked (that would sync with the GPU). Eager only:
            the `torch.compile` op refuses it.
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one. Under
            `torch.compile` the Triton path is the `h3render::qk_norm_rope` op (`triton_impl.qk_norm_rope_op`),
            which Inductor launches as one kernel.

    Returns:
        (q, k, v): contiguous, shaped like q, in q's dtype (add a batch axis to [S, H, D] with `.unsqueeze(0)` for
        attention's [B, S, H, D]); v is None when v was None.

    Raises:
        ValueError: shapes, dtypes or strides do not fit the above.
    """
    check_inputs(q, k, v, q_weight, k_weight, cos, sin)
    if v_slot is not None:
        _check_v_slot(q, v, out, v_slot)
    if use_triton_for(q, use_triton):
        if torch.compiler.is_compiling():
            if v_slot is not None:  # only the eager DiT scatters v; the op has no v at all
                raise ValueError("qk_norm_rope: v_slot is not supported under torch.compile")
            # One opaque op (the video VAE decoder's compiled blocks): Dynamo traces none of the launcher's Python,
            # and Inductor launches this kernel as is instead of its own ~5 kernels (see triton_impl's docstring).
            from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_op

            q_out, k_out = qk_norm_rope_op(q, k, q_weight, k_weight, cos, sin, eps)
            result = (q_out, k_out, None if v is None else v.contiguous())
        else:
            from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_triton

            return qk_norm_rope_triton(q, k, v, q_weight, k_weight, cos, sin, eps, out=out, v_slot=v_slot)
    else:
        v_out = None if v_slot is None else out[2]
        result = qk_norm_rope_naive(q, k, v, q_weight, k_weight, cos, sin, eps, v_out=v_out, v_slot=v_slot)
    if out is None:
        return result
    for dst, src in zip(out, result):
        if dst is not None and dst is not src:  # with v_slot the reference already scattered v into out[2]
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
