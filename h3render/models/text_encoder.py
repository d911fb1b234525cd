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

fl2va (keyframes) adds the vision tower, transformers' own `Qwen3VLVisionModel` (released: 27 blocks, DeepStack
taps after blocks 8/16/24), loaded from `model.visual.*` as `visual.*`, and the image processor (transformers'
`Qwen2VLImageProcessorPil`, configured from the checkpoint's `processor/preprocessor_config.json`). The prompt is
presented as diffusers 0.42.1 `MiniMaxH3FL2VATextEncoderStep` does: per keyframe `"<Picture i>: "` then a vision block
(`<|vision_start|>`, N x `<|image_pad|>`, `<|vision_end|>`), then the prompt verbatim, each piece tokenized without
special tokens. As in `Qwen3VLModel.forward`: the merged vision features replace the image-pad embeddings, the
DeepStack features are added at the pad rows after decoder layers 0, 1, 2, and positions are Qwen's multimodal
(t, h, w) rotary indices (`get_rope_index`). The t2va path (`forward(input_ids)`, `encode`) is unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLTextDecoderLayer,
    Qwen3VLTextRotaryEmbedding,
    Qwen3VLVisionModel,
)

# MiniMax-H3 row modality tags (diffusers 0.42.1 `MINIMAX_H3_TEXT_TAG` / `MINIMAX_H3_VIDEO_TAG`; a checkpoint
# contract: they address the DiT's AdaLN table). A keyframe's vision block is tagged video.
TEXT_TAG = 1
VIDEO_TAG = 0

# Qwen3-VL's vision special tokens (the released `tokenizer/`; diffusers looks them up by these names).
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


class TextEncoder(nn.Module):
    """The first `read_layer` decoder layers of a Qwen3-VL text model, returning the un-normed last state.

    Args:
        text_config: the conditioner's `text_config` (a `Qwen3VLTextConfig`, or its dict). Its `num_hidden_layers`
            is the full depth of the released model and must exceed `read_layer`.
        read_layer: which hidden state to return (released: 50). `hidden_states[0]` is the embedding output, so
            layer k's output is `hidden_states[k]`.
        tokenizer: optional; a transformers tokenizer, needed only by `tokenize` / `encode` (and, with the vision
            special tokens, by `encode_with_images`).
        vision_config: optional; the conditioner's `vision_config` (`Qwen3VLVisionConfig` or dict). When given, the
            vision tower is built as `self.visual` (checkpoint names `model.visual.*` -> `visual.*`); t2va-only
            engines leave it out and never load those weights.
        image_processor: optional; a transformers Qwen2-VL image processor (see `image_processor_from_dict`),
            needed by `encode_with_images`.

    Raises:
        ValueError: `read_layer` is not in `1 .. num_hidden_layers - 1`, or the vision tower's output width is not
            the text width.
    """

    def __init__(self, text_config: Qwen3VLTextConfig | dict, read_layer: int, tokenizer=None,
                 vision_config: Qwen3VLVisionConfig | dict | None = None, image_processor=None):
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
        self.image_processor = image_processor
        self.visual = None
        if vision_config is not None:
            self.visual = build_vision_tower(vision_config)
            if self.visual.config.out_hidden_size != config.hidden_size:
                raise ValueError(f"vision tower out_hidden_size {self.visual.config.out_hidden_size} must equal the "
                                 f"text width {config.hidden_size}")

    @property
    def text_dim(self) -> int:
        """Width of the returned rows (released: 5120)."""
        return self.config.hidden_size

    def forward(self, input_ids: Tensor, vision: "VisionInputs | None" = None) -> Tensor:
        """Run the stack on one token sequence.

        Args:
            input_ids: [1, Nt] int64 token ids, on this module's device.
            vision: None for a text-only presentation (t2va); else the pad mask, merged features, DeepStack
                features and rotary positions of its vision blocks (`vision_inputs`).

        Returns:
            [1, Nt, text_dim] in the module's dtype: the output of decoder layer `read_layer`, before any norm.
        """
        hidden = self.embed_tokens(input_ids)  # [1, Nt, D]
        if vision is None:
            num_tokens = input_ids.shape[1]
            # A text-only presentation has one modality run, so Qwen3-VL's (t, h, w) rotary positions all equal
            # the token index (transformers `get_rope_index` on all-zero `mm_token_type_ids`).
            positions = torch.arange(num_tokens, device=input_ids.device)
            position_ids = positions.view(1, 1, -1).expand(3, 1, -1)  # [3, 1, Nt]
        else:
            mask = vision.pad_mask.to(hidden.device)  # [Nt] bool
            hidden = hidden.clone()
            hidden[0, mask] = vision.embeds.to(hidden.device, hidden.dtype)  # the masked_scatter of Qwen3VLModel
            position_ids = vision.position_ids.to(hidden.device)[:, None]  # [3, 1, Nt]
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.layers):
            # One unpadded sequence: no mask tensor, so transformers' SDPA backend runs its causal path
            # (`is_causal=True`), as the full model does when its causal mask is skipped.
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=None)
            if vision is not None and index < len(vision.deepstack):
                # DeepStack: ViT features of inner blocks are added at the pad rows after the first decoder layers.
                hidden = hidden.clone()
                hidden[0, mask] = hidden[0, mask] + vision.deepstack[index].to(hidden.device, hidden.dtype)
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

    # -- fl2va: keyframes through the vision tower -------------------------------------------------------------

    @property
    def has_vision(self) -> bool:
        """Whether the vision tower was built (fl2va needs it; t2va does not)."""
        return self.visual is not None

    def image_features(self, images: Sequence[Any]) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Keyframes through the image processor (one batched call) and the vision tower.

        Args:
            images: RGB PIL images (the keyframes on the canvas, packed order).

        Returns:
            `(grid_thw [n, 3] int64 CPU, embeds [Nv, text_dim], deepstack: one [Nv, text_dim] per DeepStack tap)`,
            Nv = sum of `grid_thw.prod(-1) // merge_size**2`, in the module's dtype on its device.

        Raises:
            ValueError: no vision tower or image processor attached.
        """
        if self.visual is None or self.image_processor is None:
            raise ValueError("text encoder has no vision tower / image processor attached (fl2va needs both)")
        processed = self.image_processor(images=list(images), return_tensors="pt")
        grid_thw = processed["image_grid_thw"].to(torch.long)
        device = self.embed_tokens.weight.device
        pixels = processed["pixel_values"].to(device, self.visual.dtype)  # [patches, 3 * 2 * p * p]
        out = self.visual(pixels, grid_thw=grid_thw.to(device), return_dict=True)
        return grid_thw, out.pooler_output, list(out.deepstack_features)

    def image_token_counts(self, grid_thw: Tensor) -> list[int]:
        """Image-pad tokens per image: `t * h * w // merge_size**2` (1344 x 768 at patch 16 -> 1008)."""
        merge = self.visual.config.spatial_merge_size
        return [int(g.prod()) // (merge * merge) for g in grid_thw]

    def present_ref2va(self, prompt: str, kinds: Sequence[str], image_tokens: Sequence[int]) -> "Presentation":
        """ref2va's presentation (diffusers 0.42.1 `MiniMaxH3Ref2VATextEncoderStep._build_presentation`), for image
        and audio references in request order: an audio reference is the label `"<Audio j>: "` alone (its waveform
        never reaches the conditioner), an image `"<Picture i>: "` + its vision block (`image_tokens` pads, in
        image order); numbered from 1 per modality; then the prompt. Video references are not presented yet.

        Raises:
            ValueError: a kind other than "image" / "audio"; as `present_fl2va`.
        """
        images = iter(image_tokens)
        ids: list[int] = []
        tags: list[int] = []
        pads: list[bool] = []
        special = _vision_token_ids(self.tokenizer)
        counts = {"image": 0, "audio": 0}
        for kind in kinds:
            if kind not in counts:
                raise ValueError(f"ref2va presentation: {kind!r} references are not presented by h3render yet")
            counts[kind] += 1
            name = "Picture" if kind == "image" else "Audio"
            label = self.tokenizer(f"<{name} {counts[kind]}>: ", add_special_tokens=False)["input_ids"]
            ids += label
            tags += [TEXT_TAG] * len(label)
            pads += [False] * len(label)
            if kind == "image":
                count = int(next(images))
                ids += [special[VISION_START]] + [special[IMAGE_PAD]] * count + [special[VISION_END]]
                tags += [VIDEO_TAG] * (count + 2)
                pads += [False] + [True] * count + [False]
        prompt_ids = self.tokenize(prompt).tolist()
        ids += prompt_ids
        tags += [TEXT_TAG] * len(prompt_ids)
        pads += [False] * len(prompt_ids)
        return Presentation(torch.tensor(ids, dtype=torch.long), torch.tensor(tags, dtype=torch.long),
                            torch.tensor(pads, dtype=torch.bool), tuple(int(c) for c in image_tokens), prompt,
                            tuple(kinds))

    def present_fl2va(self, prompt: str, image_tokens: Sequence[int]) -> "Presentation":
        """The fl2va prompt presentation, tokenized piece by piece without special tokens.

        Per keyframe i (from 1; a last-frame-only job is still `<Picture 1>`): `"<Picture i>: "` (tag text), then
        `<|vision_start|>`, `image_tokens[i]` x `<|image_pad|>`, `<|vision_end|>` (the whole block tagged video);
        then the prompt verbatim (tag text). No chat template.

        Raises:
            ValueError: no tokenizer, an empty prompt, or a tokenizer without the vision special tokens.
        """
        prompt_ids = self.tokenize(prompt).tolist()
        special = _vision_token_ids(self.tokenizer)
        ids: list[int] = []
        tags: list[int] = []
        pads: list[bool] = []
        for index, count in enumerate(image_tokens):
            label = self.tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
            block = [special[VISION_START]] + [special[IMAGE_PAD]] * int(count) + [special[VISION_END]]
            ids += label + block
            tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
            pads += [False] * (len(label) + 1) + [True] * int(count) + [False]
        ids += prompt_ids
        tags += [TEXT_TAG] * len(prompt_ids)
        pads += [False] * len(prompt_ids)
        return Presentation(torch.tensor(ids, dtype=torch.long), torch.tensor(tags, dtype=torch.long),
                            torch.tensor(pads, dtype=torch.bool), tuple(int(c) for c in image_tokens), prompt)

    @torch.no_grad()
    def encode_with_images(self, prompt: str, images: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """Encode an fl2va prompt with its keyframes (packed order, already on the canvas).

        Returns:
            `(states [N, text_dim] on the module's device and dtype, tags [N] int64 CPU: 1 text, 0 vision block)`.
            With no images this is `encode(prompt)` and all-text tags.

        Raises:
            ValueError: as `present_fl2va` / `image_features`.
        """
        states, presentation = self.encode_presentation(prompt, images)
        return states, presentation.tags

    @torch.no_grad()
    def encode_presentation(self, prompt: str, images: Sequence[Any],
                            kinds: Sequence[str] | None = None) -> tuple[Tensor, "Presentation"]:
        """`encode_with_images`, also returning the `Presentation` (token ids, tags, pad counts) for the sidecar.
        With `kinds` (ref2va: "image" / "audio" per reference, request order; `images` the image references) the
        presentation is `present_ref2va`'s."""
        if kinds is not None and "audio" in kinds and not images:
            raise ValueError("ref2va presentation: audio references need an image reference beside them")
        if not images:
            ids = self.tokenize(prompt)
            presentation = Presentation(ids, self.token_tags(ids.numel()), torch.zeros(ids.numel(), dtype=torch.bool),
                                        (), prompt)
            return self.encode(prompt), presentation
        grid_thw, embeds, deepstack = self.image_features(images)
        counts = self.image_token_counts(grid_thw)
        presentation = (self.present_fl2va(prompt, counts) if kinds is None
                        else self.present_ref2va(prompt, kinds, counts))
        if int(presentation.pad_mask.sum()) != embeds.shape[0]:
            raise ValueError(f"vision features ({embeds.shape[0]} rows) do not match the presentation's "
                             f"{int(presentation.pad_mask.sum())} image pads")
        positions = mrope_position_ids(presentation.pad_mask, grid_thw, self.visual.config.spatial_merge_size)
        vision = VisionInputs(presentation.pad_mask, embeds, deepstack, positions)
        device = self.embed_tokens.weight.device
        return self.forward(presentation.token_ids.to(device)[None], vision)[0], presentation


@dataclass(frozen=True, eq=False)
class VisionInputs:
    """What the text stack needs of a presentation's vision blocks.

    Attributes:
        pad_mask: `[Nt]` bool, True on `<|image_pad|>` rows.
        embeds: `[Nv, text_dim]` merged vision features, one per pad row in order.
        deepstack: DeepStack features, `[Nv, text_dim]` each, added after decoder layers 0, 1, ...
        position_ids: `[3, Nt]` int64 Qwen3-VL multimodal rotary indices (`mrope_position_ids`).
    """

    pad_mask: Tensor
    embeds: Tensor
    deepstack: list[Tensor]
    position_ids: Tensor


@dataclass(frozen=True, eq=False)
class Presentation:
    """One tokenized prompt presentation.

    Attributes:
        token_ids: `[Nt]` int64. tags: `[Nt]` int64 row tags (1 text, 0 vision block). pad_mask: `[Nt]` bool.
        image_tokens: image pads per keyframe. prompt: the prompt as given.
        kinds: ref2va: "image" / "audio" per reference, request order; () for fl2va (one picture per image).
    """

    token_ids: Tensor
    tags: Tensor
    pad_mask: Tensor
    image_tokens: tuple[int, ...]
    prompt: str
    kinds: tuple[str, ...] = ()

    def describe(self) -> str:
        """Human-readable form for the sidecar: `<Picture 1>: <|vision_start|><|image_pad|>x1008<|vision_end|>...`
        (ref2va: `<Audio 1>: ` labels too)."""
        images, counts, head = iter(self.image_tokens), {"image": 0, "audio": 0}, ""
        for kind in self.kinds or ("image",) * len(self.image_tokens):
            counts[kind] += 1
            if kind == "audio":
                head += f"<Audio {counts[kind]}>: "
            else:
                head += f"<Picture {counts[kind]}>: {VISION_START}{IMAGE_PAD}x{next(images)}{VISION_END}"
        return head + self.prompt


def mrope_position_ids(pad_mask: Tensor, grid_thw: Tensor, merge_size: int) -> Tensor:
    """Qwen3-VL's multimodal rotary indices of one presentation (transformers `Qwen3VLModel.get_rope_index`).

    Text runs count on from the running position on all three axes; image run k (its pads, in order) gets
    `(start + t, start + row, start + col)` over its merged grid `(t, h / merge, w / merge)`, after which the running
    position advances by `max(h, w) / merge`.

    Args:
        pad_mask: `[Nt]` bool, True on image-pad rows; grid_thw: `[n, 3]` (t, h, w) in patches, one per pad run.

    Returns:
        `[3, Nt]` int64 CPU.

    Raises:
        ValueError: the pad runs do not match the grids.
    """
    mask = pad_mask.cpu().tolist()
    grids = [tuple(int(v) for v in g) for g in grid_thw.cpu()]
    pieces, position, start, image = [], 0, 0, 0
    while start < len(mask):
        end = start
        while end < len(mask) and mask[end] == mask[start]:
            end += 1
        if not mask[start]:
            pieces.append(torch.arange(end - start).view(1, -1).expand(3, -1) + position)
            position += end - start
        else:
            if image >= len(grids):
                raise ValueError(f"presentation has more image-pad runs than the {len(grids)} image grids")
            t, h, w = grids[image]
            gh, gw = h // merge_size, w // merge_size
            if end - start != t * gh * gw:
                raise ValueError(f"image {image + 1}: {end - start} pads for a {t}x{gh}x{gw} merged grid")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + position)
            position += max(h, w) // merge_size
            image += 1
        start = end
    if image != len(grids):
        raise ValueError(f"presentation has {image} image-pad runs for {len(grids)} image grids")
    return torch.cat(pieces, dim=1).to(torch.long)


def build_vision_tower(vision_config: Qwen3VLVisionConfig | Mapping[str, Any]) -> Qwen3VLVisionModel:
    """transformers' Qwen3-VL vision model (patch embed, learned + rotary positions, ViT blocks, merger, DeepStack
    mergers) with SDPA attention, eval mode. Parameter names are the checkpoint's `model.visual.*` minus `model.visual.`.
    """
    if not isinstance(vision_config, Qwen3VLVisionConfig):
        vision_config = Qwen3VLVisionConfig(**dict(vision_config))
    config = copy.deepcopy(vision_config)
    # Built outside a Qwen3VLForConditionalGeneration, so nothing else would pick the attention backend.
    config._attn_implementation = "sdpa"
    return Qwen3VLVisionModel(config).eval()


# preprocessor_config.json keys the Qwen2-VL image processor reads; the rest (`image_processor_type`,
# `processor_class`, video keys) say which class to pick, which is fixed here.
_IMAGE_PROCESSOR_KEYS = (
    "do_resize", "size", "min_pixels", "max_pixels", "resample", "do_rescale", "rescale_factor", "do_normalize",
    "image_mean", "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size",
)


def image_processor_from_dict(config: Mapping[str, Any]):
    """The keyframe image processor from a `preprocessor_config.json` dict (the checkpoint's `processor/`).

    Always transformers' PIL backend `Qwen2VLImageProcessorPil`, whatever class the file names, so the pixels do not
    depend on whether torchvision is installed (its backend resizes differently). Released H3 values (check against
    the file): patch 16, merge 2, temporal patch 2, `size` {shortest_edge 65536, longest_edge 16777216}, mean/std 0.5.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k in _IMAGE_PROCESSOR_KEYS})


def _vision_token_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for token in (VISION_START, VISION_END, IMAGE_PAD):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"tokenizer has no {token} token: fl2va needs Qwen3-VL's vision special tokens")
        ids[token] = int(token_id)
    return ids


def add_vision_tokens(tokenizer):
    """Add Qwen3-VL's four vision special tokens to a tokenizer that lacks them (the built-in tiny models' BPE
    tokenizer); they get the next free ids. Returns the tokenizer (modified in place)."""
    missing = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
    return tokenizer
