"""FP8 video VAE decoder (`--precision fp8`, issue 26 item 2): `models.fp8.quantize_video_decoder_fp8_` puts the
decoder's block linears on `Fp8Linear` (row-wise e4m3 activations, per-channel e4m3 weights), leaves the encoder,
norms, proj_in / proj_out and the fp32 residual stream alone, and decodes close to the bf16 decoder it came from.

Tiny model on the CPU (where `Fp8Linear` computes the dequantized operands' fp32 product, rounded once to bf16: the
same quantization error as cuBLASLt's e4m3 GEMM, up to the order of accumulation). Weights are random with non-zero
residual gains (the released init has zero gains, identity blocks), so every quantized GEMM reaches the pixels.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from h3render.kernels.fp8 import quantize_rows_naive
from h3render.models.fp8 import FP8, Fp8Linear, precision_report, quantize_video_decoder_fp8_
from h3render.models.video_vae import FeedForward, SwiGLUIn, VideoVAE, ViTBlock
from h3render.models.video_vae_config import VIDEO_VAE_TINY
from tests._markers import compiled_cuda, interpreted
from tests._numerics import randomize_vae_


def random_vae(seed: int = 0) -> VideoVAE:
    """The tiny VAE with O(1) random weights, as tests/parity/test_video_vae.py makes them (gains 0.3 * N(0, 1))."""
    torch.manual_seed(seed)
    vae = VideoVAE(dataclasses.replace(VIDEO_VAE_TINY)).eval()
    randomize_vae_(vae)
    return vae


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] float in [0, 1] -> uint8 codes (round to nearest)."""
    return video.mul(255).round_().to(torch.uint8)


def psnr_and_max(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """PSNR in dB and max |a - b| of two uint8 videos (the benchmark's measure, scripts/bench_vae_fp8.py)."""
    diff = a.int() - b.int()
    mse = float(diff.double().square().mean())
    return 10 * torch.log10(torch.tensor(255.0**2 / mse)).item(), int(diff.abs().max())


@pytest.fixture(scope="module")
def vaes():
    """(bf16 VAE as the Engine runs it: bf16 block linears, fused q/k/v; its FP8 copy; the linears replaced)."""
    bf16 = random_vae().apply_precision_(torch.bfloat16).fuse_qkv_()
    fp8 = copy.deepcopy(bf16)
    return bf16, fp8, quantize_video_decoder_fp8_(fp8)


def test_fp8_decoder_replaces_exactly_the_block_linears(vaes):
    bf16, fp8, replaced = vaes
    assert replaced == 4 * VIDEO_VAE_TINY.decoder_num_layers  # to_qkv, to_out.0, ff.net.0.proj, ff.net.2 per block
    assert quantize_video_decoder_fp8_(fp8) == 0  # idempotent
    block = fp8.decoder.transformer_blocks[0]
    for lin in (block.attn.to_qkv, block.attn.to_out[0], block.ff.net[0].proj, block.ff.net[2]):
        assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8 and lin.out_dtype == torch.bfloat16
    assert block.attn.dtype == torch.bfloat16  # what the block hands its linears: bf16, not the e4m3 storage
    # untouched: proj_in / proj_out, norms, gains, the encoder and the quant convs (bit-equal to the bf16 VAE)
    assert type(fp8.decoder.proj_in) is nn.Linear and type(fp8.decoder.proj_out) is nn.Linear
    want = bf16.state_dict()
    kept = {k: v for k, v in fp8.state_dict().items() if not k.startswith("decoder.transformer_blocks.")
            or ".norm" in k or ".scale" in k}
    assert len(kept) > 50 and all(torch.equal(v, want[k]) for k, v in kept.items())
    assert block.norm1.weight.dtype == block.scale1.dtype == fp8.encoder.conv_in.weight.dtype == torch.float32
    # the bf16 VAE keeps its nn.Linear blocks (the copy was quantized, not the original)
    assert not any(isinstance(m, Fp8Linear) for m in bf16.modules())
    # the sidecar's precision_components
    report = precision_report(type("C", (), {"video_vae": fp8, "audio_vae": None})())
    # other: the tiny encoder's fp32 and proj_out's bf16 (32 -> 3072) parameters
    assert report["video_vae"] == ("fp8_e4m3 decoder blocks (row-wise activations, per-channel weights; 8 linears); "
                                   "other: bf16 (fp32: 47% of parameters)"), report  # no fast accumulation off CUDA
    if torch.cuda.is_available():  # cuBLASLt's fast accumulation: every decoder FP8 GEMM on the GPU
        report = precision_report(type("C", (), {"video_vae": copy.deepcopy(fp8).cuda()})())
        assert "per-channel weights; 8 linears, fast accumulation in 8); other:" in report["video_vae"], report
    assert precision_report(type("C", (), {"video_vae": bf16})())["video_vae"].startswith("bf16")


def test_fp8_decode_stays_close_to_bf16_decode(vaes):
    """22 frames of 64 x 64 (7 latent frames, one window), compared in uint8 codes. Measured (torch 2.13 CPU,
    seed 0): FP8 vs bf16 PSNR 47.1 dB, max |diff| 8 codes, 55 % of codes differ by at least one; for scale, bf16 vs
    the fp32 decoder is 55.8 dB / 2 codes. Why this size: each e4m3 rounding (3 mantissa bits, ≤ 6.25 % per element,
    ≈ 2-3 % rms per GEMM operand) passes through 2 blocks whose residual gains are 0.3-sized and whose 32 channels
    average little; the bounds below allow twice the squared error (-3 dB) and twice the max."""
    bf16, fp8, _ = vaes
    latent = torch.randn(24, 7, 4, 4, generator=torch.Generator().manual_seed(1))
    want, got = bf16.decode(latent), fp8.decode(latent)
    assert got.shape == want.shape == (3, 22, 64, 64) and got.dtype == torch.float32
    a, b = to_uint8(got), to_uint8(want)
    psnr, worst = psnr_and_max(a, b)
    assert psnr >= 44.0 and 0 < worst <= 16, (psnr, worst)  # measured 47.1 dB, 8


def test_fp8_feed_forward_runs_the_fused_swiglu(vaes, monkeypatch):
    """An FP8 FFN computes fc1's product without its bias, then bias (fp32) + value * silu(gate) + row e4m3 in one
    step (`kernels.swiglu`, value half first), then fc2 on those rows: equal, bit for bit on the CPU, to that
    composition written out, and no longer through `SwiGLUIn` (whose bf16 bias add and product would differ)."""
    ff = vaes[1].decoder.transformer_blocks[0].ff
    fc1, fc2 = ff.net[0].proj, ff.net[2]
    x = torch.randn(2, 37, fc1.in_features, generator=torch.Generator().manual_seed(3)).bfloat16()

    def product(rows, lin, bias=None):  # what `Fp8Linear` computes off CUDA: the fp32 product (+ bias) -> bf16
        data, scale = rows
        out = (data.float() * scale) @ lin.dequantized_weight().t()
        return (out if bias is None else out + bias.bfloat16().float()).bfloat16()

    h = product(quantize_rows_naive(x.reshape(74, -1)), fc1).float() + fc1.bias.float()  # [74, 2F]: [value | gate]
    value, gate = h.chunk(2, dim=-1)
    want = product(quantize_rows_naive(value * torch.nn.functional.silu(gate)), fc2, fc2.bias).view(2, 37, -1)
    monkeypatch.setattr(SwiGLUIn, "forward", lambda *a: pytest.fail("the unfused SwiGLU ran"))
    got = ff(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@compiled_cuda
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm e4m3 needs CUDA compute capability >= 8.9")
def test_fp8_decoder_on_cuda_stays_close_to_bf16():
    """On the GPU the Engine runs FP8 decoder blocks eagerly (`VideoVAE.compile_pays`): the Triton kernels (fused
    residual + norm + e4m3, SwiGLU + e4m3, the attention output's row quantizer) and cuBLASLt's FP8 GEMMs. Their
    frames stay close to the bf16 decoder's (eager here: compiling it changes its frames by rounding only)."""
    bf16 = random_vae().cuda().apply_precision_(torch.bfloat16).fuse_qkv_()
    fp8 = copy.deepcopy(bf16)
    quantize_video_decoder_fp8_(fp8)
    assert bf16.compile_pays and not fp8.compile_pays
    latent = torch.randn(24, 7, 4, 4, generator=torch.Generator().manual_seed(1)).cuda()
    want, got = to_uint8(bf16.decode(latent)), to_uint8(fp8.decode(latent))
    psnr, _ = psnr_and_max(got, want)
    assert psnr >= 44.0, psnr


# ------------------------------------------------------------ fused residual + norm + e4m3 (ViTBlock.fused_norm_fp8)


def decoder_input(batch: int = 2) -> torch.Tensor:
    """[B, 24, 3, 4, 4] post-quant-conv latents: 48 latent tokens + 5 per item."""
    return torch.randn(batch, 24, 3, 4, 4, generator=torch.Generator().manual_seed(8))


def test_fp8_blocks_fuse_the_norms_and_hand_rows_on(vaes, monkeypatch):
    """An FP8 decoder runs `kernels.residual_norm_fp8` at every residual add that feeds an FP8 linear (first block's
    norm1, each block's norm2, each block boundary but the last: 2L calls), its q/k/v and fc1 take those rows (only
    the attention output is quantized by `Fp8Linear`), and on the CPU, where both forms run the torch reference, the
    decode equals the unfused one (`ViTBlock.fused_norm_fp8 = False`) bit for bit. The bf16 decoder never fuses."""
    import h3render.models.fp8 as fp8_module
    import h3render.models.video_vae as video_vae

    bf16, fp8, _ = vaes
    calls, quantized = [], []
    fused = video_vae.residual_norm_fp8
    monkeypatch.setattr(video_vae, "residual_norm_fp8", lambda x, y, *a: calls.append(y is None) or fused(x, y, *a))
    quantize = fp8_module.quantize_rows
    monkeypatch.setattr(fp8_module, "quantize_rows", lambda y, **kw: quantized.append(y.shape) or quantize(y, **kw))
    layers = VIDEO_VAE_TINY.decoder_num_layers
    z = decoder_input()
    with torch.no_grad():
        assert all(block.fuses_norm_fp8 for block in fp8.decoder.transformer_blocks)
        got = fp8.decoder(z)
        assert calls == [True] + [False] * (2 * layers - 1) and len(quantized) == layers
        calls.clear(), quantized.clear()
        monkeypatch.setattr(ViTBlock, "fused_norm_fp8", False)
        assert not any(block.fuses_norm_fp8 for block in fp8.decoder.transformer_blocks)
        want = fp8.decoder(z)
        assert calls == [] and len(quantized) == 3 * layers  # q/k/v, attention output, fc1
        assert torch.equal(got, want)
        monkeypatch.setattr(FeedForward, "fused_fp8", False)  # the unfused SwiGLU reads the fused norm's rows too
        unfused_ff = fp8.decoder(z)
        monkeypatch.setattr(ViTBlock, "fused_norm_fp8", True)
        assert torch.equal(fp8.decoder(z), unfused_ff)
        monkeypatch.undo()
        assert not any(block.fuses_norm_fp8 for block in bf16.decoder.transformer_blocks)
        monkeypatch.setattr(video_vae, "residual_norm_fp8", lambda *a: pytest.fail("a bf16 block fused"))
        bf16.decoder(z)
        with pytest.raises(ValueError, match="fused norm"):
            bf16.decoder.transformer_blocks[0](torch.zeros(1, 5, 32), *torch.zeros(2, 5, 6), None,
                                               bf16.decoder.transformer_blocks[1].norm1.weight, 1e-5)


def test_the_warm_up_compiles_bf16_decoder_blocks_and_leaves_fp8_ones_eager(vaes, monkeypatch):
    """FP8 blocks with the fused kernels decode faster eagerly than compiled (docs/performance.md §35.3), so the
    warm-up compiles only blocks that still run torch's element-wise ops (`VideoVAE.compile_pays`), and records which
    it did (`vae_compile_s` / `vae_warmup_s`). Both warm one decoder batch per canvas; `compile_vae=False` never
    compiles."""
    from types import SimpleNamespace

    from h3render.jobs import Job
    from h3render.settings import RunSettings
    from h3render.warmup import WarmUp

    bf16, fp8, _ = vaes
    assert bf16.compile_pays and not fp8.compile_pays
    with monkeypatch.context() as m:
        m.setattr(ViTBlock, "fused_norm_fp8", False)  # FP8 blocks without the fused kernels: Inductor fuses them
        assert fp8.compile_pays
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # (the warm-up runs on CUDA)
    job = Job(id="a", prompt="p", width=64, height=64, frames=22, seed=0, steps=2, mode="t2va", output="a.mp4")
    for vae, compile_vae, compiles in ((bf16, True, True), (fp8, True, False), (bf16, False, False)):
        compiled, decoded = [], []
        monkeypatch.setattr(vae, "compile_blocks_", lambda **kw: compiled.append(kw), raising=False)
        monkeypatch.setattr(vae, "decode_items", lambda z, items, batch: decoded.append(batch), raising=False)
        owner = SimpleNamespace(c=SimpleNamespace(video_vae=vae), device=torch.device("cpu"), warmup={},
                                settings=RunSettings(attention="sdpa", vae_batch=2, compile_vae=compile_vae),
                                _vae_batches=lambda jobs: {(64, 64, 2)})
        WarmUp._warm_vae(owner, [job])
        assert (len(compiled), decoded) == (int(compiles), [2])
        assert set(owner.warmup) - {"compile_import_wait_s"} == {"vae_compile_s" if compiles else "vae_warmup_s"}
        monkeypatch.undo()
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@interpreted
def test_fp8_decoder_with_the_fused_kernel_matches_unfused(vaes, monkeypatch):
    """The Triton kernel (interpreted) in the decoder against the unfused blocks: its x_new is the reference's bit
    for bit, and its rows differ only where a bf16 rounding of a normed value sits within a few fp32 ulps of a tie
    (tests/unit/test_residual_norm_fp8.py), one e4m3 step of one GEMM input element there. Measured bit-equal here
    (torch 2.13 CPU); the bound allows a few such steps, a missing gain or a wrong weight is O(1)."""
    import functools

    import h3render.models.video_vae as video_vae

    fp8 = vaes[1]
    z = decoder_input()
    with torch.no_grad():
        monkeypatch.setattr(ViTBlock, "fused_norm_fp8", False)
        want = fp8.decoder(z)
        monkeypatch.setattr(ViTBlock, "fused_norm_fp8", True)
        monkeypatch.setattr(video_vae, "residual_norm_fp8",
                            functools.partial(video_vae.residual_norm_fp8, use_triton=True))
        got = fp8.decoder(z)
    assert (got - want).norm() <= 1e-2 * want.norm(), float((got - want).norm() / want.norm())
