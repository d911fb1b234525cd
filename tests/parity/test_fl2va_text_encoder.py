"""fl2va prompt encoding: our presentation, vision tower and DeepStack injection vs diffusers 0.42.1's own
`MiniMaxH3FL2VATextEncoderStep` driving a full tiny `Qwen3VLForConditionalGeneration` with the same weights.

diffusers reads `hidden_states[50]` (`components.text_encoder_layer` is fixed), so the tiny conditioner has 51 text
layers. Qwen3VLProcessor cannot be built without torchvision (its video processor), so diffusers gets a processor
object carrying transformers' own `create_mm_token_type_ids` with our image processor and tokenizer."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

from h3render.checkpoint.builtin import tiny_vl_tokenizer
from h3render.checkpoint.releases import QWEN3VL_TINY
from h3render.models.text_encoder import (IMAGE_PAD, TEXT_TAG, VIDEO_PAD, VIDEO_TAG, VISION_END, VISION_START,
                                          TextEncoder, image_processor_from_dict, mrope_position_ids)
from tests._numerics import rel_err

pytest.importorskip("diffusers")

TOL = 1e-5
READ = 50  # diffusers' fixed `text_encoder_layer`
PROMPT = "A red fox runs through a snowy forest at dawn."
# H3's processor size budget (research/conditioning.md §1.4): min_pixels 65536 upsizes tiny keyframes for Qwen.
PROCESSOR = {"patch_size": 8, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
             "image_processor_type": "Qwen2VLImageProcessorFast"}


@pytest.fixture(scope="module")
def setup():
    tokenizer = tiny_vl_tokenizer(QWEN3VL_TINY["text_config"]["vocab_size"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)}
    # Two DeepStack taps (blocks 0 and 2 of 3), so two decoder layers receive injections.
    vision = {**QWEN3VL_TINY["vision_config"], "depth": 3, "deepstack_visual_indexes": [0, 2]}
    config = Qwen3VLConfig.from_dict({
        "text_config": {**QWEN3VL_TINY["text_config"], "num_hidden_layers": READ + 1}, "vision_config": vision,
        "image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
        "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
    })
    torch.manual_seed(0)
    full = Qwen3VLForConditionalGeneration(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in full.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    image_processor = image_processor_from_dict(PROCESSOR)
    ours = TextEncoder(config.text_config, READ, tokenizer=tokenizer, vision_config=config.vision_config,
                       image_processor=image_processor).eval()
    state = {}
    for name, tensor in full.state_dict().items():  # the checkpoint names the loader will map
        if name.startswith("model.language_model."):
            state[name[len("model.language_model."):]] = tensor
        elif name.startswith("model.visual."):
            state["visual." + name[len("model.visual."):]] = tensor
    ours.load_state_dict({k: v for k, v in state.items() if k in ours.state_dict()}, strict=True)

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    processor.image_token_id, processor.video_token_id = ids[IMAGE_PAD], ids[VIDEO_PAD]
    return full, ours, processor, tokenizer


def _images(*sizes):
    rng = np.random.default_rng(sum(w * h for w, h in sizes))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def diffusers_encode(full, processor, tokenizer, prompt, keyframes, monkeypatch):
    """Run diffusers' FL2VA text-encoder block; also capture what it hands the conditioner."""
    from diffusers.modular_pipelines.minimax_h3 import encoders
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    seen = {}
    original = encoders.get_qwen3vl_prompt_embeds

    def spy(text_encoder, proc, token_ids, vision_inputs=None, **kwargs):
        seen["token_ids"], seen["vision"] = list(token_ids), dict(vision_inputs or {})
        return original(text_encoder, proc, token_ids, vision_inputs, **kwargs)

    monkeypatch.setattr(encoders, "get_qwen3vl_prompt_embeds", spy)
    pipe = MiniMaxH3FL2VATextEncoderStep().init_pipeline()
    pipe.update_components(text_encoder=full, tokenizer=tokenizer, processor=processor)
    out = pipe(prompt=prompt, keyframes=keyframes, output=["prompt_embeds", "text_token_tags"])
    return out["prompt_embeds"][0], out["text_token_tags"], seen


@pytest.mark.parametrize("sizes", [[(224, 128)], [(160, 96), (160, 96)], [(64, 64)]],
                         ids=["one-keyframe", "two-keyframes", "upsized-64px"])
def test_matches_diffusers_fl2va_text_encoder(setup, sizes, monkeypatch):
    full, ours, processor, tokenizer = setup
    keyframes = _images(*sizes)
    with torch.no_grad():
        ref_states, ref_tags, seen = diffusers_encode(full, processor, tokenizer, PROMPT, keyframes, monkeypatch)
        states, presentation = ours.encode_presentation(PROMPT, keyframes)
        grid_thw, _, _ = ours.image_features(keyframes)

    assert presentation.token_ids.tolist() == seen["token_ids"]
    assert torch.equal(presentation.tags, ref_tags)
    assert torch.equal(grid_thw, seen["vision"]["image_grid_thw"])
    pixels = ours.image_processor(images=keyframes, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, seen["vision"]["pixel_values"])
    # Tags: label + prompt text, the whole vision block (start, pads, end) video.
    n_pads = [int(g.prod()) // 4 for g in grid_thw]
    assert presentation.image_tokens == tuple(n_pads) and int(presentation.pad_mask.sum()) == sum(n_pads)
    assert int((presentation.tags == VIDEO_TAG).sum()) == sum(n + 2 for n in n_pads)
    assert set(presentation.tags.tolist()) == {TEXT_TAG, VIDEO_TAG}
    if sizes == [(64, 64)]:
        assert n_pads == [256]  # 64 x 64 is upsized to 256 x 256 by min_pixels 65536: 32 x 32 patches / 4
    e = rel_err(states, ref_states)
    print(f"fl2va prompt embeds {sizes}: rel err {e:.2e} ({states.shape[0]} rows)")
    assert states.shape == ref_states.shape and e <= TOL


def test_the_images_matter(setup):
    """Different pixels (same pad count) change every row after the first vision block, DeepStack included."""
    _, ours, _, _ = setup
    a, b = _images((160, 96)), _images((96, 160))[0].rotate(90, expand=True)
    with torch.no_grad():
        sa, pa = ours.encode_presentation(PROMPT, a)
        sb, pb = ours.encode_presentation(PROMPT, [b])
    assert torch.equal(pa.token_ids, pb.token_ids)
    assert rel_err(sa[-5:], sb[-5:]) > 1e-2


def test_last_frame_only_is_still_picture_1(setup):
    _, ours, _, tokenizer = setup
    presentation = ours.present_fl2va(PROMPT, [6])
    label = tokenizer("<Picture 1>: ", add_special_tokens=False)["input_ids"]
    assert presentation.token_ids[: len(label)].tolist() == label
    assert presentation.describe().startswith("<Picture 1>: <|vision_start|><|image_pad|>x6<|vision_end|>")
    assert presentation.describe().endswith(PROMPT)


def test_mrope_positions_equal_transformers_get_rope_index(setup):
    full, ours, processor, _ = setup
    keyframes = _images((224, 128), (128, 224))
    grid_thw, _, _ = ours.image_features(keyframes)
    presentation = ours.present_fl2va(PROMPT, ours.image_token_counts(grid_thw))
    ids = presentation.token_ids[None]
    mm = torch.tensor(processor.create_mm_token_type_ids([presentation.token_ids.tolist()]))
    ref, _ = full.model.get_rope_index(ids, mm_token_type_ids=mm, image_grid_thw=grid_thw)
    assert torch.equal(mrope_position_ids(presentation.pad_mask, grid_thw, 2), ref[:, 0])


def test_t2va_path_is_unchanged(setup):
    """No images: `encode_with_images` is `encode`, and building the vision tower does not change the text path."""
    full, ours, _, tokenizer = setup
    text_only = TextEncoder(full.config.text_config, READ, tokenizer=tokenizer).eval()
    text_only.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("visual.")})
    with torch.no_grad():
        states, tags = ours.encode_with_images(PROMPT, [])
        assert torch.equal(states, text_only.encode(PROMPT))
    assert tags.tolist() == [TEXT_TAG] * states.shape[0]
    assert not any(k.startswith("visual.") for k in text_only.state_dict())


def test_errors(setup):
    full, ours, _, _ = setup
    no_vision = TextEncoder(full.config.text_config, READ, tokenizer=ours.tokenizer)
    with pytest.raises(ValueError, match="no vision tower"):
        no_vision.encode_with_images(PROMPT, _images((64, 64)))
    from h3render.checkpoint.builtin import tiny_tokenizer

    plain = TextEncoder(full.config.text_config, READ, tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match=r"no <\|vision_start\|> token"):
        plain.present_fl2va(PROMPT, [4])


def test_tiny_release_vision_tower_builds_on_meta_and_encodes():
    """The built-in tiny conditioner's `vision_config` (releases.QWEN3VL_TINY) with H3's processor budget: a
    224 x 128 canvas is upsized by min_pixels 65536 to 352 x 208 (smart_resize, factor 16) -> 22 x 13 merged pads."""
    import math

    from h3render.checkpoint.releases import RELEASES
    from h3render.checkpoint.stream import parameters_on_meta

    release = RELEASES["tiny"]
    processor = image_processor_from_dict(PROCESSOR)
    with parameters_on_meta():  # how the loader builds it before streaming the weights in
        meta = TextEncoder(release.text_config, release.text_read_layer, tokenizer=tiny_vl_tokenizer(),
                           vision_config=QWEN3VL_TINY["vision_config"], image_processor=processor)
    assert all(p.device.type == "meta" for n, p in meta.named_parameters() if n.startswith("visual."))
    torch.manual_seed(0)
    encoder = TextEncoder(release.text_config, release.text_read_layer, tokenizer=tiny_vl_tokenizer(),
                          vision_config=QWEN3VL_TINY["vision_config"], image_processor=processor).eval()
    beta = math.sqrt(65536 / (128 * 224))
    h, w = math.ceil(128 * beta / 16) * 16, math.ceil(224 * beta / 16) * 16
    assert (h, w) == (208, 352)
    states, tags = encoder.encode_with_images(PROMPT, _images((224, 128)))
    assert int((tags == VIDEO_TAG).sum()) == (h // 16) * (w // 16) + 2
    assert states.shape == (tags.numel(), release.text_config.hidden_size)
