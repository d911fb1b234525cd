"""Triton launchers + kernel for AdaLN modulation: one program normalizes ROWS packed rows ([ROWS, BLOCK_C] blocks).

The same kernel writes either the rows in the output dtype (bf16) or, with FP8, their e4m3 codes and per-row scales
straight from the fp32 result (`kernels.fp8.triton_impl`): no bf16 intermediate, one read of x.

Launch shape: `LAUNCH` (rows, warps) for the FP8 output at the block width it was timed at, else one row a program
with `calculate_settings(C)` warps (see `launch_settings`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.fp8.triton_impl import fp8_rows_out, quantize_codes, row_scale
from h3render.kernels.utils import calculate_settings, interpreting

# (rows a program, warps) of the FP8-output launch at BLOCK_C == LAUNCH_BLOCK_C (4097 <= C <= 8192). docs/
# performance.md §28.5 (1×H200, C = 5,376, FP8 out, S = 73,642 / 19,540): the one-row, 16-warp launch took 0.664 /
# 0.182 ms, 2 rows × 4 warps 0.570 / 0.160 ms (the fastest of 1-8 rows × 4-16 warps; 2 × 8 and 4 × 4 were slower than
# one row). Only that block width and the FP8 output were timed: other widths keep the one-row launch, whose warps
# `calculate_settings` scales with the block (2 rows × 4 warps at a 16384 block would hold 256 fp32 a thread per
# live tensor), and the bf16 output does too until it is measured. Fewer warps sum the squares in another order:
# codes one e4m3 step off in 2-5 of 10 million versus the one-row launch (§28.5). None: the one-row launch
# everywhere (the "before" of scripts/bench_e2e.py's session18 variant). The timed kernel was a probe's, not kept;
# this one, compiled for sm_90 on a CPU machine (`triton.compile`, triton 3.9; `cuobjdump --dump-resource-usage`),
# holds 255 registers and 1,368 B of stack a thread at 2 × 4 (77 registers, no stack at 1 × 16), so its own time
# is still to be taken: scripts/bench_fp8.py's fp8-quant rows time both launches on CUDA.
LAUNCH: tuple[int, int] | None = (2, 4)
LAUNCH_BLOCK_C = 8192


@triton.jit
def _modulate_kernel(
    x_ptr,  # [S, C] strides (stride_x_s, 1)
    w_ptr,  # [C] RMSNorm weight; unused unless HAS_WEIGHT
    shift_ptr,  # [R, C] strides (stride_shift_r, 1)
    scale_ptr,  # [R, C] strides (stride_scale_r, 1)
    row_index_ptr,  # [S] int32/int64
    out_ptr,  # [S, C] strides (stride_out_s, 1): x's dtype, or the uint8 view of float8_e4m3fn data if FP8
    row_scale_ptr,  # [S, 1] fp32 contiguous per-row scale; unused unless FP8
    stride_x_s,
    stride_shift_r,
    stride_scale_r,
    stride_out_s,
    S,
    C,
    eps,
    HAS_WEIGHT: tl.constexpr,
    FP8: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = rows < S  # the last program's rows past S (S % ROWS != 0) load nothing and store nothing
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    mask = row_ok[:, None] & col_ok[None, :]  # [ROWS, BLOCK_C]
    r = tl.load(row_index_ptr + rows, mask=row_ok, other=0).to(tl.int64)

    x = tl.load(x_ptr + rows[:, None] * stride_x_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)  # [ROWS]; masked lanes are 0: each sum covers C channels
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    scale = tl.load(scale_ptr + r[:, None] * stride_scale_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(shift_ptr + r[:, None] * stride_shift_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = y * (1.0 + scale) + shift  # masked lanes stay 0, so they do not move a row's abs-max
    if FP8:
        q_scale = row_scale(y, 1)  # [ROWS]
        codes = quantize_codes(y, q_scale[:, None], HW_CVT)
        tl.store(out_ptr + rows[:, None] * stride_out_s + cols[None, :], codes, mask=mask)
        tl.store(row_scale_ptr + rows, q_scale, mask=row_ok)
    else:
        tl.store(out_ptr + rows[:, None] * stride_out_s + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_settings(C: int, fp8: bool, launch: tuple[int, int] | None = None) -> tuple[int, int, int]:
    """(BLOCK_C, rows a program, num_warps) of a launch over rows of C channels.

    Args:
        C: channels (<= 65536). fp8: whether the launch writes e4m3 codes (`LAUNCH` applies to that output only).
        launch: explicit (rows, warps), both powers of two; None = `LAUNCH` where it applies, else one row a program
            with `calculate_settings(C)` warps.

    Raises:
        ValueError: C is too wide, or `launch` is not two powers of two.
    """
    block_c, num_warps = calculate_settings(C)
    if launch is None:
        launch = LAUNCH if fp8 and LAUNCH is not None and block_c == LAUNCH_BLOCK_C else (1, num_warps)
    rows, warps = launch
    if any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in (rows, warps)):
        raise ValueError(f"launch must be (rows, warps), both powers of two, got {launch!r}")
    return block_c, rows, warps


def modulate_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Modulate every row. Arguments as in `kernels.modulate.modulate`, already validated.

    Args:
        x: [S, C]; norm_weight: [C] or None; shift, scale: [R, C]; row_index: [S] int; eps: float.
        out: optional [S, C] output (unit stride over C), may alias x (each program reads its rows before writing
            them, and no program touches another's rows).
        launch: (rows a program, warps), powers of two; None = `launch_settings`'s default.

    Returns:
        [S, C] in x's dtype.
    """
    S, C = x.shape
    if out is None:
        out = torch.empty((S, C), dtype=x.dtype, device=x.device)
    _launch(x, norm_weight, shift, scale, row_index, eps, out, None, launch)
    return out


def modulate_fp8_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    row_index: torch.Tensor,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Modulate and quantize each row to e4m3 in the same program. Arguments as in `kernels.modulate.modulate`.

    Args:
        x: [S, C] with C <= 65536 (released hidden 5376); norm_weight: [C] or None; shift, scale: [R, C];
        row_index: [S] int; eps: float.
        out: optional (data [S, C] float8_e4m3fn, scale [S, 1] float32) to write into.
        launch: (rows a program, warps), powers of two; None = `launch_settings`'s default (`LAUNCH` at C = 5,376).

    Returns:
        (data [S, C] float8_e4m3fn, scale [S, 1] float32): `kernels.fp8` semantics applied to each row's fp32
        result, as `modulate_naive(..., fp8=True)`.
    """
    S, C = x.shape
    data, q_scale = fp8_rows_out(out, S, C, x.device)
    _launch(x, norm_weight, shift, scale, row_index, eps, data, q_scale, launch)
    return data, q_scale


def _launch(x, norm_weight, shift, scale, row_index, eps, out, q_scale, launch) -> None:
    """cdiv(S, rows) programs into `out` [S, C]: x's dtype when `q_scale` is None, else e4m3 data with its [S, 1]
    row scales in `q_scale`."""
    S, C = x.shape
    if S == 0:
        return
    fp8 = q_scale is not None
    block_c, rows, num_warps = launch_settings(C, fp8, launch)
    has_weight = norm_weight is not None
    _modulate_kernel[(triton.cdiv(S, rows),)](
        x, norm_weight if has_weight else x, shift, scale, row_index, out.view(torch.uint8) if fp8 else out,
        q_scale if fp8 else x,
        x.stride(0), shift.stride(0), scale.stride(0), out.stride(0),
        S, C, eps,
        HAS_WEIGHT=has_weight, FP8=fp8, ROWS=rows, BLOCK_C=block_c, HW_CVT=fp8 and not interpreting(),
        num_warps=num_warps,
    )
