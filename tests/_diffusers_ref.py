"""Helpers shared by the parity tests: random native weights and the diffusers 0.42.1 reference built from them.

diffusers is a test-only dependency; h3render itself never imports it.
"""

from __future__ import annotations


import torch

from h3render.models.dit import DiT
from h3render.models.dit_config import DiTConfig
from h3render.spec import SPATIAL_COMPRESSION


@torch.no_grad()
def random_dit(cfg: DiTConfig, seed: int = 0) -> DiT:
    """A DiT whose every parameter is random and O(1)-scaled (norm weights around 1, linears ~ 1/sqrt(fan_in),
    biases and AdaLN outputs non-zero), so a swapped row, half or slot changes the output."""
    torch.manual_seed(seed)
    dit = DiT(cfg).float().eval()
    for name, p in dit.named_parameters():
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif p.ndim == 1:
            p.copy_(0.1 * torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return dit


def native_state_dict(dit: DiT) -> dict[str, torch.Tensor]:
    """Our state dict, which uses the official shards' native names and row orders."""
    return {k: v.detach().clone() for k, v in dit.state_dict().items()}


def diffusers_transformer(dit: DiT):
    """diffusers' `MiniMaxH3Transformer3DModel` loaded with `dit`'s weights through diffusers' own converter
    (`qkv_layout="interleaved"`: the official shards' per-head q k v rows), fp32, eval. Loading is strict, so a
    native name we got wrong fails here."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    from h3render.checkpoint.releases import dit_fields

    config = dit_fields(dit.cfg)  # diffusers' arguments (no FastH3 Trim `adaln_rank`)
    config["patch_size"] = tuple(config["patch_size"])
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        native_state_dict(dit), config, qkv_layout="interleaved"
    )
    ref = MiniMaxH3Transformer3DModel(**config).float().eval()
    missing, unexpected = ref.load_state_dict(converted, strict=True)
    assert not missing and not unexpected
    return ref


def diffusers_layout(text_len: int, height: int, width: int, frames: int):
    """diffusers' own t2va layout math (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`) for an all-text prompt.

    Returns:
        `(position_ids, token_tags, video_indices, audio_indices, text_indices)`.
    """
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags=torch.ones(text_len, dtype=torch.long),
        num_latent_frames=video_latent_num_frames(frames, 17, 5),
        latent_height=height // SPATIAL_COMPRESSION,
        latent_width=width // SPATIAL_COMPRESSION,
        num_audio_latents=audio_latent_num_frames(frames),
        patch_size=(1, 2, 2),
        audio_channels=2,
        audio_tag=2,
        video_tag=0,
        keyframe_anchors=(),
    )
    return out[:5]
