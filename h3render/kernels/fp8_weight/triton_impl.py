"""Triton weight-only FP8 GEMM: bf16/fp16 activations x e4m3 weight (per-output-channel fp32 scale), fp32
accumulation, the scale and bias in the epilogue.

The weight tile is read as bytes (one byte per weight: half the bytes of a bf16 GEMM's weight) and decoded in
registers with integer operations, no FP8 instruction: the e4m3 code's low 7 bits shifted left by 7 (and the sign
bit moved to bit 15) are the fp16 bit pattern of `code_value * 2**-8`, exactly, subnormals included (e4m3's
exponent bias 7 against fp16's 15: a power-of-two factor; its 3 mantissa bits fit fp16's 10 and bf16's 7), so the
dot sees the exact codes and the epilogue multiplies by `scale * 256`. Because nothing in it needs FP8 hardware,
the same kernel serves Ampere (sm_80: no e4m3 tensor cores, and Triton refuses e4m3 types below sm_89), Ada and
Hopper, and the CPU interpreter (TRITON_INTERPRET=1: the tests). NaN codes (0x7F / 0xFF) never occur: the weights
are clamped to ±448 when quantized.

One program per (BLOCK_M x BLOCK_N) output tile, grouped along M (GROUP_M) so programs in flight share weight tiles
in L2; the launch settings come from `pick_config` (a table per size of M, measured on an H200: see
docs/performance.md §11). Measured there at 16-77 rows: 0.04-0.26 ms per released text-encoder GEMM, 1.3-3x a
bf16 cuBLAS GEMM of the same shape (it runs at 100-380 TFLOP/s where cuBLAS bf16 runs near 650) and 2-12x faster
than dequantizing with torch first; from 256 rows on, and for the 25600-wide down projection at any row count,
`dequantize_triton` + cuBLAS is faster. A variant computing y^T = w x^T (the decoded weight as the dot's register
operand) was measured and dropped: faster than this kernel at 256 and 2000 rows, slower than dequantize + cuBLAS.

`dequantize_triton` is the other half: one pass writes the bf16 weight bit for bit as the torch expression
(`(code * 2**-8) * (scale * 2**8)`: both factors exact, one fp32 rounding), then cuBLAS multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3render.kernels.utils import interpreting, next_power_of_2

# The decoded fp16 values are the codes times 2**-8: the epilogue multiplies the scale back by 2**8.
DECODE_FACTOR = 256.0


@triton.jit
def _wfp8_kernel(
    x_ptr,  # [M, K] bf16 / fp16, unit stride over K
    w_ptr,  # [N, K] uint8 (the e4m3 codes), row-major
    s_ptr,  # [N] fp32 per-channel scale, times DECODE_FACTOR
    b_ptr,  # [N] bias (HAS_BIAS)
    y_ptr,  # [M, N] out, unit stride over N
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its bf16 dot is wrong, an fp32 dot of the same values is exact
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k + k0) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        code = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.uint16)
        bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
        w = bits.to(tl.float16, bitcast=True).to(x.dtype)  # exact: code value * 2**-8
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr,  # [N, K] uint8 e4m3 codes
    s_ptr,  # [N] fp32 scale times DECODE_FACTOR
    out_ptr,  # [N, K] bf16 / fp16
    N, K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RTNE_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates; round to nearest even by hand
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    where = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    code = tl.load(w_ptr + where, mask=ok, other=0).to(tl.uint16)
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)
    # (code * 2**-8) * (scale * 2**8): both factors exact, one fp32 rounding = fl(code * scale), the reference's
    # `data.float() * scale`; then one rounding to the output dtype, as the reference's `.to(dtype)`.
    w = bits.to(tl.float16, bitcast=True).to(tl.float32) * scale[:, None]
    if RTNE_BF16:  # finite values only (the codes have no NaN): add half an ulp (ties to even), drop the low half
        u = w.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        w = u.to(tl.float32, bitcast=True)
    tl.store(out_ptr + where, w.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_triton(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`(weight.float() * scale.t()).to(dtype)` in one pass (1 byte read, 2 written per weight), bit for bit: weight
    `[N, K]` float8_e4m3fn contiguous, scale `[1, N]` fp32 -> `[N, K]` in `dtype`."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    s = (scale.reshape(-1).float() * DECODE_FACTOR).contiguous()
    block_n, block_k = 16, 256
    _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.view(torch.uint8), s, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        RTNE_BF16=interpreting() and dtype == torch.bfloat16, num_warps=4)
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) by the smallest power of two >= M: the setting with the
# least summed time over a released text-encoder layer's q, k, v, o, gate and up GEMMs, on an H200 (2026-12-02,
# docs/performance.md §11), at 16 rows (buckets up to 32) and at 77 rows (buckets 64 and 128). Above 128 rows
# `models.fp8.Fp8WeightLinear` dequantizes and calls cuBLAS instead (faster there); DEFAULT serves a forced call.
CONFIGS: dict[int, tuple[int, int, int, int, int, int]] = {
    1: (64, 64, 128, 8, 4, 4), 2: (64, 64, 128, 8, 4, 4), 4: (64, 64, 128, 8, 4, 4), 8: (64, 64, 128, 8, 4, 4),
    16: (64, 64, 128, 8, 4, 4), 32: (64, 64, 128, 8, 4, 4), 64: (128, 128, 64, 8, 8, 3), 128: (128, 128, 64, 8, 8, 3),
}
DEFAULT = (128, 128, 64, 8, 8, 3)
# What the benchmark (scripts/bench_prepare.py `te-fp8`) sweeps per linear shape and row count.
CANDIDATES = (
    (64, 64, 128, 8, 4, 4), (64, 128, 128, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
)


def pick_config(m: int) -> tuple[int, int, int, int, int, int]:
    return CONFIGS.get(next_power_of_2(m), DEFAULT)


def fp8_weight_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None, *, config=None,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """x `[M, K]` bf16/fp16 (unit stride over K), weight `[N, K]` float8_e4m3fn contiguous, scale `[1, N]` fp32,
    bias `[N]` or None -> `[M, N]` in x's dtype (into `out` when given: `[M, N]`, unit stride over N).
    `config`: a `CANDIDATES` entry (the benchmark's sweep); default `pick_config(M)`."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    bm, bn, bk, group, warps, stages = config or pick_config(m)
    if interpreting():  # the interpreter runs one program at a time: fewer, larger k steps cost nothing there
        warps, stages = 4, 1
    codes = weight.view(torch.uint8)
    s = (scale.reshape(-1).float() * DECODE_FACTOR).contiguous()
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _wfp8_kernel[grid](
        x, codes, s, bias if bias is not None else s, y, m, n, k, x.stride(0), codes.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        UPCAST=not x.is_cuda and interpreting(), num_warps=warps, num_stages=stages,
    )
    return y
