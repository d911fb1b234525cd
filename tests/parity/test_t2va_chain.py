"""The whole t2va chain (layout -> noise -> schedules -> denoise loop -> unpack) vs diffusers 0.42.1's modular
`MiniMaxH3CoreDenoiseStep` with the same tiny transformer, seed and CPU generator. diffusers gets `prompt_embeds`
and `text_token_tags` directly (its Qwen3-VL processor needs torchvision)."""

import pytest
import torch

from h3render.models.dit_config import DIT_TINY
from h3render.packing import patchify_video, rows_to_audio, t2va_layout, unpatchify_video
from h3render.sampling import denoise, dit_model_fn, draw_noise, schedule_timesteps, sigma_schedule
from h3render.spec import SPATIAL_COMPRESSION
from tests._diffusers_ref import diffusers_transformer, random_dit
from tests._numerics import rel_err

TOL = 1e-5


def diffusers_t2va(transformer, prompt_embeds, height, width, frames, steps, seed):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer=transformer,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    out = pipe(
        prompt_embeds=prompt_embeds[None],
        text_token_tags=torch.ones(prompt_embeds.shape[0], dtype=torch.long),
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output=["latents", "audio_latents"],
    )
    return out["latents"], out["audio_latents"]


@pytest.mark.parametrize("height,width,seed", [(64, 64, 7), (64, 128, 11)])
def test_t2va_chain_matches_diffusers(height, width, seed):
    frames, steps, text_len = 124, 5, 6
    dit = random_dit(DIT_TINY, seed=seed)
    ref = diffusers_transformer(dit)
    text = torch.randn(text_len, DIT_TINY.text_dim, generator=torch.Generator().manual_seed(seed))

    with torch.no_grad():
        ref_video, ref_audio = diffusers_t2va(ref, text, height, width, frames, steps, seed)

        layout = t2va_layout(text_len, height, width, frames)
        video_noise, audio_rows = draw_noise(seed, layout)
        video_sigmas, audio_sigmas = sigma_schedule(steps, 12.0), sigma_schedule(steps, 3.0)
        tables = dit.modulation_tables(schedule_timesteps(video_sigmas, audio_sigmas))
        dit.drop_adaln_weights_()
        video_rows, audio_rows = denoise(
            dit_model_fn(dit, text, layout, tables), patchify_video(video_noise[0]), audio_rows,
            video_sigmas, audio_sigmas,
        )
        video = unpatchify_video(video_rows, layout)[None]
        audio = rows_to_audio(audio_rows, layout)

    assert video.shape == ref_video.shape == (1, 24, 37, height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION)
    assert audio.shape == ref_audio.shape == (2, 32, 207)
    ev, ea = rel_err(video, ref_video), rel_err(audio, ref_audio)
    print(f"t2va chain {width}x{height}x{frames}, {steps} points: video rel err {ev:.2e}, audio rel err {ea:.2e}")
    assert ev <= TOL and ea <= TOL
    # the run moved away from the noise: a chain that skipped the model would not match
    assert rel_err(video, video_noise) > 0.1
