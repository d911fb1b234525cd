"""The video VAE decoder's q/k RMSNorm + RoPE on the fused `kernels.qk_norm_rope` kernel (batched [B, S, H, D] views,
no norm weight, one cos/sin table for the B tiles), against the torch code it replaces on the GPU.

The kernel does fp32 math and rounds once; the torch code (`video_vae.norm_rope_qk(use_triton=False)`, still the CPU
path) rounds to bf16 after the norm and runs RoPE in bf16. Kernel cases run under TRITON_INTERPRET=1 on CPU tensors;
the `compiled_cuda` cases run the compiled kernel (and a `fullgraph=True` compiled ViTAttention) on a GPU.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch

from h3render.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_naive
from h3render.kernels.qk_norm_rope.triton_impl import qk_norm_rope_op, qk_norm_rope_triton
from h3render.models.video_vae import VideoVAE, ViTAttention, norm_rope_qk, rope_angles
from h3render.models.video_vae_config import VIDEO_VAE_TINY
from tests._markers import compiled_cuda, interpreted
from tests._numerics import randomize_vae_, rel_err

EPS = 1e-5
# Kernel vs its reference: the same fp32 math rounded once, so at most one ulp apart (bf16: 2**-8 relative).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# Kernel vs the decoder's torch code, as a norm ratio: bf16 rounds 3-4 times there (norm, each RoPE product, the
# sum), a few ulps at worst; measured ~3e-3. A wrong rotation or table row is O(1).
BF16_REL = 1e-2
# S = N latent tokens + 4 register tokens + 1 zero token; the token grids (frames, height, width) of the cases.
GRIDS = {7: (1, 1, 2), 37: (2, 4, 4), 45: (1, 5, 8)}
# Decoder-layout cases (B, S, H, D, R, layout): released head dim 64 with R = 48, the tiny VAE's 16 with R = 12,
# and 32 with 24; "fused" q/k are views of the fused qkv GEMM's [B, S, 3, H, D] output, "separate" contiguous.
CASES = [
    (1, 7, 2, 64, 48, "fused"),
    (3, 37, 3, 64, 48, "fused"),
    (3, 7, 3, 16, 12, "separate"),
    (1, 37, 2, 16, 12, "fused"),
    (3, 37, 2, 32, 24, "separate"),
]


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def decoder_inputs(B, S, H, D, R, layout, dtype, seed, device="cpu"):
    """q, k (v) [B, S, H, D] as the decoder's attention sees them, and its cos/sin [S, R] float32."""
    g = torch.Generator().manual_seed(seed)
    if layout == "fused":  # to_qkv(x).view(B, S, 3, H, D).unbind(2): strided views, row stride 3 * H * D
        q, k, v = torch.randn(B, S, 3 * H * D, generator=g).mul_(2).to(dtype).to(device).view(B, S, 3, H, D).unbind(2)
    else:  # to_q(x).view(B, S, H, D) etc.: contiguous
        q, k, v = torch.randn(3, B, S, H, D, generator=g).mul_(2).to(dtype).to(device).unbind(0)
    exponents = torch.arange(0, 1, 6 / R, dtype=torch.float32)
    inv_freq = 1.0 / VIDEO_VAE_TINY.decoder_rope_theta**exponents  # R / 6 frequencies per axis, theta 100
    angles = rope_angles(*GRIDS[S], 5, inv_freq.to(device))
    assert angles.shape == (S, R)
    return q, k, v, angles.cos(), angles.sin()


def fp32_truth(q, k, cos, sin):
    """The decoder's math in fp32 from the same bf16 inputs (what both bf16 paths approximate)."""
    return norm_rope_qk(q.float(), k.float(), cos, sin, EPS, use_triton=False)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,H,D,R,layout", CASES)
def test_kernel_matches_reference_at_decoder_layout(B, S, H, D, R, layout, dtype):
    q, k, _, cos, sin = decoder_inputs(B, S, H, D, R, layout, dtype, seed=B * 100 + S + H + D)
    out = tuple(poisoned((B, S, H, D), dtype) for _ in range(2)) + (None,)
    got_q, got_k, got_v = qk_norm_rope_triton(q, k, None, None, None, cos, sin, EPS, out=out)
    assert got_v is None and got_q.data_ptr() == out[0].data_ptr()
    ref_q, ref_k, _ = qk_norm_rope_naive(q, k, None, None, None, cos, sin, EPS)
    for name, a, b in (("q", got_q, ref_q), ("k", got_k, ref_k)):
        assert a.shape == (B, S, H, D) and a.is_contiguous() and a.dtype == dtype, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=f"{name} vs reference")
    # ... and against the decoder's torch code (the CPU path), which rounds more often in bf16.
    torch_q, torch_k = norm_rope_qk(q, k, cos, sin, EPS, use_triton=False)
    truth_q, truth_k = fp32_truth(q, k, cos, sin)
    for name, a, ref, b, t in (("q", got_q, ref_q, torch_q, truth_q), ("k", got_k, ref_k, torch_k, truth_k)):
        err = rel_err(a, b)
        if dtype == torch.float32:
            assert err <= 1e-6, (name, err)
        else:
            # One rounding instead of several: the kernel's result (the reference's: the interpreter truncates to
            # bf16 where the GPU rounds to nearest, so the kernel itself is compared in the CUDA test) is nearer the
            # fp32 result than the torch code's.
            assert err <= BF16_REL and rel_err(ref, t) < rel_err(b, t), (name, err, rel_err(ref, t), rel_err(b, t))


@interpreted
def test_items_share_one_table_and_weight_is_optional():
    """Packed row b * S + s reads cos/sin row s: a batch equals its items run one by one, bit for bit; no weight
    equals a weight of ones, bit for bit (y * 1 is exact)."""
    B, S, H, D, R = 3, 37, 2, 32, 24
    q, k, _, cos, sin = decoder_inputs(B, S, H, D, R, "fused", torch.bfloat16, seed=5)
    batch = qk_norm_rope_triton(q, k, None, None, None, cos, sin, EPS)
    for b in range(B):
        one = qk_norm_rope_triton(q[b : b + 1], k[b : b + 1], None, None, None, cos, sin, EPS)
        assert torch.equal(batch[0][b : b + 1], one[0]) and torch.equal(batch[1][b : b + 1], one[1]), b
    ones = torch.ones(D, dtype=torch.bfloat16)
    weighted = qk_norm_rope_triton(q, k, None, ones, ones, cos, sin, EPS)
    assert torch.equal(batch[0], weighted[0]) and torch.equal(batch[1], weighted[1])
    # v rides along as a contiguous copy in the 4-D form too.
    v = q.transpose(0, 1).contiguous().transpose(0, 1)  # batch stride smaller than row stride
    *_, got_v = qk_norm_rope_triton(q, k, v, None, None, cos, sin, EPS)
    assert torch.equal(got_v, v) and got_v.is_contiguous()


@interpreted
def test_op_equals_launcher_and_dispatch(monkeypatch):
    """The `h3render::qk_norm_rope` op (what compiled blocks run) launches the same kernel: bit-equal results."""
    q, k, _, cos, sin = decoder_inputs(3, 7, 3, 16, 12, "fused", torch.bfloat16, seed=9)
    want = qk_norm_rope_triton(q, k, None, None, None, cos, sin, EPS)
    got = qk_norm_rope_op(q, k, None, None, cos, sin, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    mod = importlib.import_module("h3render.kernels.qk_norm_rope")  # the package re-exports a function of the same name
    monkeypatch.setattr(mod, "qk_norm_rope_naive", lambda *a: pytest.fail("naive path taken"))
    got = qk_norm_rope(q, k, None, None, None, cos, sin, EPS, use_triton=True)
    assert torch.equal(got[0], want[0]) and got[2] is None


@interpreted
def test_compiling_runs_the_op(monkeypatch):
    """While torch.compile traces, the Triton path is the `h3render::qk_norm_rope` op (which Inductor launches whole;
    traced for real in the CUDA test: under TRITON_INTERPRET=1 `wrap_triton` hands back the interpreted kernel,
    which cannot run on Dynamo's fake tensors); v comes back contiguous, and `out=` is filled."""
    triton_impl = importlib.import_module("h3render.kernels.qk_norm_rope.triton_impl")
    q, k, v, cos, sin = decoder_inputs(3, 7, 2, 16, 12, "fused", torch.bfloat16, seed=4)
    want = qk_norm_rope_triton(q, k, v, None, None, cos, sin, EPS)
    calls = []

    def op(*args):
        calls.append(args)
        return qk_norm_rope_op(*args)

    monkeypatch.setattr(triton_impl, "qk_norm_rope_op", op)
    monkeypatch.setattr(triton_impl, "qk_norm_rope_triton", lambda *a, **kw: pytest.fail("launcher ran"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = qk_norm_rope(q, k, v, None, None, cos, sin, EPS, use_triton=True)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(got, want)) and got[2].is_contiguous()
    out = tuple(poisoned((3, 7, 2, 16), torch.bfloat16) for _ in range(3))
    got = qk_norm_rope(q, k, v, None, None, cos, sin, EPS, out=out, use_triton=True)
    assert len(calls) == 2 and got is out and all(torch.equal(a, b) for a, b in zip(out, want))


def test_rejects_bad_decoder_input():
    q, k, _, cos, sin = decoder_inputs(2, 7, 2, 16, 12, "fused", torch.float32, seed=0)
    with pytest.raises(ValueError, match="both be given or both be None"):
        qk_norm_rope(q, k, None, torch.ones(16), None, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must both be \[S=7"):
        qk_norm_rope(q, k, None, None, None, cos.repeat(2, 1), sin.repeat(2, 1))  # B copies of the table
    with pytest.raises(ValueError, match="q must be"):
        qk_norm_rope(q[None], k[None], None, None, None, cos, sin)


def attention_module(H, D, dtype, fused, seed=0) -> ViTAttention:
    torch.manual_seed(seed)
    attn = ViTAttention(H * D, H, D, EPS).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) / (p.shape[-1] ** 0.5 if p.ndim > 1 else 3))
    if fused:
        attn.fuse_qkv_()
    return attn.to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,S,H,D,fused", [(3, 37, 2, 16, True), (1, 7, 3, 64, True), (3, 7, 2, 16, False)])
def test_attention_with_kernel_matches_torch_path(B, S, H, D, fused, dtype, monkeypatch):
    """ViTAttention with the kernel forced (what CUDA runs) vs its torch code (what the CPU runs): equal up to bf16
    rounding, and the torch path is not taken when the kernel is."""
    import h3render.models.video_vae as video_vae

    attn = attention_module(H, D, dtype, fused)
    x = torch.randn(B, S, H * D, generator=torch.Generator().manual_seed(S)).to(dtype)
    R = int(D * VIDEO_VAE_TINY.decoder_rope_dim_ratio)
    _, _, _, cos, sin = decoder_inputs(B, S, H, D, R, "fused", dtype, seed=1)
    with torch.no_grad():
        want = attn(x, cos, sin)  # CPU default: the torch code
        monkeypatch.setattr(video_vae, "apply_rope", lambda *a: pytest.fail("torch RoPE ran"))
        monkeypatch.setattr(ViTAttention, "use_triton", True)
        got = attn(x, cos, sin)
    assert got.shape == want.shape == (B, S, H * D) and got.dtype == dtype
    err = rel_err(got, want)
    print(f"ViTAttention kernel vs torch ({dtype}): rel err {err:.2e}")
    assert err <= (1e-6 if dtype == torch.float32 else BF16_REL)


def test_cpu_default_is_the_torch_code(monkeypatch):
    """On CPU tensors the decoder keeps its torch code (results unchanged): the kernel entry is never called and
    the output equals the pre-kernel formulation written out, bit for bit."""
    import torch.nn.functional as F

    import h3render.models.video_vae as video_vae

    attn = attention_module(2, 16, torch.bfloat16, fused=True)
    x = torch.randn(3, 37, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    _, _, _, cos, sin = decoder_inputs(3, 37, 2, 16, 12, "fused", torch.bfloat16, seed=1)
    with torch.no_grad():
        q, k, v = attn.to_qkv(x).view(3, 37, 3, 2, 16).unbind(2)
        q = F.rms_norm(q.float(), (16,), eps=EPS).to(v.dtype)
        k = F.rms_norm(k.float(), (16,), eps=EPS).to(v.dtype)
        c, s = cos.to(v.dtype)[:, None], sin.to(v.dtype)[:, None]
        q, k = video_vae.apply_rope(q, c, s), video_vae.apply_rope(k, c, s)
        out = video_vae.sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        want = attn.to_out[0](out.transpose(1, 2).reshape(3, 37, -1))
        monkeypatch.setattr(video_vae, "qk_norm_rope", lambda *a, **kw: pytest.fail("kernel ran on CPU"))
        assert torch.equal(attn(x, cos, sin), want)


@interpreted
def test_decode_with_kernel_stays_at_parity():
    """A whole tiny decode with the kernel forced: fp32 equals the torch-path decode at the diffusers parity tests'
    1e-5; bf16 block linears stay within their 5e-2 of the fp32 decode (tests/parity/test_video_vae.py)."""
    torch.manual_seed(0)
    vae = VideoVAE(dataclasses.replace(VIDEO_VAE_TINY)).eval()
    randomize_vae_(vae)  # random O(1) weights with non-zero gains, as the parity tests make them
    vae.fuse_qkv_()
    low = copy.deepcopy(vae).apply_precision_(torch.bfloat16)
    latent = torch.randn(24, 7, 2, 3, generator=torch.Generator().manual_seed(1))
    fp32_torch, bf16_torch = vae.decode(latent), low.decode(latent)
    ViTAttention.use_triton = True
    try:
        fp32_kernel, bf16_kernel = vae.decode(latent), low.decode(latent)
    finally:
        ViTAttention.use_triton = None
    err32, err_k, err_t = rel_err(fp32_kernel, fp32_torch), rel_err(bf16_kernel, fp32_torch), rel_err(bf16_torch,
                                                                                                        fp32_torch)
    print(f"decode rel err: fp32 kernel vs torch {err32:.2e}; bf16 vs fp32: kernel {err_k:.2e}, torch {err_t:.2e}")
    assert err32 <= 1e-5 and 0 < err_k < 5e-2


# ---------------------------------------------------------------- compiled, on CUDA (GPU machine, TRITON_INTERPRET=0)


@compiled_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_matches_reference(dtype):
    for B, S, H, D, R, layout in CASES:
        q, k, _, cos, sin = decoder_inputs(B, S, H, D, R, layout, dtype, seed=B + S, device="cuda")
        out = tuple(poisoned((B, S, H, D), dtype, "cuda") for _ in range(2)) + (None,)
        got = qk_norm_rope_triton(q, k, None, None, None, cos, sin, EPS, out=out)
        ref = qk_norm_rope_naive(q, k, None, None, None, cos, sin, EPS)
        for a, b in zip(got[:2], ref[:2]):
            torch.testing.assert_close(a, b, **TOL[dtype])
        torch_q, _ = norm_rope_qk(q, k, cos, sin, EPS, use_triton=False)
        truth_q, _ = fp32_truth(q, k, cos, sin)
        if dtype == torch.float32:
            assert rel_err(got[0], torch_q) <= 1e-6
        else:  # rounded once (to nearest on the GPU): nearer the fp32 result than the torch code's bf16 steps
            assert rel_err(got[0], torch_q) <= BF16_REL and rel_err(got[0], truth_q) < rel_err(torch_q, truth_q)


@compiled_cuda
def test_compiled_attention_launches_the_kernel_on_cuda():
    """A `fullgraph=True` compiled ViTAttention (the Engine compiles the decoder blocks) holds the fused kernel in
    Inductor's generated code and matches the eager torch-path module up to bf16 rounding."""
    from torch._inductor.utils import run_and_get_code

    attn = attention_module(3, 64, torch.bfloat16, fused=True).cuda()
    x = torch.randn(3, 37, 3 * 64, device="cuda").bfloat16()
    _, _, _, cos, sin = decoder_inputs(3, 37, 3, 64, 48, "fused", torch.bfloat16, seed=1, device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        eager_kernel = attn(x, cos, sin)
        attn.use_triton = False
        eager_torch = attn(x, cos, sin)
        del attn.use_triton  # back to the class default: the kernel on CUDA
        compiled, code = run_and_get_code(torch.compile(attn, dynamic=False, fullgraph=True), x, cos, sin)
    assert "_qk_norm_rope_kernel" in "\n".join(code)
    # Same kernel on both sides; Inductor's own GEMM epilogues and SDPA may round differently (a wrong launch is O(1)).
    assert rel_err(compiled, eager_kernel) <= BF16_REL and rel_err(compiled, eager_torch) <= BF16_REL
