"""Video VAE: parity with diffusers 0.42.1 `AutoencoderKLMiniMaxH3` on tiny random fp32 weights, plus the planner."""

import copy
import dataclasses
import inspect
import random

import pytest
import torch

from h3render.models.vae_tiling import TilingConfig, split_axis
from h3render.models.video_vae import PIXEL_MEAN, PIXEL_STD, VideoVAE
from h3render.models.video_vae_config import VIDEO_VAE_TINY, VideoVAEConfig
from h3render.spec import SPATIAL_COMPRESSION
from tests._numerics import assert_close, randomize_vae_, rel_err

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLMiniMaxH3  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition  # noqa: E402

# 96 px tiles / 32 px overlap on a 128 x 160 canvas: 2 x 2 tiles with different row (64) and column (32) overlaps.
TILING = TilingConfig(tile_height=96, tile_width=96, overlap_height=32, overlap_width=32)
TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        VIDEO_VAE_TINY,
        latents_mean=tuple((0.1 * torch.randn(24)).tolist()),
        latents_std=tuple((0.5 + torch.rand(24)).tolist()),
    )
    ref = AutoencoderKLMiniMaxH3(**dataclasses.asdict(cfg)).eval()
    # Released init has zero residual gains (identity blocks); randomize everything so every path matters.
    randomize_vae_(ref)
    ref.enable_tiling(TILING.tile_height, TILING.tile_width, TILING.overlap_height, TILING.overlap_width)
    ours = VideoVAE(cfg, TILING).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


def ref_decode(ref, cfg, latent):
    """The diffusers pipeline's decode step: de-normalize, decode, ImageNet -> RGB, clamp."""
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = ref.decode(latent[None] * std + mean).sample.float()
    video = video * torch.tensor(PIXEL_STD).view(1, 3, 1, 1, 1) + torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1, 1)
    return video.clamp(0, 1)[0]


@pytest.fixture(scope="module")
def decoded(models):
    cfg, ref, ours = models
    latent = torch.randn(24, 12, 8, 10, generator=torch.Generator().manual_seed(1))  # 5n+2, n=2 -> 39 frames
    return latent, ref_decode(ref, cfg, latent), ours.decode(latent, batch_size=3)


def test_state_dict_names_equal_diffusers(models):
    _, ref, ours = models
    assert set(ours.state_dict()) == set(ref.state_dict())


def test_config_fields_equal_diffusers_init():
    params = inspect.signature(AutoencoderKLMiniMaxH3.__init__).parameters
    fields = {f.name: f.default for f in dataclasses.fields(VideoVAEConfig)}
    assert set(fields) == set(params) - {"self"}
    for name, default in fields.items():
        assert default == params[name].default, name
    # the packing and the engine size latents by spec's ratio: the released architecture must give the same
    assert VideoVAEConfig().spatial_ratio == SPATIAL_COMPRESSION == 16


def test_from_dict_roundtrip_and_unknown_key():
    data = {"_class_name": "AutoencoderKLMiniMaxH3", "_diffusers_version": "0.42.1"}
    data.update({k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(VIDEO_VAE_TINY).items()})
    assert VideoVAEConfig.from_dict(data) == VIDEO_VAE_TINY
    with pytest.raises(ValueError, match="tile_size"):
        VideoVAEConfig.from_dict({**data, "tile_size": 256})


def test_decode_matches_diffusers_two_windows_2x2_tiles(models, decoded):
    _, _, ours = models
    latent, ref, video = decoded
    plan = ours.plan_decode(*latent.shape[1:])
    assert plan.num_windows == 2 and len(plan.rows.starts) == 2 and len(plan.cols.starts) == 2
    assert plan.rows.overlaps == (64,) and plan.cols.overlaps == (32,)
    assert video.shape == ref.shape == (3, 39, 128, 160)
    clamped = ((ref == 0) | (ref == 1)).float().mean().item()
    assert clamped < 0.2, f"test weights saturate the output ({clamped:.0%} clamped)"
    assert_close(video, ref, TOL, "video decode vs diffusers")


def test_decode_stream_concatenates_to_decode(models, decoded):
    _, _, ours = models
    latent, _, video = decoded
    chunks = list(ours.decode_stream(latent, batch_size=5))  # batches straddle windows
    firsts = [first for first, _ in chunks]
    sizes = [frames.shape[1] for _, frames in chunks]
    assert firsts == [0, 17, 34] and sizes == [17, 17, 5]
    assert_close(torch.cat([frames for _, frames in chunks], dim=1), video, 1e-6, "stream vs decode")


def test_a_padding_decoder_runs_even_batches_and_decodes_the_same(models, decoded, monkeypatch):
    # Compiled blocks pad every short batch: 8 items (2 windows x 4 tiles) at most 5 a forward run as 4 + 4, not 5 + 3
    # padded to 5 (2 idle slots); the frames are the same.
    _, _, ours = models
    latent, _, video = decoded
    seen = []
    forward = ours.decoder.forward
    monkeypatch.setattr(ours.decoder, "forward", lambda z: seen.append(z.shape[0]) or forward(z))
    monkeypatch.setattr(ours, "pad_batches", True, raising=False)
    assert_close(ours.decode(latent, batch_size=5), video, 1e-6, "even padded batches vs decode")
    assert seen == [4, 4]
    # a short batch runs padded to its size; its real items decode as they do alone
    seen.clear()
    items = ours.plan_decode(*latent.shape[1:]).items[:3]
    padded = ours.decode_items(latent, items, batch_size=4)
    assert seen == [4] and len(padded) == 3
    monkeypatch.setattr(ours, "pad_batches", False)
    for got, want in zip(padded, ours.decode_items(latent, items, batch_size=3)):
        assert_close(got, want, 1e-6, "padded batch vs unpadded")
    seen.clear()
    ours.decode(latent, batch_size=5)
    assert seen == [5, 3]  # eager: the plain batches, the last short


def test_blend_of_shuffled_items_equals_decode(models, decoded):
    _, _, ours = models
    latent, _, video = decoded
    plan = ours.plan_decode(*latent.shape[1:])
    items = list(plan.items)
    random.Random(0).shuffle(items)
    outputs = ours.decode_items(latent, items, batch_size=3)
    assert outputs[0].shape == (3, 22, 96, 96)
    blended = ours.blend(plan, {item.index: out for item, out in zip(items, outputs)})
    assert_close(blended, video, 1e-6, "blend(shuffled items) vs decode")


def test_decode_unaligned_latent_count_single_tile(models):
    """T = 10 is not 5n + 2: the reference pads with the last latent and trims; frame count and pixels must match."""
    cfg, ref, ours = models
    latent = torch.randn(24, 10, 4, 4, generator=torch.Generator().manual_seed(2))
    expected = ref_decode(ref, cfg, latent)
    video = ours.decode(latent, batch_size=4)
    assert video.shape == expected.shape
    assert_close(video, expected, TOL, f"T=10 decode: {video.shape[1]} frames")


def test_too_few_latent_frames_rejected(models):
    with pytest.raises(ValueError, match="2 frames; at least 3 are needed"):
        models[2].plan_decode(2, 8, 8)


def test_tile_planner_sweep_terminates_and_covers():
    for length in range(16, 1601, 48):
        for tile in range(32, 513, 32):
            for overlap in range(0, tile, 16):
                axis = split_axis(length, tile, overlap, 16)
                assert axis.starts[0] == 0 and axis.starts[-1] + axis.size == length
                assert all(o >= overlap and o % 16 == 0 for o in axis.overlaps)
                assert all(o < axis.size for o in axis.overlaps)
                if len(axis.starts) > 1:  # fewest tiles: one fewer would not cover
                    n = len(axis.starts) - 1
                    assert tile * n - overlap * (n - 1) < length


def test_tile_planner_rejects_impossible_pairs(models):
    with pytest.raises(ValueError, match="overlap 64 px must be smaller than the tile size 64 px"):
        split_axis(256, 64, 64, 16, name="tile width")
    with pytest.raises(ValueError, match="not a multiple of the 16 px"):
        split_axis(256, 100, 32, 16)
    cfg, _, _ = models
    vae = VideoVAE(cfg, TilingConfig(64, 64, 96, 32))
    with pytest.raises(ValueError, match="tile height: overlap 96 px"):
        vae.plan_decode(12, 8, 8)
    # A tile at least as large as the canvas is one tile, whatever the overlap.
    assert len(vae.plan_decode(12, 4, 4).items) == 2


def test_encoder_matches_diffusers(models):
    cfg, ref, ours = models
    video = torch.rand(3, 22, 64, 96, generator=torch.Generator().manual_seed(3))  # 17 + 5 frames
    mean, logvar = ours.encode_moments(video)
    x = (video[None] - torch.tensor(PIXEL_MEAN).view(1, 3, 1, 1, 1)) / torch.tensor(PIXEL_STD).view(1, 3, 1, 1, 1)
    with torch.no_grad():
        dist = ref.encode(x).latent_dist
    assert mean.shape == (24, 7, 4, 6)
    errs = rel_err(mean, dist.mean[0]), rel_err(logvar, dist.logvar[0])
    print(f"video encoder rel err mean {errs[0]:.2e} logvar {errs[1]:.2e}")
    assert max(errs) <= TOL


def test_keyframe_condition_matches_diffusers(models):
    cfg, ref, ours = models
    pixels = torch.randint(0, 256, (1, 3, 1, 128, 160), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    expected = encode_vae_condition(ref, pixels, PIXEL_MEAN, PIXEL_STD, 42)[0]
    latent = ours.encode_condition(pixels[0].float() / 255.0, seed=42)
    assert latent.shape == expected.shape == (24, 1, 8, 10)
    assert_close(latent, expected, TOL, "keyframe condition")


def test_bf16_precision_split(models, decoded):
    _, _, ours = models
    latent, _, video = decoded
    vae = copy.deepcopy(ours).apply_precision_(torch.bfloat16)
    block = vae.decoder.transformer_blocks[0]
    assert block.attn.to_q.weight.dtype == torch.bfloat16 and block.ff.net[2].weight.dtype == torch.bfloat16
    for p in (block.norm1.weight, block.scale1, vae.decoder.norm_out.weight, vae.post_quant_conv.weight,
              vae.encoder.conv_in.weight, vae.quant_conv.weight):
        assert p.dtype == torch.float32
    low = vae.decode(latent, batch_size=4)
    err = rel_err(low, video)
    print(f"bf16 decode rel err vs fp32: {err:.2e}")
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert 0 < err < 5e-2


def test_fused_qkv_decode_matches_diffusers(models, decoded):
    """The renderer fuses each decoder block's q/k/v into one projection; the decode must not change."""
    cfg, _, ours = models
    latent, expected, _ = decoded
    fused = copy.deepcopy(ours).fuse_qkv_()
    block = fused.decoder.transformer_blocks[0].attn
    assert not hasattr(block, "to_q") and block.to_qkv.weight.shape[0] == 3 * block.to_out[0].in_features
    assert_close(fused.decode(latent, batch_size=3), expected, TOL, "fused-qkv decode vs diffusers")
    # the bf16 precision split still reaches the fused projection
    fused.apply_precision_(torch.bfloat16)
    assert block.to_qkv.weight.dtype == torch.bfloat16 and block.to_out[0].weight.dtype == torch.bfloat16
