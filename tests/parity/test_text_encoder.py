"""The text encoder reads Qwen3-VL's `hidden_states[k]` (un-normed output of decoder layer k), not a truncated
model's final-normed state; prompts are tokenized verbatim."""

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from h3render.checkpoint.builtin import tiny_tokenizer
from h3render.checkpoint.releases import QWEN3VL_TINY
from h3render.models.text_encoder import TEXT_TAG, TextEncoder
from tests._numerics import rel_err

TOL = 1e-5
DEPTH = 5  # more layers than any read depth below


def _config(num_layers: int) -> Qwen3VLConfig:
    cfg = {**QWEN3VL_TINY, "text_config": {**QWEN3VL_TINY["text_config"], "num_hidden_layers": num_layers}}
    return Qwen3VLConfig.from_dict(cfg)


@pytest.fixture(scope="module")
def full_model():
    """A tiny full Qwen3-VL with every weight randomized (norm gains too, so a missing or extra norm shows)."""
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(_config(DEPTH)).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def _ours(full: Qwen3VLForConditionalGeneration, read_layer: int, tokenizer=None) -> TextEncoder:
    encoder = TextEncoder(full.config.text_config, read_layer, tokenizer=tokenizer).eval()
    prefix = "model.language_model."
    state = {k[len(prefix):]: v for k, v in full.state_dict().items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if k in encoder.state_dict()}
    encoder.load_state_dict(state, strict=True)
    return encoder


def _reference_hidden_states(full, ids: torch.Tensor):
    """What diffusers' `get_qwen3vl_prompt_embeds` reads: `text_encoder.model(...)` with all-text token types."""
    with torch.no_grad():
        out = full.model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.zeros_like(ids),
                         use_cache=False, output_hidden_states=True)
    return out.hidden_states


@pytest.mark.parametrize("read_layer", [2, 4])
def test_equals_full_model_hidden_state(full_model, read_layer):
    ids = torch.randint(0, 512, (1, 13), generator=torch.Generator().manual_seed(2))
    ours = _ours(full_model, read_layer)
    assert len(ours.layers) == read_layer  # later layers are never built
    with torch.no_grad():
        out = ours(ids)
    ref = _reference_hidden_states(full_model, ids)[read_layer]
    e = rel_err(out, ref)
    print(f"read layer {read_layer}: rel err vs hidden_states[{read_layer}] {e:.2e}")
    assert out.shape == (1, 13, full_model.config.text_config.hidden_size)
    assert e <= TOL


def test_differs_from_truncated_models_normed_state(full_model):
    """A Qwen3-VL truncated to k layers reports its final-normed state last; ours is the un-normed one."""
    k = 2
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    truncated = Qwen3VLForConditionalGeneration(_config(k)).float().eval()
    state = {n: t for n, t in full_model.state_dict().items() if n in truncated.state_dict()}
    truncated.load_state_dict(state, strict=True)
    normed = _reference_hidden_states(truncated, ids)[k]
    with torch.no_grad():
        ours = _ours(full_model, k)(ids)
    e = rel_err(ours, normed)
    print(f"ours vs truncated model's last (normed) state: rel diff {e:.2e}")
    assert e > 0.1


def test_encode_tokenizes_verbatim_and_never_truncates(full_model):
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = 8  # a limit that must not cut the prompt
    encoder = _ours(full_model, 3, tokenizer=tokenizer)
    prompt = "A red fox runs through a snowy forest at dawn, its breath visible in the cold air."
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert len(ids) > 8
    assert encoder.tokenize(prompt).tolist() == ids
    assert tokenizer.decode(ids) == prompt  # byte-level: verbatim round trip
    rows = encoder.encode(prompt)
    ref = _reference_hidden_states(full_model, torch.tensor([ids]))[3][0]
    assert rows.shape == (len(ids), encoder.text_dim)
    assert rel_err(rows, ref) <= TOL
    tags = TextEncoder.token_tags(len(ids))
    assert tags.dtype == torch.long and tags.tolist() == [TEXT_TAG] * len(ids) and TEXT_TAG == 1


def test_bad_input(full_model):
    encoder = _ours(full_model, 2, tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="empty"):
        encoder.encode("")
    with pytest.raises(ValueError, match="no tokenizer"):
        _ours(full_model, 2).tokenize("hello")
    with pytest.raises(ValueError, match="read_layer"):
        TextEncoder(full_model.config.text_config, DEPTH)
    with pytest.raises(ValueError, match="read_layer"):
        TextEncoder(full_model.config.text_config, 0)
