"""Residual add + RMSNorm + e4m3 row quantization in one pass: the FP8 video VAE decoder's fusion points.

An FP8 `models.video_vae.ViTBlock` (`models.fp8.quantize_video_decoder_fp8_`) adds each linear's output into its
fp32 residual stream and then normalizes the new residual for the next FP8 linear: `x + attn * scale1` -> norm2 ->
fc1, and `x + ff * scale2` -> the next block's norm1 -> its qkv. This kernel reads the residual row and the linear's
output once and writes the new residual and the next linear's `Fp8Rows` (docs/performance.md §27 profile:
each fusion point was two or three Inductor passes over the 118 MB fp32 residual of an 8-item batch).
"""

from __future__ import annotations

import torch

from h3render.kernels.fp8 import Fp8Rows
from h3render.kernels.residual_norm_fp8.naive import residual_norm_fp8_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["residual_norm_fp8", "residual_norm_fp8_naive"]


def _check(x: torch.Tensor, y: torch.Tensor | None, gain: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.ndim != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be [M, N] float32, got shape {tuple(x.shape)} {x.dtype}")
    check_last_dim_contiguous("x", x)
    n = x.shape[1]
    if (y is None) != (gain is None):
        raise ValueError("y and gain go together: both (residual add) or neither (norm + quantization only)")
    if y is not None:
        if y.shape != x.shape or not y.is_floating_point():
            raise ValueError(f"y must be float [M, N] = {tuple(x.shape)}, got shape {tuple(y.shape)} {y.dtype}")
        check_last_dim_contiguous("y", y)
    for name, t in (("gain", gain), ("weight", weight)):
        if t is not None and (t.shape != (n,) or t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous [N={n}] float32, got shape {tuple(t.shape)} {t.dtype}")


def residual_norm_fp8(
    x: torch.Tensor, y: torch.Tensor | None, gain: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, Fp8Rows]:
    """x_new = x + y * gain, then `Fp8Rows` of rms_norm(x_new, weight, eps) rounded to bf16, in one pass per row.

    Args:
        x: [M, N] float32 residual rows (the decoder's [B, S, dim] stream flattened), unit stride over N.
        y: [M, N] a linear's output (bf16 in the FP8 decoder), unit stride over N; or None: no residual add (the
            first block's norm1 input), x is normalized as is.
        gain: [N] float32 residual gain (the block's scale1 / scale2), contiguous; None with y None.
        weight: [N] float32 RMSNorm weight, contiguous; eps: its epsilon (`nn.RMSNorm.eps`).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        (x_new, rows): x_new [M, N] float32, a new tensor (x itself when y is None); rows = `Fp8Rows`
        (data [M, N] float8_e4m3fn, scale [M, 1] float32), the per-row e4m3 quantization (`kernels.fp8`) of
        `nn.RMSNorm(N, eps)` (weight) of x_new in fp32, rounded to bf16: what `Fp8Linear` makes of the
        bf16 input the unfused block hands it. x_new is bit-equal to the reference; so are data and scale except
        where a bf16 rounding of the normed row sits within a few fp32 ulps of a tie (`triton_impl` says why).
        NaN or Inf in a row of x_new makes that row's scale and codes NaN (as `quantize_rows` of the NaN rows the
        reference norm writes); x_new keeps them as they are.

    Raises:
        ValueError: shapes, dtypes or strides other than the above; y without gain or gain without y.
    """
    _check(x, y, gain, weight)
    if use_triton_for(x, use_triton):
        from h3render.kernels.residual_norm_fp8.triton_impl import residual_norm_fp8_triton

        x_new, data, scale = residual_norm_fp8_triton(x, y, gain, weight, eps)
        return x_new, Fp8Rows(data, scale)
    x_new, data, scale = residual_norm_fp8_naive(x, y, gain, weight, eps)
    return x_new, Fp8Rows(data, scale)
