"""ref2va's image and audio path vs diffusers 0.42.1's own blocks on the same tiny random weights and the same
media: `MiniMaxH3Ref2VASetupStep` (each image onto its own short edge, LANCZOS, the canvas staying 16:9; audio cut to
the target at its own rate, mono made stereo), `MiniMaxH3Ref2VATextEncoderStep` (token ids, tags, pixel values,
prompt embeddings: `<Picture i>: ` + vision block per image and `<Audio j>: ` per clip, in request order) and
`MiniMaxH3Ref2VAReferenceEncoderStep` (one latent frame per image at its own size; the audio VAE's posterior mean
per clip, normalized, channel-major rows). The WAV files go through diffusers' own PyAV decoder and ours. The
conditioner is test_fl2va_text_encoder's 51-layer tiny Qwen3-VL (diffusers reads hidden_states[50])."""

import dataclasses
import warnings
import numpy as np
import pytest
import torch
from PIL import Image

from h3render.keyframes import keyframe_pixels
from h3render.models.vae_tiling import TilingConfig
from h3render.models.video_vae import VideoVAE
from h3render.models.video_vae_config import VIDEO_VAE_TINY
from h3render.models.audio_vae import AudioVAE
from h3render.models.audio_vae_config import AUDIO_VAE_TINY
from h3render.packing import audio_to_rows
from h3render.references import decode_audio, fit_reference_image, normalize_audio, reference_image_size
from tests._media import wav
from tests._numerics import assert_close, rel_err
from tests.parity.test_fl2va_text_encoder import PROMPT, TOL
from tests.parity.test_fl2va_text_encoder import setup  # noqa: F401 (the module-scoped conditioner fixture)

pytest.importorskip("diffusers")

SHORT_EDGE = 64  # the tiny release's reference_short_edge (released 2048)


def _pictures():
    rng = np.random.default_rng(3)
    # 80 x 50 (8:5, upscaled to 96 x 64 after rounding), 48 x 72 portrait (-> 64 x 96), 64 x 64 (untouched)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((80, 50), (48, 72),
                                                                                         (64, 64))]


FRAMES = 124  # 5.17 s: the stereo clip (6 s) is cut, the mono one (1 s) is not; neither is a whole 800-sample hop


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return [wav(d / "stereo.wav", 6.0, 32000, 2), wav(d / "mono.wav", 1.01, 32000, 1)]


def _diffusers_setup(images, clips=()):
    """diffusers' setup on [image, clip 1, image, clip 2, image ...] (clips decoded by diffusers' `from_file`)."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    refs = [MiniMaxH3ImageReference(image=i) for i in images]
    for k, clip in enumerate(clips):
        refs.insert(2 * k + 1, MiniMaxH3AudioReference.from_file(str(clip)))
    pipe = MiniMaxH3Ref2VASetupStep().init_pipeline()
    pipe.register_to_config(reference_image_short_edge=SHORT_EDGE)
    out = pipe(references=refs, num_frames=FRAMES, output=["normalized_references", "height", "width"])
    return out["normalized_references"], (out["width"], out["height"])


def _kinds(normalized):
    return [r.kind for r in normalized]


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


def test_audio_decode_and_normalization_match_diffusers(clips):
    normalized, _ = _diffusers_setup(_pictures()[:1], clips)
    theirs = [r.audio for r in normalized if r.kind == "audio"]
    for clip, other in zip(clips, theirs):
        mine = normalize_audio(*decode_audio(clip), FRAMES)
        assert mine.shape == other.shape and mine.shape[0] == 2 and torch.equal(mine, other)
    assert theirs[0].shape[1] == int(FRAMES / 24 * 32000) and theirs[1].shape[1] == 32320  # cut / whole
    with pytest.raises(ValueError, match="needs resampling"):
        normalize_audio(torch.zeros(1, 441), 44100, FRAMES)


def test_presentation_and_embeddings_match_diffusers(setup, clips, monkeypatch):  # noqa: F811
    from diffusers.modular_pipelines.minimax_h3 import encoders
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    full, ours, processor, tokenizer = setup
    normalized, _ = _diffusers_setup(_pictures(), clips)  # image, audio, image, audio, image
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
        states, presentation = ours.encode_presentation(PROMPT, images, _kinds(normalized))
    assert presentation.token_ids.tolist() == seen["token_ids"]
    assert torch.equal(presentation.tags, out["text_token_tags"])
    pixels = ours.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, seen["vision"]["pixel_values"])
    described = presentation.describe()
    assert described.startswith("<Picture 1>: ") and "<|vision_end|><Audio 1>: <Picture 2>: " in described
    assert "<Audio 2>: <Picture 3>: " in described
    e = rel_err(states, out["prompt_embeds"][0])
    print(f"ref2va prompt embeds: rel err {e:.2e} ({states.shape[0]} rows)")
    assert states.shape == out["prompt_embeds"][0].shape and e <= TOL


def test_reference_latents_match_diffusers(clips):
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
    normalized, _ = _diffusers_setup(_pictures(), clips)
    pipe = MiniMaxH3Ref2VAReferenceEncoderStep().init_pipeline()
    from diffusers import AutoencoderKLMiniMaxH3Audio

    audio_cfg = dataclasses.replace(AUDIO_VAE_TINY, latents_mean=tuple((0.1 * torch.randn(32)).tolist()),
                                    latents_std=tuple((0.5 + torch.rand(32)).tolist()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's weight_norm deprecation, inside diffusers
        ref_audio = AutoencoderKLMiniMaxH3Audio(**dataclasses.asdict(audio_cfg)).eval()
    with torch.no_grad():
        for p in ref_audio.parameters():  # off the init (zero biases, unit gains), so every parameter matters
            p.add_(0.1 * torch.randn_like(p))
    audio_vae = AudioVAE(audio_cfg).eval()
    audio_vae.load_state_dict(ref_audio.state_dict(), strict=True)
    pipe.update_components(vae=ref, audio_vae=ref_audio)
    with torch.no_grad():
        out = pipe(normalized_references=normalized, output=["condition_latents", "audio_condition_latents"])
        theirs, their_audio = out["condition_latents"], out["audio_condition_latents"]
        pictures = [r for r in normalized if r.kind == "image"]
        ours = [vae.encode_condition(keyframe_pixels(r.image)) for r in pictures]
        our_audio = [audio_to_rows(audio_vae.encode(r.audio)) for r in normalized if r.kind == "audio"]
    assert [a.shape for a in their_audio] == [(2 * -(-int(FRAMES / 24 * 32000) // 800), 32), (2 * 41, 32)]
    for mine, other in zip(our_audio, their_audio):
        assert mine.shape == other.shape
        assert_close(mine, other, TOL, "reference audio rows")
    for mine, other, picture in zip(ours, theirs, pictures):
        w, h = picture.image.size
        assert other.shape == (1, 24, 1, h // 16, w // 16) and mine.shape == other.shape[1:]
        assert_close(mine, other[0], TOL, "reference latent")
