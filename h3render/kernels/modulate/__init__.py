"""AdaLN modulation of the packed rows: RMSNorm(x) * (1 + scale[r]) + shift[r].

MiniMax-H3 keeps one modulation row per (timestep, modality): a block's table is [K*3, 6, C] in the order
shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp (diffusers `MiniMaxH3AdaLayerNormModulation`),
addressed by r = timestep_index * 3 + modality tag; the final norm's table is [K, 2, C] (shift, scale) addressed
by the timestep index. Pass the two slots as strided views, e.g. `table[:, 0]` and `table[:, 1]`.
"""

from __future__ import annotations

import torch

from h3render.kernels.fp8 import Fp8Rows
from h3render.kernels.modulate.naive import modulate_naive
from h3render.kernels.utils import check_last_dim_contiguous, use_triton_for

__all__ = ["modulate", "modulate_naive", "check_rows"]


def check_rows(x: torch.Tensor, row_index: torch.Tensor, tables: dict[str, torch.Tensor]) -> None:
    """Validate x [S, C], row_index [S] int and each table [R, C] (unit stride over C) against each other.

    Raises:
        ValueError: naming the first argument that does not fit.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [S, C], got shape {tuple(x.shape)}")
    S, C = x.shape
    if row_index.shape != (S,) or row_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"row_index must be [S={S}] int32/int64, got {tuple(row_index.shape)} {row_index.dtype}")
    if row_index.device != x.device:
        raise ValueError(f"row_index is on {row_index.device}, x on {x.device}")
    for name, t in tables.items():
        if t.ndim != 2 or t.shape[1] != C:
            raise ValueError(f"{name} must be [R, C={C}], got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        check_last_dim_contiguous(name, t)
    check_last_dim_contiguous("x", x)


def modulate(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
    fp8: bool = False,
    use_triton: bool | None = None,
) -> "torch.Tensor | Fp8Rows":
    """RMSNorm each row, then scale and shift it by its own table row, in one pass over x.

    Args:
        x: [S, C] residual stream (bf16 on GPU), unit stride over C.
        norm_weight: [C] RMSNorm weight (released checkpoint: norm1 / norm2 / norm_out weights), or None.
        shift: [R, C] shift table, e.g. `table[:, 0]` of a block's [R, 6, C] table.
        scale: [R, C] scale table, e.g. `table[:, 1]`; applied as (1 + scale).
        row_index: [S] int32/int64 table row of every packed row (values in [0, R); not checked on the GPU).
        eps: RMSNorm epsilon (released checkpoint: 1e-5).
        out: optional [S, C] output buffer (not with fp8).
        fp8: return `Fp8Rows` (e4m3 data [S, C] + per-row fp32 scale [S, 1]) quantized from the fp32 result in the
            same pass, for an FP8 linear (`--precision fp8`).
        use_triton: None = Triton on CUDA tensors, torch reference otherwise; True/False force one.

    Returns:
        [S, C] in x's dtype (or `Fp8Rows` when fp8); math in fp32, rounded once.

    Raises:
        ValueError: shapes, dtypes, devices or strides do not fit the above.
    """
    check_rows(x, row_index, {"shift": shift, "scale": scale})
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight must be [C={x.shape[1]}], got shape {tuple(norm_weight.shape)}")
    if fp8 and out is not None:
        raise ValueError("out= is for the bf16 result; fp8=True allocates its Fp8Rows")
    if use_triton_for(x, use_triton):
        if fp8:
            from h3render.kernels.modulate.triton_impl import modulate_fp8_triton

            return Fp8Rows(*modulate_fp8_triton(x, norm_weight, shift, scale, row_index, eps))
        from h3render.kernels.modulate.triton_impl import modulate_triton

        return modulate_triton(x, norm_weight, shift, scale, row_index, eps, out=out)
    if fp8:
        return Fp8Rows(*modulate_naive(x, norm_weight, shift, scale, row_index, eps, fp8=True))
    result = modulate_naive(x, norm_weight, shift, scale, row_index, eps)
    return result if out is None else out.copy_(result)
