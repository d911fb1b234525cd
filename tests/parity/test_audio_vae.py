"""Audio VAE: parity with diffusers 0.42.1 `AutoencoderKLMiniMaxH3Audio` on tiny random fp32 weights."""

import dataclasses
import inspect
import warnings

import pytest
import torch

from h3render.models.audio_vae import AudioVAE
from h3render.models.audio_vae_config import AUDIO_VAE_TINY, AudioVAEConfig
from h3render.spec import AUDIO_HOP
from tests._numerics import assert_close

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLMiniMaxH3Audio  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        AUDIO_VAE_TINY,
        latents_mean=tuple((0.1 * torch.randn(32)).tolist()),
        latents_std=tuple((0.5 + torch.rand(32)).tolist()),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation, inside diffusers
        ref = AutoencoderKLMiniMaxH3Audio(**dataclasses.asdict(cfg)).eval()
    with torch.no_grad():
        for p in ref.parameters():  # move off the init (zero biases, unit gains) so every parameter matters
            p.add_(0.1 * torch.randn_like(p))
    ours = AudioVAE(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


def test_state_dict_names_equal_diffusers(models):
    _, ref, ours = models
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_config_fields_equal_diffusers_init():
    params = inspect.signature(AutoencoderKLMiniMaxH3Audio.__init__).parameters
    fields = {f.name: f.default for f in dataclasses.fields(AudioVAEConfig)}
    assert set(fields) == set(params) - {"self"}
    for name, default in fields.items():
        assert default == params[name].default, name
    assert AudioVAEConfig().hop_length == 800 == AUDIO_HOP  # 32 kHz / 800 = 40 latents/s


def test_from_dict_roundtrip_and_errors():
    data = {"_class_name": "AutoencoderKLMiniMaxH3Audio", "_diffusers_version": "0.42.1"}
    for k, v in dataclasses.asdict(AUDIO_VAE_TINY).items():
        data[k] = [list(d) for d in v] if k == "resblock_dilation_sizes" else list(v) if isinstance(v, tuple) else v
    assert AudioVAEConfig.from_dict(data) == AUDIO_VAE_TINY
    with pytest.raises(ValueError, match="unknown keys \\['hop'\\]"):
        AudioVAEConfig.from_dict({**data, "hop": 800})
    with pytest.raises(ValueError, match="decoder_rates upsample by 400"):
        AudioVAEConfig.from_dict({**data, "decoder_rates": [5, 5, 2, 8], "decoder_kernel_sizes": [9, 9, 4, 16]})


def test_decode_matches_diffusers(models):
    cfg, ref, ours = models
    latent = torch.randn(2, 32, 20, generator=torch.Generator().manual_seed(1))  # stereo, 0.5 s
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1)
    with torch.no_grad():
        expected = ref.decode(latent * std + mean).sample[:, 0]
    wave = ours.decode(latent)
    assert wave.shape == expected.shape == (2, 20 * 800) and wave.dtype == torch.float32
    assert (expected.abs() == 1).float().mean() < 0.2  # not saturated
    assert_close(wave, expected, TOL, "audio decode vs diffusers")
    assert torch.equal(ours.decode(latent, num_samples=15_000), wave[:, :15_000])


def test_encode_matches_diffusers(models):
    cfg, ref, ours = models
    wave = torch.rand(2, 16_123, generator=torch.Generator().manual_seed(2)) * 1.6 - 0.8  # not a whole hop
    with torch.no_grad():
        mode = ref.encode(wave[:, None]).latent_dist.mode()
    expected = (mode - torch.tensor(cfg.latents_mean).view(1, -1, 1)) / torch.tensor(cfg.latents_std).view(1, -1, 1)
    latent = ours.encode(wave)
    assert latent.shape == expected.shape == (2, 32, 21)
    assert_close(latent, expected, TOL, "audio encode vs diffusers")


def test_bad_shapes_rejected(models):
    ours = models[2]
    with pytest.raises(ValueError, match="audio latent must be"):
        ours.decode(torch.zeros(2, 16, 4))
    with pytest.raises(ValueError, match="num_samples 5000 exceeds"):
        ours.decode(torch.zeros(2, 32, 4), num_samples=5000)
    with pytest.raises(ValueError, match="waveform must be"):
        ours.encode(torch.zeros(2, 1, 800))
