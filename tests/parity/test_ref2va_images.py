"""ref2va's image path vs diffusers 0.42.1's own blocks on the same tiny random weights and the same pictures:
`MiniMaxH3Ref2VASetupStep` (each image onto its own short edge, LANCZOS; the canvas stays 16:9),
`MiniMaxH3Ref2VATextEncoderStep` (token ids, tags, pixel values, prompt embeddings: `<Picture i>: ` + vision block
per image, in request order) and `MiniMaxH3Ref2VAReferenceEncoderStep` (one latent frame per image at its own size).
The conditioner is test_fl2va_text_encoder's 51-layer tiny Qwen3-VL (diffusers reads hidden_states[50])."""

import dataclasses
import numpy as np
import pytest
import torch
from PIL import Image

from h3render.keyframes import keyframe_pixels
from h3render.models.vae_tiling import TilingConfig
from h3render.models.video_vae import VideoVAE
from h3render.models.video_vae_config import VIDEO_VAE_TINY
from h3render.references import fit_reference_image, reference_image_size
from tests._numerics import assert_close, rel_err
from tests.parity.test_fl2va_text_encoder import PROMPT, TOL, diffusers_encode  # noqa: F401 (diffusers_encode: same spy)
from tests.parity.test_fl2va_text_encoder import setup  # noqa: F401 (the module-scoped conditioner fixture)

pytest.importorskip("diffusers")

SHORT_EDGE = 64  # the tiny release's reference_short_edge (released 2048)


def _pictures():
    rng = np.random.default_rng(3)
    # 80 x 50 (8:5, upscaled to 96 x 64 after rounding), 48 x 72 portrait (-> 64 x 96), 64 x 64 (untouched)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((80, 50), (48, 72),
                                                                                         (64, 64))]


def _diffusers_setup(images):
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3ImageReference

    pipe = MiniMaxH3Ref2VASetupStep().init_pipeline()
    pipe.register_to_config(reference_image_short_edge=SHORT_EDGE)
    out = pipe(references=[MiniMaxH3ImageReference(image=i) for i in images], num_frames=124,
               output=["normalized_references", "height", "width"])
    return out["normalized_references"], (out["width"], out["height"])


def test_reference_image_size_rule():
    assert reference_image_size(640, 400, 2048) == (3264, 2048)  # research note [run]
    assert reference_image_size(1920, 1080, 2048) == (3648, 2048)
    assert reference_image_size(80, 50, SHORT_EDGE) == (96, 64) and reference_image_size(48, 72, 64) == (64, 96)


def test_setup_matches_diffusers():
    images = _pictures()
    normalized, canvas = _diffusers_setup(images)
    assert canvas == (1344, 768)  # references never set the canvas
    for ours, theirs in zip((fit_reference_image(i, SHORT_EDGE) for i in images), normalized):
        assert ours.size == theirs.image.size
        assert np.array_equal(np.asarray(ours), np.asarray(theirs.image))  # same LANCZOS pixels
    assert fit_reference_image(images[2], SHORT_EDGE) is images[2]


def test_presentation_and_embeddings_match_diffusers(setup, monkeypatch):  # noqa: F811
    from diffusers.modular_pipelines.minimax_h3 import encoders
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    full, ours, processor, tokenizer = setup
    normalized, _ = _diffusers_setup(_pictures())
    seen = {}
    original = encoders.get_qwen3vl_prompt_embeds

    def spy(text_encoder, proc, token_ids, vision_inputs=None, **kwargs):
        seen["token_ids"], seen["vision"] = list(token_ids), dict(vision_inputs or {})
        return original(text_encoder, proc, token_ids, vision_inputs, **kwargs)

    monkeypatch.setattr(encoders, "get_qwen3vl_prompt_embeds", spy)
    pipe = MiniMaxH3Ref2VATextEncoderStep().init_pipeline()
    pipe.update_components(text_encoder=full, tokenizer=tokenizer, processor=processor)
    out = pipe(prompt=PROMPT, normalized_references=normalized, output=["prompt_embeds", "text_token_tags"])
    images = [fit_reference_image(i, SHORT_EDGE) for i in _pictures()]
    with torch.no_grad():
        states, presentation = ours.encode_presentation(PROMPT, images)
    assert presentation.token_ids.tolist() == seen["token_ids"]
    assert torch.equal(presentation.tags, out["text_token_tags"])
    pixels = ours.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, seen["vision"]["pixel_values"])
    assert presentation.describe().startswith("<Picture 1>: ") and "<Picture 3>: " in presentation.describe()
    e = rel_err(states, out["prompt_embeds"][0])
    print(f"ref2va prompt embeds: rel err {e:.2e} ({states.shape[0]} rows)")
    assert states.shape == out["prompt_embeds"][0].shape and e <= TOL


def test_reference_latents_match_diffusers():
    from diffusers import AutoencoderKLMiniMaxH3
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep

    torch.manual_seed(0)
    cfg = dataclasses.replace(VIDEO_VAE_TINY, latents_mean=tuple((0.1 * torch.randn(24)).tolist()),
                              latents_std=tuple((0.5 + torch.rand(24)).tolist()))
    ref = AutoencoderKLMiniMaxH3(**dataclasses.asdict(cfg)).eval()
    tiling = TilingConfig(tile_height=64, tile_width=64, overlap_height=16, overlap_width=16)
    ref.enable_tiling(64, 64, 16, 16)  # a 96 px side runs the tiled encode
    vae = VideoVAE(cfg, tiling).eval()
    vae.load_state_dict(ref.state_dict(), strict=True)
    normalized, _ = _diffusers_setup(_pictures())
    pipe = MiniMaxH3Ref2VAReferenceEncoderStep().init_pipeline()
    from diffusers import AutoencoderKLMiniMaxH3Audio

    from h3render.models.audio_vae import AUDIO_VAE_TINY

    # read for its latents_mean/std only (no audio-bearing reference here)
    pipe.update_components(vae=ref, audio_vae=AutoencoderKLMiniMaxH3Audio(**dataclasses.asdict(AUDIO_VAE_TINY)))
    with torch.no_grad():
        theirs = pipe(normalized_references=normalized, output="condition_latents")
        ours = [vae.encode_condition(keyframe_pixels(r.image)) for r in normalized]
    for mine, other, picture in zip(ours, theirs, normalized):
        w, h = picture.image.size
        assert other.shape == (1, 24, 1, h // 16, w // 16) and mine.shape == other.shape[1:]
        assert_close(mine, other[0], TOL, "reference latent")
