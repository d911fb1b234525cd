"""Peers' kernels beside ours at the released shapes (issue 26, `--stages peers`).

* VSA fine attention at 1344x768x243 (S = 73,686, 1,206 tiles), s = --vsa-sparsity: FastVideo-kernel 0.3.5's Triton
  kernel and, when its sm_90 extension loads, its ThunderKittens kernel, on the same q/k/v and the same kept sets as
  ours (our fine kernel without the gate, bf16 and int8 QK^T). Peers get their inputs already in tile order; ours
  includes its key/value gather (timed alone beside it).
* The video VAE decoder's attention, [8, 1797, 32, 64] (one decode batch): SDPA, cuDNN and FlashAttention-3 in bf16,
  and FA3 in FP8 e4m3 (q and k with a static scale: after the per-head RMS norm and RoPE every |element| <= sqrt(64);
  v per (item, head) amax), each with its error against fp32 attention.

Each peer is optional (`pip install --no-deps fastvideo-kernel==0.3.5 fa3-fwd`): a row says why one did not run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def run(args, bench) -> None:
    _vsa(args, bench)
    _vae_attention(bench)


def _fk_inputs(plan, sel, heads):
    """FastVideo's index form of our kept sets: q2k_idx [1, H, n, n] int32 (prefix query tiles: every tile; video
    query tiles: the P prefix tiles, then their K kept tiles), q2k_num [1, H, n], block sizes [n]."""
    n, p = plan.num_tiles, plan.num_prefix
    k_kept = sel.shape[-1]
    idx = torch.arange(n, dtype=torch.int32, device=sel.device).expand(1, heads, n, n).contiguous()
    idx[0, :, p:, p:p + k_kept] = sel
    num = torch.full((1, heads, n), n, dtype=torch.int32, device=sel.device)
    num[0, :, p:] = p + k_kept
    return idx, num, plan.sizes.to(torch.int32)


@torch.no_grad()
def _vsa(args, bench) -> None:
    from h3render.kernels.vsa.tiles import gather_tiles
    from h3render.kernels.vsa.triton_impl import fine_attention_triton

    case = bench.released_vsa_case(args.vsa_sparsity)
    plan, q, k, v, sel, k_mean, flop = case.plan, case.q, case.k, case.v, case.sel, case.k_mean, case.flop
    heads = q.shape[1]
    ours = fine_attention_triton(q, k, v, plan, sel)
    for int8 in (False, True):
        fn = lambda: fine_attention_triton(q, k, v, plan, sel, qk_int8=int8, k_mean=k_mean)  # noqa: B023, E731
        t = bench.cuda_time(fn, reps=5, warm=2)
        bench.rec(stage="peers", what=f"VSA fine, ours (TMA, {'int8' if int8 else 'bf16'} QK^T, K/V gather included)",
                  seconds=round(t, 4), tflops=round(flop / t / 1e12, 1), rel_diff_vs_ours_bf16=bench.rel_err(fn(), ours))
    bench.rec(stage="peers", what="VSA K + V gather into tile order (inside ours above)",
              seconds=round(2 * bench.cuda_time(lambda: gather_tiles(k, plan), reps=10), 5))

    tiled = [gather_tiles(x, plan).permute(1, 0, 2)[None].contiguous() for x in (q, k, v)]  # [1, H, n * 64, D]
    idx, num, sizes = _fk_inputs(plan, sel, heads)
    untile = lambda o: o[0].permute(1, 0, 2)[plan.slot]  # noqa: E731  [1, H, n*64, D] -> packed [S, H, D]
    peers = []
    try:
        from fastvideo_kernel.triton_kernels.block_sparse_attn_triton import triton_block_sparse_attn_forward

        peers.append(("FastVideo-kernel 0.3.5 Triton (autotuned)", triton_block_sparse_attn_forward))
    except Exception as exc:  # noqa: BLE001  a row says why
        bench.rec(stage="peers", what="FastVideo-kernel Triton", skipped=f"{type(exc).__name__}: {exc}"[:300])
    try:
        from fastvideo_kernel._C import fastvideo_kernel_ops

        peers.append(("FastVideo-kernel 0.3.5 ThunderKittens sm_90a", fastvideo_kernel_ops.block_sparse_fwd))
    except Exception as exc:  # noqa: BLE001
        bench.rec(stage="peers", what="FastVideo-kernel ThunderKittens", skipped=f"{type(exc).__name__}: {exc}"[:300])
    for name, fwd in peers:
        try:
            fn = lambda: fwd(*tiled, idx, num, sizes)[0]  # noqa: B023, E731
            t = bench.cuda_time(fn, reps=5, warm=2)
            bench.rec(stage="peers", what=f"VSA fine, {name} (inputs in tile order)", seconds=round(t, 4),
                      tflops=round(flop / t / 1e12, 1), rel_diff_vs_ours_bf16=bench.rel_err(untile(fn()), ours))
        except Exception as exc:  # noqa: BLE001
            bench.rec(stage="peers", what=f"VSA fine, {name}", failed=f"{type(exc).__name__}: {exc}"[:300])


@torch.no_grad()
def _vae_attention(bench) -> None:
    from h3render.models.attention import available_backends, runner

    b, s, h, d = 8, 1797, 32, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    # As the decoder's: q and k RMS-normed per head (no weight), v a linear's output.
    q, k = (F.rms_norm(torch.randn(b, s, h, d, device="cuda", generator=g), (d,)).bfloat16() for _ in range(2))
    v = torch.randn(b, s, h, d, device="cuda", generator=g).bfloat16()
    ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    flop = 4 * b * h * s * s * d
    for name in available_backends():
        fn = runner(name)
        t = bench.cuda_time(lambda: fn(q, k, v), reps=10, warm=3)  # noqa: B023
        bench.rec(stage="peers", what=f"VAE attention [8, 1797, 32, 64] bf16 ({name})", ms=round(t * 1e3, 3),
                  tflops=round(flop / t / 1e12, 1), rel_err=bench.rel_err(fn(q, k, v), ref))
    try:
        from fa3_fwd_interface import flash_attn_func
    except Exception as exc:  # noqa: BLE001
        bench.rec(stage="peers", what="VAE attention FA3 fp8", skipped=f"{type(exc).__name__}: {exc}"[:300])
        return
    e4m3 = torch.float8_e4m3fn
    qk_scale = math.sqrt(d) / 448.0  # |x| <= sqrt(d) for a unit-RMS row; RoPE keeps each pair's norm

    def quantize():
        v_scale = v.float().abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0  # [B, H]
        v8 = (v.float() / v_scale[:, None, :, None]).to(e4m3)
        q8, k8 = ((x.float() / qk_scale).to(e4m3) for x in (q, k))
        descale = torch.full((b, h), qk_scale, device="cuda")
        return q8, k8, v8, descale, v_scale

    q8, k8, v8, descale, v_scale = quantize()

    def fp8():
        out = flash_attn_func(q8, k8, v8, causal=False, q_descale=descale, k_descale=descale, v_descale=v_scale)
        return out[0] if isinstance(out, tuple) else out

    try:
        t = bench.cuda_time(fp8, reps=10, warm=3)
        tq = bench.cuda_time(quantize, reps=10, warm=2)
        bench.rec(stage="peers", what="VAE attention [8, 1797, 32, 64] FA3 fp8 e4m3 (static q/k scale, v per head)",
                  ms=round(t * 1e3, 3), tflops=round(flop / t / 1e12, 1), quantize_ms_torch_unfused=round(tq * 1e3, 3),
                  rel_err=bench.rel_err(fp8(), ref), out_dtype=str(fp8().dtype))
    except Exception as exc:  # noqa: BLE001
        bench.rec(stage="peers", what="VAE attention FA3 fp8", failed=f"{type(exc).__name__}: {exc}"[:300])
