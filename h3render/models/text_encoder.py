"""Qwen3-VL text stack read at an inner layer: the conditioning MiniMax-H3 was trained against.

MiniMax-H3 conditions on `hidden_states[read_layer]` of its Qwen3-VL conditioner (released checkpoint: layer 50 of
64, model card and diffusers 0.42.1 `text_encoder_layer`): the output of decoder layer `read_layer` *before* the
final RMSNorm. Only those `read_layer` decoder layers are built; the later layers, the final norm, the vision tower
and the LM head are never materialized.

A text stack simply truncated to `read_layer` layers is NOT equivalent: its last hidden state is the final-normed
one. Here there is no final norm at all, so the last layer's output is returned as is.

The decoder layers and the multimodal rotary embedding are transformers' own Qwen3-VL classes, so the weights load
under the checkpoint's names with the `model.language_model.` prefix removed (`embed_tokens.weight`,
`layers.{i}.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer, Qwen3VLTextRotaryEmbedding

# MiniMax-H3 row modality tag of a text row (diffusers 0.42.1 `MINIMAX_H3_TEXT_TAG`; a checkpoint contract: it
# addresses the DiT's AdaLN table).
TEXT_TAG = 1


class TextEncoder(nn.Module):
    """The first `read_layer` decoder layers of a Qwen3-VL text model, returning the un-normed last state.

    Args:
        text_config: the conditioner's `text_config` (a `Qwen3VLTextConfig`, or its dict). Its `num_hidden_layers`
            is the full depth of the released model and must exceed `read_layer`.
        read_layer: which hidden state to return (released: 50). `hidden_states[0]` is the embedding output, so
            layer k's output is `hidden_states[k]`.
        tokenizer: optional; a transformers tokenizer, needed only by `tokenize` / `encode`.

    Raises:
        ValueError: `read_layer` is not in `1 .. num_hidden_layers - 1`.
    """

    def __init__(self, text_config: Qwen3VLTextConfig | dict, read_layer: int, tokenizer=None):
        super().__init__()
        if isinstance(text_config, dict):
            text_config = Qwen3VLTextConfig(**text_config)
        full_depth = text_config.num_hidden_layers
        if not 1 <= read_layer < full_depth:
            # Reading the last layer would need the final norm's input, which is fine in principle, but no
            # MiniMax-H3 release does it and a silent off-by-one here changes every output.
            raise ValueError(
                f"text encoder read_layer must be in 1..{full_depth - 1} for a {full_depth}-layer conditioner, "
                f"got {read_layer}"
            )
        config = copy.deepcopy(text_config)
        config.num_hidden_layers = read_layer
        # Layers are built outside a PreTrainedModel, so nothing else would pick the attention backend.
        config._attn_implementation = "sdpa"
        self.config = config
        self.full_depth = full_depth
        self.read_layer = read_layer
        self.tokenizer = tokenizer

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Qwen3VLTextDecoderLayer(config, i) for i in range(read_layer)])
        self.rotary_emb = Qwen3VLTextRotaryEmbedding(config=config)

    @property
    def text_dim(self) -> int:
        """Width of the returned rows (released: 5120)."""
        return self.config.hidden_size

    def forward(self, input_ids: Tensor) -> Tensor:
        """Run the stack on one token sequence.

        Args:
            input_ids: [1, Nt] int64 token ids, on this module's device.

        Returns:
            [1, Nt, text_dim] in the module's dtype: the output of decoder layer `read_layer`, before any norm.
        """
        hidden = self.embed_tokens(input_ids)  # [1, Nt, D]
        num_tokens = input_ids.shape[1]
        # A text-only presentation has one modality run, so Qwen3-VL's (t, h, w) rotary positions all equal the
        # token index (transformers `get_rope_index` on all-zero `mm_token_type_ids`).
        positions = torch.arange(num_tokens, device=input_ids.device)
        position_ids = positions.view(1, 1, -1).expand(3, 1, -1)  # [3, 1, Nt]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            # One unpadded sequence: no mask tensor, so transformers' SDPA backend runs its causal path
            # (`is_causal=True`), as the full model does when its causal mask is skipped.
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
        return hidden

    def tokenize(self, prompt: str) -> Tensor:
        """Tokenize a t2va prompt verbatim: no chat template, no special tokens, never truncated.

        Returns:
            [Nt] int64 token ids on the CPU.

        Raises:
            ValueError: no tokenizer was attached, or the prompt is empty / yields no tokens.
        """
        if self.tokenizer is None:
            raise ValueError("text encoder has no tokenizer attached")
        if not isinstance(prompt, str) or prompt == "":
            raise ValueError("prompt is empty: t2va needs a non-empty prompt string")
        ids = self.tokenizer(prompt, add_special_tokens=False, truncation=False)["input_ids"]
        if len(ids) == 0:
            raise ValueError(f"prompt {prompt!r} tokenizes to zero tokens")
        return torch.tensor(ids, dtype=torch.long)

    @torch.no_grad()
    def encode(self, prompt: str) -> Tensor:
        """Encode one t2va prompt.

        Returns:
            [Nt, text_dim] on the module's device, in the module's dtype.

        Raises:
            ValueError: as `tokenize`.
        """
        device = self.embed_tokens.weight.device
        input_ids = self.tokenize(prompt).to(device)[None]  # [1, Nt]
        return self.forward(input_ids)[0]

    @staticmethod
    def token_tags(num_tokens: int, device: torch.device | str | None = None) -> Tensor:
        """Per-row modality tags of a t2va prompt's rows: all text (1).

        Returns:
            [num_tokens] int64.
        """
        return torch.full((num_tokens,), TEXT_TAG, dtype=torch.long, device=device)
