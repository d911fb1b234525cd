"""`h3render make-checkpoint --layout diffusers` writes a folder diffusers 0.42.1 itself loads
(`ModularPipeline.from_pretrained` + `load_components`), with the same weights h3render's own loader reads from it.

diffusers reads a hard-coded `hidden_states[50]` (`MiniMaxH3ModularPipeline.text_encoder_layer`, no config): the tiny
conditioner has 51 layers read at 50, as released, so diffusers' own prompt encode runs on the written folder and
gives h3render's embeddings (a 3-layer encoder read at 2 made that encode refuse, issue #29).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from h3render.checkpoint.load import load_components
from h3render.checkpoint.info import read_checkpoint_info
from h3render.checkpoint.releases import RELEASES
from h3render.make_checkpoint.writer import make_checkpoint

pytest.importorskip("diffusers")
pytest.importorskip("accelerate", reason="diffusers loads MiniMax-H3's fp32-island models only with accelerate")

# Components the t2va/fl2va workflows load from a checkpoint folder (`transformer_ref/` is ref2va's partition,
# which make-checkpoint does not write).
FOLDERS = ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer", "scheduler", "audio_scheduler")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "diffusers", "tiny", "diffusers", seed=0)


def test_diffusers_resolves_the_minimax_h3_pipeline_and_the_tiny_canvas_rule(folder):
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    assert type(pipe).__name__ == "MiniMaxH3ModularPipeline" and type(pipe.blocks).__name__ == "MiniMaxH3Blocks"
    tiny = RELEASES["tiny"]
    assert (pipe.config.canvas_short_edge, pipe.config.canvas_max_pixels) == (tiny.canvas_short_edge,
                                                                            tiny.canvas_max_pixels)


def test_diffusers_loads_every_component_with_h3renders_weights(folder):
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(names=list(FOLDERS), dtype=torch.float32)
    for name in FOLDERS:
        assert getattr(pipe, name, None) is not None, name
    ours = load_components(str(folder), dtype=torch.float32)
    # The audio VAE's latent statistics are numbers diffusers can multiply by (null made torch.tensor(None) fail)
    # and the identity h3render applies.
    config = pipe.audio_vae.config
    assert list(config.latents_mean) == [0.0] * 32 and list(config.latents_std) == [1.0] * 32
    assert torch.equal(ours.audio_vae.latents_mean.flatten(), torch.tensor(config.latents_mean))
    # Same video VAE weights on both sides (a sample of tensors, by name).
    theirs = pipe.vae.state_dict()
    mine = ours.video_vae.state_dict()
    shared = sorted(set(theirs) & set(mine))
    assert len(shared) > 10
    for name in shared[:: max(1, len(shared) // 20)]:
        assert torch.equal(theirs[name].float(), mine[name].float()), name
    assert pipe.transformer.config.num_layers == RELEASES["tiny"].dit.num_layers


def test_the_processor_folder_has_the_video_processor_diffusers_needs(folder):
    from transformers.video_processing_utils import BaseVideoProcessor

    # Qwen3VLProcessor.from_pretrained reads a video processor config beside the image one (it raised "Can't load
    # video processor" before); building the processor itself needs torchvision.
    video, _ = BaseVideoProcessor.get_video_processor_dict(str(folder / "processor"))
    assert video["video_processor_type"] == "Qwen3VLVideoProcessor"
    assert video["patch_size"] == RELEASES["tiny"].text_encoder["vision_config"]["patch_size"]
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("Qwen3VLVideoProcessor needs torchvision to be built")
    from diffusers import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(names=["processor"])
    assert type(pipe.processor).__name__ == "Qwen3VLProcessor"


def test_h3renders_loader_still_reads_the_folder_as_the_official_layout(folder, tmp_path):
    official = make_checkpoint(tmp_path / "official", "tiny", "official", seed=0)
    assert read_checkpoint_info(str(folder)).config_hash == read_checkpoint_info(str(official)).config_hash
    assert read_checkpoint_info(str(folder)).config_hash == read_checkpoint_info("tiny").config_hash
    index = json.loads((folder / "modular_model_index.json").read_text())
    assert index["_blocks_class_name"] == "MiniMaxH3Blocks"
    assert {name for name, value in index.items() if isinstance(value, list)} == {*FOLDERS, "processor"}


def test_diffusers_encodes_a_prompt_from_the_folder_as_h3render_does(folder):
    """diffusers' `get_qwen3vl_prompt_embeds` (the function its text-encode block calls) on the folder's text encoder,
    at its own `text_encoder_layer`, against h3render's encoder loaded from the same folder. The processor is a
    stand-in for its one method used here: `Qwen3VLProcessor` itself needs torchvision, which these machines lack;
    a text-only presentation's token types are all 0 (text)."""
    from diffusers import ModularPipeline
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    class TextOnlyProcessor:
        @staticmethod
        def create_mm_token_type_ids(batch):
            return [[0] * len(ids) for ids in batch]

    pipe = ModularPipeline.from_pretrained(str(folder))
    pipe.load_components(names=["text_encoder"], dtype=torch.float32)
    layer = pipe.text_encoder_layer
    assert layer == RELEASES["tiny"].text_read_layer == 50
    ours = load_components(str(folder), parts=("text_encoder",), dtype=torch.float32).text_encoder.eval()
    ids = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = get_qwen3vl_prompt_embeds(pipe.text_encoder, TextOnlyProcessor(), ids[0].tolist(),
                                           text_encoder_layer=layer, dtype=torch.float32)
        mine = ours(ids)
    assert theirs.shape == mine.shape == (1, 17, RELEASES["tiny"].dit.text_dim)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
