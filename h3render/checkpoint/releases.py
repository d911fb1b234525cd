"""The release registry: architectures, sigma shifts, frame limits and canvas rules of each MiniMax-H3 release
h3render knows ("released", and the built-in random "tiny" and "small"), and the Qwen3-VL conditioner configs.

A loaded checkpoint's own config files take precedence (`h3render.checkpoint.read_checkpoint_info`); the registry
describes the released architecture and the built-in random models. The released facts (24 fps, 17n + 5 frames,
shifts 12 / 3, 50 sigma points, the canvas rule) come from `h3render.spec`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from h3render.models.audio_vae_config import AUDIO_VAE_SMALL, AUDIO_VAE_TINY, AudioVAEConfig
from h3render.models.dit_config import DIT_SMALL, DIT_TINY, DiTConfig
from h3render.models.vae_tiling import RELEASED_TILING, TilingConfig
from h3render.models.video_vae_config import VIDEO_VAE_SMALL, VIDEO_VAE_TINY, VideoVAEConfig
from h3render.spec import (FPS, RELEASED_AUDIO_SHIFT, RELEASED_MAX_PIXELS, RELEASED_SHORT_EDGE, RELEASED_SIGMA_POINTS,
                           RELEASED_TRAINED_SECONDS, RELEASED_VIDEO_SHIFT, Limits, canvas_for_aspect, snap_frames_up)


# ---------------------------------------------------------------------------------------------------------------------
# Text encoder configs (kwargs of transformers `Qwen3VLConfig`).

# Qwen3-VL 32B, the released conditioner (check: the released `text_encoder/config.json` is authoritative and is
# what `read_checkpoint_info` uses; this entry only describes the registry's "released" architecture).
QWEN3VL_RELEASED: Mapping[str, Any] = {
    "text_config": {
        "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
        "patch_size": 16, "deepstack_visual_indexes": [8, 16, 24],
    },
}


# H3's keyframe image processor (`processor/preprocessor_config.json`; utensils/mold PR #1464 quotes the official
# size budget; patch, merge, temporal patch and mean/std are the Qwen3-VL defaults, research/conditioning.md §1.4).
QWEN3VL_PROCESSOR_RELEASED: Mapping[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
# The built-in models' processor: the released budget with the tiny towers' 8 px patches.
QWEN3VL_PROCESSOR_TINY: Mapping[str, Any] = {**QWEN3VL_PROCESSOR_RELEASED, "patch_size": 8}
# The ids of Qwen3-VL's vision special tokens in the built-in tokenizer (`checkpoint.builtin.tiny_vl_tokenizer(512)`:
# BPE ids 0..507, then <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>).
_TINY_VISION_TOKEN_IDS = {"vision_start_token_id": 508, "vision_end_token_id": 509, "image_token_id": 510,
                          "video_token_id": 511}


def _tiny_qwen3vl(hidden: int, layers: int, heads: int, head_dim: int, mrope: list[int]) -> dict[str, Any]:
    # The vision tower runs fl2va keyframes on CPU: 1 block, 8 px patches, its DeepStack tap after block 0.
    return {
        **_TINY_VISION_TOKEN_IDS,
        "text_config": {
            "vocab_size": 512, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": head_dim,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope,
                                "mrope_interleaved": True},
        },
        "vision_config": {
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": hidden,
            "patch_size": 8, "num_position_embeddings": 16, "deepstack_visual_indexes": [0],
        },
    }


# Tiny conditioner: 51 layers read at layer 50, so the un-normed inner read is exercised at the released index
# (diffusers 0.42.1 reads a hard-coded `hidden_states[50]`, `MiniMaxH3ModularPipeline.text_encoder_layer`: a
# make-checkpoint folder of 3 layers read at 2 was one diffusers could load but not encode with, issue #29);
# width = DIT_TINY.text_dim. 1.1 M parameters, about 1 ms per layer for a prompt on one CPU thread.
QWEN3VL_TINY = _tiny_qwen3vl(hidden=DIT_TINY.text_dim, layers=51, heads=4, head_dim=16, mrope=[2, 3, 3])
QWEN3VL_SMALL = _tiny_qwen3vl(hidden=DIT_SMALL.text_dim, layers=4, heads=4, head_dim=64, mrope=[8, 12, 12])


# ---------------------------------------------------------------------------------------------------------------------
# Release registry.


@dataclass(frozen=True)
class Release:
    """Everything h3render needs to know about one model release, besides its weights.

    Attributes:
        name: registry key ("released", "tiny", "small") or the checkpoint path for a loaded checkpoint.
        dit, video_vae, audio_vae: architectures.
        text_encoder: `Qwen3VLConfig` kwargs (`text_config`, `vision_config`) of the conditioner.
        text_read_layer: which hidden state conditions the DiT (released: 50 of 64).
        video_shift, audio_shift: sigma shifts (released: 12 and 3, `model_index.json`
            `_minimax_h3.sigma_shift_scales`).
        min_frames, max_frames: accepted snapped frame counts (released 107–362 = 4–15 s requested, model card and
            vLLM-Omni; the tiny models 22–362).
        canvas_short_edge, canvas_max_pixels: aspect-ratio canvas rule (released: 768 and 768 × 1344).
        default_canvas: (width, height) px for jobs naming no canvas: the canvas rule at 16:9.
        default_duration_s: seconds for jobs naming no duration; `default_frames` snaps it up to 17n + 5.
        sigma_points: sigma-grid points of the base sampler (released: 50 → 49 forwards).
        vae_tiling: spatial tiles of the video-VAE decode (released: 256 px, >= 64 px overlap).
        image_processor: the keyframe image processor's `preprocessor_config.json` dict (fl2va), or None when the
            checkpoint has none (t2va only).
        trained_seconds: the durations the weights were trained on (released 5–15 s), or None (random models).
        reference_short_edge: the short edge a ref2va image reference is resized to, upscaling included, no area
            cap (diffusers `reference_image_short_edge`; released 2048; the tiny model 64, to stay cheap).
    """

    name: str
    dit: DiTConfig
    video_vae: VideoVAEConfig
    audio_vae: AudioVAEConfig
    text_encoder: Mapping[str, Any] = field(repr=False)
    text_read_layer: int
    video_shift: float
    audio_shift: float
    min_frames: int
    max_frames: int
    canvas_short_edge: int
    canvas_max_pixels: int
    default_canvas: tuple[int, int]
    default_duration_s: float
    sigma_points: int
    vae_tiling: TilingConfig
    image_processor: Mapping[str, Any] | None = field(default=None, repr=False)
    trained_seconds: tuple[float, float] | None = None
    reference_short_edge: int = 2048

    @property
    def default_frames(self) -> int:
        """`default_duration_s` at 24 fps snapped up to 17n + 5 (released 5 s → 124; tiny 1 s → 39)."""
        return max(self.min_frames, snap_frames_up(round(self.default_duration_s * FPS)))

    @property
    def text_config(self):
        """The conditioner's `Qwen3VLTextConfig`."""
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig.from_dict(dict(self.text_encoder)).text_config

    def limits(self) -> Limits:
        """This release's `h3render.spec.Limits` (frame range, defaults, canvas rule)."""
        return Limits(min_frames=self.min_frames, max_frames=self.max_frames, default_canvas=self.default_canvas,
                      default_frames=self.default_frames, default_steps=self.sigma_points,
                      canvas_short_edge=self.canvas_short_edge, canvas_max_pixels=self.canvas_max_pixels,
                      trained_seconds=self.trained_seconds)

    def config_hash(self) -> str:
        """16 hex digits of SHA-256 over every config that changes the output (architectures, read layer, shifts,
        frame limits); equal hashes mean interchangeable checkpoints up to the weights."""
        payload = {
            "dit": dit_fields(self.dit), "video_vae": dataclasses.asdict(self.video_vae),
            "audio_vae": dataclasses.asdict(self.audio_vae), "text_encoder": _canonical_qwen3vl(self.text_encoder),
            "text_read_layer": self.text_read_layer, "shifts": [self.video_shift, self.audio_shift],
            "frames": [self.min_frames, self.max_frames],
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dit_fields(config: DiTConfig) -> dict:
    """A DiT config as its fields, without the optional ones left at None (`adaln_rank`, FastH3 Trim only): the
    hash and the written config.json of every config before that field existed stay as they were."""
    return {k: v for k, v in dataclasses.asdict(config).items() if not (k == "adaln_rank" and v is None)}


RELEASES: dict[str, Release] = {
    "released": Release(
        name="released", dit=DiTConfig(), video_vae=VideoVAEConfig(), audio_vae=AudioVAEConfig(),
        text_encoder=QWEN3VL_RELEASED, text_read_layer=50, video_shift=RELEASED_VIDEO_SHIFT,
        audio_shift=RELEASED_AUDIO_SHIFT, min_frames=107, max_frames=362, canvas_short_edge=RELEASED_SHORT_EDGE,
        canvas_max_pixels=RELEASED_MAX_PIXELS, default_canvas=canvas_for_aspect(16, 9), default_duration_s=5.0,
        sigma_points=RELEASED_SIGMA_POINTS, vae_tiling=RELEASED_TILING, image_processor=QWEN3VL_PROCESSOR_RELEASED,
        trained_seconds=RELEASED_TRAINED_SECONDS,
    ),
    # Tiny: a 1 s render on a 224×128 canvas in seconds on CPU; 8 sigma points (7 forwards) keep the README render
    # fast. 128 px tiles with 32 px overlap make the tiled decode run even on this small canvas (2 tiles wide).
    "tiny": Release(
        name="tiny", dit=DIT_TINY, video_vae=VIDEO_VAE_TINY, audio_vae=AUDIO_VAE_TINY,
        text_encoder=QWEN3VL_TINY, text_read_layer=50, video_shift=RELEASED_VIDEO_SHIFT,
        audio_shift=RELEASED_AUDIO_SHIFT,
        min_frames=22, max_frames=362, canvas_short_edge=128, canvas_max_pixels=128 * 224,
        default_canvas=(224, 128), default_duration_s=1.0, sigma_points=8,
        vae_tiling=TilingConfig(tile_height=128, tile_width=128, overlap_height=32, overlap_width=32),
        image_processor=QWEN3VL_PROCESSOR_TINY, reference_short_edge=64,
    ),
    # Small: more depth and width for GPU smoke runs of the full machinery at the released canvas sizes.
    "small": Release(
        name="small", dit=DIT_SMALL, video_vae=VIDEO_VAE_SMALL, audio_vae=AUDIO_VAE_SMALL,
        text_encoder=QWEN3VL_SMALL, text_read_layer=3, video_shift=RELEASED_VIDEO_SHIFT,
        audio_shift=RELEASED_AUDIO_SHIFT, min_frames=22, max_frames=362, canvas_short_edge=RELEASED_SHORT_EDGE,
        canvas_max_pixels=RELEASED_MAX_PIXELS, default_canvas=canvas_for_aspect(16, 9), default_duration_s=1.0,
        sigma_points=8, vae_tiling=RELEASED_TILING, image_processor=QWEN3VL_PROCESSOR_TINY,
    ),
}
BUILTIN = ("tiny", "small")  # registry entries with a built-in random model


# Bookkeeping keys of a transformers config that do not change what the model computes.
_CONFIG_BOOKKEEPING = {
    "transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "output_hidden_states",
    "output_attentions", "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "use_cache", "initializer_range", "tie_word_embeddings", "model_type",
}


def _canonical_qwen3vl(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen3-VL config dict normalized through transformers (defaults filled in, bookkeeping dropped), so the
    registry's short dicts and a checkpoint's full `config.json` hash alike."""
    from transformers import Qwen3VLConfig

    full = Qwen3VLConfig.from_dict(dict(config)).to_dict()
    out = {}
    for key in ("text_config", "vision_config"):
        out[key] = {k: _plain(v) for k, v in full[key].items() if k not in _CONFIG_BOOKKEEPING}
    return out


def _plain(obj: Any) -> Any:
    """JSON-able copy of nested mappings/sequences (tuples become lists)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
