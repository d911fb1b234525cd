"""The fl2va chain after the text encoder vs diffusers 0.42.1's own modular blocks on the same tiny random weights:
keyframe VAE encode (`MiniMaxH3KeyframeVaeEncoderStep`), layout (`MiniMaxH3PrepareLayoutStep`), per-step timestep
plan (`MiniMaxH3SetTimestepsStep`), the first DiT forward with condition rows, and the final latents of a short
denoise through `MiniMaxH3FL2VACoreDenoiseStep` (keyframe noise drawn before the video and audio noise)."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from h3render.keyframes import keyframe_pixels
from h3render.models.dit_config import DIT_TINY
from h3render.models.vae_tiling import TilingConfig
from h3render.models.video_vae import VideoVAE
from h3render.models.video_vae_config import VIDEO_VAE_TINY
from h3render.packing import (
    ConditionedLayout,
    fl2va_layout,
    fl2va_step_timesteps,
    noise_keyframes,
    patchify_video,
    rows_to_audio,
    unpatchify_video,
)
from h3render.sampling import denoise, dit_model_fn, draw_noise, schedule_timesteps, sigma_schedule, timesteps_of
from h3render.spec import SPATIAL_COMPRESSION
from tests._diffusers_ref import diffusers_transformer, random_dit
from tests._numerics import assert_close, rel_err

pytest.importorskip("diffusers")

TOL = 1e-5
FRAMES = 124  # diffusers accepts 5-15 s
WIDTH, HEIGHT = 160, 96  # 2 encoder tiles wide at 128 px / 32 px overlap
LATENT_W, LATENT_H = WIDTH // SPATIAL_COMPRESSION, HEIGHT // SPATIAL_COMPRESSION
TILING = TilingConfig(tile_height=128, tile_width=128, overlap_height=32, overlap_width=32)
TAGS = torch.tensor([1] * 4 + [0] * 7 + [1] * 5)  # "<Picture 1>: " + vision block + prompt


@pytest.fixture(scope="module")
def vaes():
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    cfg = dataclasses.replace(VIDEO_VAE_TINY, latents_mean=tuple((0.1 * torch.randn(24)).tolist()),
                              latents_std=tuple((0.5 + torch.rand(24)).tolist()))
    ref = AutoencoderKLMiniMaxH3(**dataclasses.asdict(cfg)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            else:
                p.copy_((1 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.3 * torch.randn_like(p))
    ref.enable_tiling(TILING.tile_height, TILING.tile_width, TILING.overlap_height, TILING.overlap_width)
    ours = VideoVAE(cfg, TILING).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def dits():
    dit = random_dit(DIT_TINY, seed=3)
    return dit, diffusers_transformer(dit)


def _keyframes(n):
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)) for _ in range(n)]


def _diffusers_condition_latents(ref_vae, keyframes):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    pipe = MiniMaxH3KeyframeVaeEncoderStep().init_pipeline()
    pipe.update_components(vae=ref_vae)
    return pipe(keyframes=keyframes, output="condition_latents")


def test_condition_latents_match_diffusers(vaes):
    ref_vae, vae = vaes
    keyframes = _keyframes(2)
    with torch.no_grad():
        ref = _diffusers_condition_latents(ref_vae, keyframes)
        ours = [vae.encode_condition(keyframe_pixels(k)) for k in keyframes]
    for mine, theirs in zip(ours, ref):
        assert theirs.shape == (1, 24, 1, LATENT_H, LATENT_W) and mine.shape == theirs.shape[1:]
        assert_close(mine, theirs[0], TOL, "condition latent")
    # the posterior is sampled with its own seed-42 generator: the two keyframes differ, a re-encode does not
    assert rel_err(ours[0], ours[1]) > 0.1
    assert torch.equal(vae.encode_condition(keyframe_pixels(keyframes[0])), ours[0])


@pytest.mark.parametrize("anchors", [("first",), ("last",), ("first", "last"), ()])
def test_layout_matches_diffusers(anchors):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    frames = 243  # 72 latent frames: the pairwise and sequential span sums differ in the last ulp from 16 on
    layout = fl2va_layout(TAGS, HEIGHT, WIDTH, frames, anchors)
    ref = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags=TAGS, num_latent_frames=72, latent_height=LATENT_H, latent_width=LATENT_W,
        num_audio_latents=405, patch_size=(1, 2, 2), audio_channels=2, audio_tag=2, video_tag=0,
        keyframe_anchors=anchors)
    positions, tags, video_index, audio_index, text_index, n_cond, _ = ref
    assert torch.equal(layout.positions, positions)  # bit-exact float64
    assert torch.equal(layout.token_tags, tags)
    assert torch.equal(layout.video_index, video_index) and torch.equal(layout.audio_index, audio_index)
    assert torch.equal(layout.text_index, text_index)
    assert layout.num_condition_rows == n_cond == len(anchors) * (HEIGHT // 32) * (WIDTH // 32)
    moved = layout.to("cpu")
    assert isinstance(moved, ConditionedLayout) and moved.num_condition_rows == n_cond
    assert torch.equal(layout.target_layout().video_index, video_index[n_cond:])
    if "last" in anchors:
        t_last = layout.positions[layout.condition_index[-1], 0].item()
        assert abs(t_last - (TAGS.numel() + (frames - 1) * 5 / 3)) < 1e-9


@pytest.mark.parametrize("points", [3, 50])
def test_timestep_plan_matches_diffusers(points):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    layout = fl2va_layout(TAGS, HEIGHT, WIDTH, FRAMES, ("first", "last"))
    video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_sched.set_timesteps(points)
    audio_sched.set_timesteps(points)
    video_t, audio_t = timesteps_of(sigma_schedule(points, 12.0)), timesteps_of(sigma_schedule(points, 3.0))
    assert torch.equal(video_t, video_sched.timesteps) and torch.equal(audio_t, audio_sched.timesteps)
    table = schedule_timesteps(sigma_schedule(points, 12.0), sigma_schedule(points, 3.0), keyframes=True)
    for step, (tv, ta) in enumerate(zip(video_t, audio_t)):
        ref_t, ref_index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_index, layout.audio_index, layout.num_condition_rows, 0, layout.text_len,
            float(tv), float(ta), max(float(tv), 0.999), 1.0)
        ours_t, ours_index = fl2va_step_timesteps(layout, tv, ta)
        assert torch.equal(ours_t, ref_t) and torch.equal(ours_index, ref_index)
        assert ours_t.numel() == (2 if step == 0 else 3)
        # what the DiT reads: the same per-row values through the modulation-table slots
        slot = {float(t): int((table == t).nonzero()) for t in ref_t}
        index = layout.row_timestep_index(slot[float(tv)], slot[float(ta)], slot[float(torch.tensor(0.999))])
        assert torch.equal(table[index], ref_t[ref_index])


def _diffusers_fl2va(transformer, text, tags, anchors, condition_latents, steps, seed):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep

    pipe = MiniMaxH3FL2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    out = pipe(prompt_embeds=text[None], text_token_tags=tags, keyframe_anchors=anchors,
               condition_latents=condition_latents, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
               num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
               output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


def _ours_setup(dit, anchors, latents, steps, seed):
    layout = fl2va_layout(TAGS, HEIGHT, WIDTH, FRAMES, anchors)
    generator = torch.Generator("cpu").manual_seed(seed)
    condition_rows = noise_keyframes(latents, generator)  # drawn first
    video_noise, audio_rows = draw_noise(generator, layout)  # then video, then audio
    video_sigmas, audio_sigmas = sigma_schedule(steps, 12.0), sigma_schedule(steps, 3.0)
    tables = dit.modulation_tables(schedule_timesteps(video_sigmas, audio_sigmas, keyframes=True))
    return layout, condition_rows, video_noise, audio_rows, video_sigmas, audio_sigmas, tables


def test_first_forward_matches_diffusers(vaes, dits):
    _, vae = vaes
    dit, ref = dits
    anchors = ("first", "last")
    latents = [vae.encode_condition(keyframe_pixels(k)) for k in _keyframes(2)]
    text = torch.randn(TAGS.numel(), DIT_TINY.text_dim, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        layout, cond, video_noise, audio_rows, vs, as_, tables = _ours_setup(dit, anchors, latents, 3, 4)
        rows = torch.cat([cond, patchify_video(video_noise[0])])
        step_t, step_index = fl2va_step_timesteps(layout, 1 - vs[1], 1 - as_[1])  # step 1: 3 distinct values
        index = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]),
                                          tables.index_of(0.999))
        ours_v, ours_a = dit(rows, audio_rows, text, layout, tables, index)
        ref_v, ref_a = ref(hidden_states=rows[None], audio_hidden_states=audio_rows[None],
                           encoder_hidden_states=text[None], timestep=step_t, timestep_indices=step_index,
                           token_tags=layout.token_tags, position_ids=layout.positions,
                           video_indices=layout.video_index, audio_indices=layout.audio_index,
                           text_indices=layout.text_index, return_dict=False)
    ev, ea = rel_err(ours_v, ref_v[0]), rel_err(ours_a, ref_a[0])
    print(f"fl2va first forward: video rel err {ev:.2e}, audio {ea:.2e}")
    assert ours_v.shape == (layout.num_condition_rows + layout.num_target_video_rows, 96)
    assert ev <= TOL and ea <= TOL
    # the condition rows' timestep matters: running them at t_video instead changes the output
    plain = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]),
                                      tables.index_of(1 - vs[1]))
    with torch.no_grad():
        other_v, _ = dit(rows, audio_rows, text, layout, tables, plain)
    assert rel_err(other_v, ours_v) > 1e-3


@pytest.mark.parametrize("anchors,seed", [(("first",), 7), (("last",), 8), (("first", "last"), 11)])
def test_denoise_matches_diffusers(vaes, dits, anchors, seed):
    ref_vae, vae = vaes
    dit, ref = dits
    steps = 3  # sigma points: 2 forwards
    keyframes = _keyframes(len(anchors))
    text = torch.randn(TAGS.numel(), DIT_TINY.text_dim, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref_latents = _diffusers_condition_latents(ref_vae, keyframes)
        ref_video, ref_audio = _diffusers_fl2va(ref, text, TAGS, anchors, ref_latents, steps, seed)

        latents = [vae.encode_condition(keyframe_pixels(k)) for k in keyframes]
        layout, cond, video_noise, audio_rows, vs, as_, tables = _ours_setup(dit, anchors, latents, steps, seed)
        assert isinstance(layout, ConditionedLayout)
        fixed = cond.clone()
        video_rows, audio_rows = denoise(dit_model_fn(dit, text, layout, tables, condition_rows=cond),
                                         patchify_video(video_noise[0]), audio_rows, vs, as_)
        target = layout.target_layout()
        video = unpatchify_video(video_rows, target)[None]
        audio = rows_to_audio(audio_rows, target)

    assert torch.equal(cond, fixed)  # never written
    assert video.shape == ref_video.shape == (1, 24, 37, LATENT_H, LATENT_W)
    assert audio.shape == ref_audio.shape == (2, 32, 207)
    ev, ea = rel_err(video, ref_video), rel_err(audio, ref_audio)
    print(f"fl2va chain {anchors}: video rel err {ev:.2e}, audio {ea:.2e}")
    assert ev <= TOL and ea <= TOL
    assert rel_err(video, video_noise) > 0.1
