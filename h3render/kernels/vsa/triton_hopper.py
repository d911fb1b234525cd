"""The VSA-H3 fine kernel with TMA key/value loads (Hopper, sm_90+): the default of
`fine_attention_triton` on such GPUs (`triton_impl.TMA_BY_DEFAULT`; `tma=False` runs the pointer kernel).

Same contract as `triton_impl._fine_kernel` (one program per (head, 64-row query tile), block-sparse attention over
the kept 64-slot key tiles, the gated coarse add fused in the epilogue, packed rows in and out). The difference: keys
and values are read through tensor descriptors, `TensorDescriptor` over the tile-ordered copies viewed as
`[n * 64, H * D]` with block `[64, D]` at `(tile * 64, h * D)`, so on sm_90 the pipeliner issues bulk tensor copies
completing on mbarriers instead of 128 threads' cp.async addresses. At 1344x768x243, s = 0.9 on an H200
(2026-12-02, docs/performance.md §19): 0.0562-0.0578 s against 0.0595-0.0606 s for the pointer kernel, same inputs.

Measured and dropped (§19): two query tiles per program (128 rows, 8 warps) over the union of their kept sets, 0.094
s on random inputs (the union is 1.9 k) and 0.059 s even when both tiles keep the same set; Triton 3.6's automatic
warp specialization of the key loop (does not compile for this loop: NVGPUWarpSpecialization fails).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3render.kernels.vsa.tiles import TILE, TilePlan
from h3render.kernels.vsa import triton_impl
from h3render.kernels.vsa.triton_impl import (fine_epilogue, fine_prologue, key_scales, key_tile, online_softmax_step,
                                              program_tile)


@triton.jit
def _fine_tma_kernel(
    q_ptr, o_ptr,  # [S, H, D] packed rows (any row/head strides, unit stride over D)
    desc_k, desc_v,  # TensorDescriptor over [n * TILE, H * D] tile-ordered keys / values, block [TILE, D]
    ks_ptr,  # [H, n * TILE] fp32 key row scales (QK_INT8 only: desc_k over int8 codes)
    gate_ptr,  # [S, H, D] (GATE only)
    coarse_ptr,  # [H, n, D] fp32 coarse output per tile (GATE only)
    row_of_slot_ptr,  # [n * TILE] int32, -1 on a pad slot
    sizes_ptr,  # [n] int32 valid rows per tile
    sel_ptr,  # [H, V, topk] int32 absolute key tile ids, ascending (unused when dense_q == n)
    stride_qs, stride_qh, stride_os, stride_oh, stride_gs, stride_gh,
    num_tiles, num_prefix, num_video, dense_q, topk,
    scale_log2,  # log2(e) / sqrt(D)
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    GATE: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots (no TF32)
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, an fp32 dot of the same bf16 values is exact
    QK_INT8: tl.constexpr,  # int8 QK^T (h3render/kernels/vsa/quant.py)
    LONG_FIRST: tl.constexpr,  # triton_impl.program_tile
):
    # Programs run head by head, query tiles fastest: the programs in flight read one head's keys and values, which
    # stay in L2 (see triton_impl._fine_kernel, whose prologue, softmax step and epilogue this kernel shares).
    qt, h = program_tile(num_tiles, dense_q, LONG_FIRST)
    q, q_scale, q_rows, q_valid, m_i, l_i, acc, count, sel_row = fine_prologue(
        q_ptr, row_of_slot_ptr, sel_ptr, stride_qs, stride_qh, qt, h, num_tiles, num_prefix, num_video, dense_q, topk,
        scale_log2, TILE_ROWS, HEAD_DIM, QK_INT8)
    col = h * HEAD_DIM
    for j in range(0, count):
        kv, size = key_tile(j, qt, sel_row, sizes_ptr, dense_q, num_prefix, topk)
        k = desc_k.load([kv * TILE_ROWS, col])  # [TILE, D], one bulk tensor copy
        v = desc_v.load([kv * TILE_ROWS, col])
        k_scale = key_scales(ks_ptr, kv, h, num_tiles, TILE_ROWS, QK_INT8)
        m_i, l_i, acc = online_softmax_step(q, k, v, m_i, l_i, acc, size, q_scale, k_scale, TILE_ROWS, IEEE, UPCAST,
                                            QK_INT8)
    fine_epilogue(acc, l_i, o_ptr, gate_ptr, coarse_ptr, q_rows, q_valid, qt, h, num_tiles, stride_os, stride_oh,
                   stride_gs, stride_gh, HEAD_DIM, GATE)


# (warps, stages, register cap). At 1344x768x243, s = 0.9 on an H200 (2026-12-03, docs/performance.md §24.1) the int8
# kernel takes 188 registers a thread uncapped (2 programs of 128 threads per multiprocessor: 0.0483-0.0508 s); capped
# at 168 three fit, with 2 spilled registers: 0.0443-0.0452 s. A cap of 128 (four programs) spills 12: 0.050 s. The
# bf16 kernel holds 82 KB of shared memory, so two programs a multiprocessor whatever its registers, and the cap
# changes nothing there (0.0554-0.0558 s). Stages: 2 and 3 within 1 %; 1 stage 0.072 s (int8). The autotuner picks
# per shape; the uncapped setting stays for shapes where the cap would spill more.
TMA_CONFIGS = ((4, 2, 168), (4, 3, 168), (4, 3, None))
_fine_tma_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=w, num_stages=st, maxnreg=r) for w, st, r in TMA_CONFIGS],
    key=["num_tiles", "num_prefix", "topk", "dense_q", "QK_INT8", "GATE"],  # see triton_impl._fine_tuned
    cache_results=True,
)(_fine_tma_kernel)


def tma_supported(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the TMA kernel compiled: a CUDA GPU of compute capability 9.0 or newer."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9


def launch_fine_tma(q, out, kt, vt, ks, g, c, plan: TilePlan, sel, dense_q: int, topk: int, *, gate: bool,
                    upcast: bool, launch: dict | None, qk_int8: bool = False, long_first: bool | None = None):
    """Launch the TMA fine kernel; `fine_attention_triton` checks the arguments and builds kt, vt.

    Args:
        q, out, g: `[S, H, D]`; kt, vt: `[n * 64, H, D]` contiguous tile-ordered keys / values (kt int8 codes with
            `qk_int8`, ks `[H, n * 64]` fp32 their row scales; else ks unused); c: `[H, n, D]` fp32
            (or any tensor without a gate); sel: `[H, V, topk]` int32 (any int32 tensor when dense_q == n).
        launch: {"num_warps", "num_stages"} (optionally "maxnreg"), or None: the autotuner's pick among
            `TMA_CONFIGS` for this shape.
        long_first: the dense query tiles of every head first (`triton_impl.program_tile`); None:
            `triton_impl.LONG_FIRST`.
    Returns:
        Triton's launched kernel handle (its `n_regs`, `n_spills`, `metadata.shared`); None when autotuned.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    s, heads, d = q.shape
    # [n * 64, H * D]: a key tile of head h is the [64, D] box at (tile * 64, h * D).
    desc_k = TensorDescriptor.from_tensor(kt.view(kt.shape[0], heads * d), [TILE, d])
    desc_v = TensorDescriptor.from_tensor(vt.view(vt.shape[0], heads * d), [TILE, d])
    kernel = _fine_tma_tuned if launch is None else _fine_tma_kernel
    handle = kernel[(plan.num_tiles * heads,)](
        q, out, desc_k, desc_v, ks, g, c, plan.row_of_slot, plan.sizes, sel,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), g.stride(0), g.stride(1),
        plan.num_tiles, plan.num_prefix, plan.num_video, dense_q, topk,
        1.4426950408889634 / math.sqrt(d),  # log2(e) / sqrt(D): exp(x) = exp2(x * log2(e))
        HEAD_DIM=d, TILE_ROWS=TILE, GATE=gate, IEEE=q.dtype == torch.float32, UPCAST=upcast, QK_INT8=qk_int8,
        LONG_FIRST=triton_impl.LONG_FIRST if long_first is None else long_first, **(launch or {}),
    )
    return None if launch is None else handle
