"""Anti-aliased SnakeBeta kernels (`kernels.alias_free`) vs their torch reference, under TRITON_INTERPRET=1 on CPU and
for real where CUDA is present; and the audio VAE decode with them vs its torch path and diffusers."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch

from h3render.models.audio_vae import AudioVAE, kaiser_sinc_filter
from h3render.models.audio_vae_config import AUDIO_VAE_TINY
from h3render.kernels.alias_free import alias_free_activation, lowpass_downsample, upsample_snake
from tests._numerics import rel_err

# CPU tensors reach the Triton code only through the interpreter (conftest.py turns it on unless TRITON_INTERPRET=0,
# which a GPU run sets so that the CUDA cases compile the real kernels).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                        reason="needs TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def inputs(b, c, length, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(b, c, length, generator=g)
    alpha = torch.exp(0.5 * torch.randn(c, generator=g))
    inv_beta = 1 / (torch.exp(0.5 * torch.randn(c, generator=g)) + 1e-9)
    up = kaiser_sinc_filter(0.25, 0.3, 12).view(12)
    down = (kaiser_sinc_filter(0.25, 0.3, 12).view(12) * (1 + 0.1 * torch.randn(12, generator=g)))
    return [t.to(device) for t in (x, up, alpha, inv_beta, down)]


# lengths: a single sample (every tap clamped), shorter than the filters, block edges (1024 programs), odd sizes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, c, length", [(1, 1, 1), (2, 3, 4), (2, 5, 1023), (1, 2, 1025), (2, 8, 3001)])
def test_kernels_match_reference(device, b, c, length):
    x, up, alpha, inv_beta, down = inputs(b, c, length, device, seed=length)
    a = upsample_snake(x, up, alpha, inv_beta, use_triton=True)
    a_ref = upsample_snake(x, up, alpha, inv_beta, use_triton=False)
    assert a.shape == a_ref.shape == (b, c, 2 * length)
    assert torch.allclose(a, a_ref, atol=1e-5, rtol=1e-5), (a - a_ref).abs().max()
    for n in (2 * length, 2 * length + 1):  # the decoder always halves an even length; odd lengths round up
        sig = torch.randn(b, c, n, generator=torch.Generator().manual_seed(n)).to(device)
        y, y_ref = lowpass_downsample(sig, down, use_triton=True), lowpass_downsample(sig, down, use_triton=False)
        assert y.shape == y_ref.shape == (b, c, (n + 1) // 2)
        assert torch.allclose(y, y_ref, atol=1e-6, rtol=1e-5), (y - y_ref).abs().max()
    full = alias_free_activation(x, up, alpha, inv_beta, down, use_triton=True)
    assert rel_err(full, alias_free_activation(x, up, alpha, inv_beta, down, use_triton=False)) < 1e-6


def test_kernels_refuse_bad_arguments():
    x, up, alpha, inv_beta, down = inputs(1, 2, 8, "cpu")
    with pytest.raises(ValueError, match="float32"):
        upsample_snake(x.double(), up, alpha, inv_beta)
    with pytest.raises(ValueError, match="up_filter"):
        upsample_snake(x, up[:11], alpha, inv_beta)
    with pytest.raises(ValueError, match="alpha"):
        upsample_snake(x, up, alpha[:1], inv_beta)
    with pytest.raises(ValueError, match="down_filter"):
        lowpass_downsample(x, down.view(1, 12))


@pytest.mark.parametrize("device", DEVICES)
def test_decode_with_fused_activations_matches_torch_path_and_diffusers(device):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    cfg = dataclasses.replace(AUDIO_VAE_TINY, latents_mean=tuple((0.1 * torch.randn(32)).tolist()),
                              latents_std=tuple((0.5 + torch.rand(32)).tolist()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref = diffusers.AutoencoderKLMiniMaxH3Audio(**dataclasses.asdict(cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    vae = AudioVAE(cfg).eval()
    vae.load_state_dict(ref.state_dict(), strict=True)
    ref, vae = ref.to(device), vae.to(device)
    z = torch.randn(1, 32, 5, generator=torch.Generator().manual_seed(1)).to(device)
    torch_path = vae.set_fused_activations(False).decode(z)
    fused = vae.set_fused_activations(True).decode(z)
    mean = torch.tensor(cfg.latents_mean, device=device).view(1, -1, 1)
    std = torch.tensor(cfg.latents_std, device=device).view(1, -1, 1)
    with torch.no_grad():
        expected = ref.decode(z * std + mean).sample[:, 0]
    print(f"fused vs torch path {rel_err(fused, torch_path):.2e}, vs diffusers {rel_err(fused, expected):.2e}")
    assert rel_err(fused, torch_path) < 1e-5
    assert rel_err(fused, expected) < 1e-5
    if device == "cpu":  # numpy's sine and the kernels' sum order round differently: proof the kernels ran
        assert not torch.equal(fused, torch_path)
