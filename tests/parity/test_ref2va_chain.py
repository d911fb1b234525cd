"""The ref2va chain after the encoders vs diffusers 0.42.1's own modular blocks on the same tiny random weights:
layout (`MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`), per-step timestep plan
(`MiniMaxH3SetTimestepsStep`), the first DiT forward with reference rows, and the final latents of a short denoise
through `MiniMaxH3Ref2VACoreDenoiseStep` (one noise draw per visual reference before the target noise; reference
audio never noised, at t = 1.0)."""

import numpy as np
import pytest
import torch

from h3render.models.dit_config import DIT_TINY
from h3render.packing import (
    REFERENCE_AUDIO_T,
    ConditionedLayout,
    noise_conditions,
    patchify_video,
    rows_to_audio,
    unpatchify_video,
)
from h3render.ref_packing import ReferenceBlock, ref2va_layout, ref2va_step_timesteps
from h3render.sampling import denoise, dit_model_fn, draw_noise, schedule_timesteps, sigma_schedule
from tests._diffusers_ref import diffusers_transformer, random_dit
from tests._numerics import rel_err

pytest.importorskip("diffusers")

TOL = 1e-5
FRAMES = 124  # 37 latent frames, 207 audio latents
WIDTH, HEIGHT = 128, 64
TAGS = torch.tensor([1] * 3 + [0] * 5 + [1] * 4 + [0] * 6 + [1] * 5)

# Reference sets (kind, visual latent grid, audio latents): the [video+sound, image, audio, image] order of the
# research note's test list, the same references reordered, and single-reference requests.
IMAGE_A = ReferenceBlock("image", 1, 4, 6)
IMAGE_B = ReferenceBlock("image", 1, 6, 4)  # portrait: its own grid
VIDEO_SOUND = ReferenceBlock("video", 7, 4, 8, audio_latents=37)  # 22 frames -> 7 latents; 0.92 s of sound
VIDEO_SILENT = ReferenceBlock("video", 2, 8, 4)
LONG_SOUND = ReferenceBlock("video", 2, 4, 4, audio_latents=30)  # sound longer than the 2-latent video's span
CLIP = ReferenceBlock("audio", audio_latents=21)
MIXED = [VIDEO_SOUND, IMAGE_A, CLIP, IMAGE_B]
REORDERED = [IMAGE_B, CLIP, IMAGE_A, VIDEO_SOUND]


def _diffusers_references(blocks):
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    out = []
    for b in blocks:
        if b.kind == "image":
            out.append(MiniMaxH3ImageReference(image=np.zeros((8, 8, 3), np.uint8)))
        elif b.kind == "audio":
            out.append(MiniMaxH3AudioReference(audio=torch.zeros(2, 8)))
        else:
            out.append(MiniMaxH3VideoReference(frames=np.zeros((1, 8, 8, 3), np.uint8),
                                               audio=torch.zeros(2, 8) if b.audio_latents else None))
    return out


def _latents(blocks, seed):
    g = torch.Generator().manual_seed(seed)
    video = [torch.randn(1, 24, b.latent_frames, b.latent_height, b.latent_width, generator=g)
             for b in blocks if b.kind != "audio"]
    audio = [torch.randn(2 * b.audio_latents, 32, generator=g) for b in blocks if b.audio_latents]
    return video, audio


def _diffusers_layout(blocks):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    video, audio = _latents(blocks, 0)
    return MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        TAGS, _diffusers_references(blocks), video, audio, num_latent_frames=37, latent_height=HEIGHT // 16,
        latent_width=WIDTH // 16, num_audio_latents=207, patch_size=(1, 2, 2), audio_channels=2, audio_tag=2,
        video_tag=0)


@pytest.mark.parametrize("blocks", [[IMAGE_A], [IMAGE_A, CLIP], [VIDEO_SOUND], [VIDEO_SILENT], [LONG_SOUND, CLIP],
                                    MIXED, REORDERED], ids=["image", "image+audio", "video+sound", "video",
                                                            "long-sound+audio", "mixed", "reordered"])
def test_layout_matches_diffusers(blocks):
    layout = ref2va_layout(TAGS, blocks, HEIGHT, WIDTH, FRAMES)
    positions, tags, video_index, audio_index, text_index, n_video, n_audio = _diffusers_layout(blocks)
    assert torch.equal(layout.positions, positions)  # bit-exact float64
    assert torch.equal(layout.token_tags, tags)
    assert torch.equal(layout.video_index, video_index) and torch.equal(layout.audio_index, audio_index)
    assert torch.equal(layout.text_index, text_index)
    assert (layout.num_condition_rows, layout.num_condition_audio_rows) == (n_video, n_audio)
    assert isinstance(layout.to("cpu"), ConditionedLayout) and layout.to("cpu").num_condition_audio_rows == n_audio
    target = layout.target_layout()
    assert target.num_video_rows == 37 * (HEIGHT // 32) * (WIDTH // 32) and target.num_audio_rows == 2 * 207


def test_mixed_clock_and_order():
    """The clock each reference advances, read off the layout: the video+sound block starts at L, the image after it
    at L + max(37, span of 7 latent frames = 5/3 * 25), the clip at +1, the second image at +21, the target at +1."""
    layout = ref2va_layout(TAGS, MIXED, HEIGHT, WIDTH, FRAMES)
    L = TAGS.numel()
    t = layout.positions[:, 0]
    span = sum(5 / 3 * (1, 4, 4, 4, 4)[k % 5] for k in range(7))
    first_image = L + 74 + 56  # after the soundtrack (2 x 37 rows) and the video (7 x 2 x 4 rows)
    assert t[L] == L and t[first_image] == L + max(37.0, span)
    assert t[layout.target_audio_index[0]] == L + max(37.0, span) + 1 + 21 + 1
    reordered = ref2va_layout(TAGS, REORDERED, HEIGHT, WIDTH, FRAMES)
    assert reordered.seq_len == layout.seq_len and not torch.equal(reordered.positions, layout.positions)
    with pytest.raises(ValueError, match="audio references alone"):
        ref2va_layout(TAGS, [CLIP], HEIGHT, WIDTH, FRAMES)


@pytest.mark.parametrize("points", [3, 50])
def test_timestep_plan_matches_diffusers(points):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    from h3render.tasks.ref2va import timesteps as ref2va_timesteps

    layout = ref2va_layout(TAGS, MIXED, HEIGHT, WIDTH, FRAMES)
    video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_sched.set_timesteps(points)
    audio_sched.set_timesteps(points)
    from h3render.sampling import Schedule

    schedule = Schedule.base(points, 12.0, 3.0)
    table = ref2va_timesteps(schedule)
    for step, (tv, ta) in enumerate(zip(video_sched.timesteps, audio_sched.timesteps)):
        ref_t, ref_index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_index, layout.audio_index, layout.num_condition_rows, layout.num_condition_audio_rows,
            layout.text_len, float(tv), float(ta), max(float(tv), 0.999), 1.0)
        ours_t, ours_index = ref2va_step_timesteps(layout, tv, ta)
        assert torch.equal(ours_t, ref_t) and torch.equal(ours_index, ref_index)
        assert ours_t.numel() == (3 if step == 0 else 4) and float(ours_t[-1]) == 1.0
        slot = {float(t): int((table == t).nonzero()) for t in ref_t}
        index = layout.row_timestep_index(slot[float(tv)], slot[float(ta)], slot[float(torch.tensor(0.999))],
                                          slot[REFERENCE_AUDIO_T])
        assert torch.equal(table[index], ref_t[ref_index])


@pytest.fixture(scope="module")
def dits():
    dit = random_dit(DIT_TINY, seed=5)
    return dit, diffusers_transformer(dit)


def _ours(dit, blocks, video_latents, audio_latents, steps, seed):
    layout = ref2va_layout(TAGS, blocks, HEIGHT, WIDTH, FRAMES)
    generator = torch.Generator("cpu").manual_seed(seed)
    cond = noise_conditions([v[0] for v in video_latents], generator)  # drawn first, one per visual reference
    video_noise, audio_rows = draw_noise(generator, layout.target_layout())
    audio_cond = torch.cat(audio_latents) if audio_latents else None
    vs, as_ = sigma_schedule(steps, 12.0), sigma_schedule(steps, 3.0)
    timesteps = torch.unique(torch.cat([schedule_timesteps(vs, as_, keyframes=True), torch.tensor([1.0])]))
    return layout, cond, audio_cond, video_noise, audio_rows, vs, as_, dit.modulation_tables(timesteps)


def test_first_forward_matches_diffusers(dits):
    dit, ref = dits
    video_latents, audio_latents = _latents(MIXED, 3)
    text = torch.randn(TAGS.numel(), DIT_TINY.text_dim, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        layout, cond, audio_cond, video_noise, audio_rows, vs, as_, tables = _ours(dit, MIXED, video_latents,
                                                                                    audio_latents, 3, 4)
        rows = torch.cat([cond, patchify_video(video_noise[0])])
        audio = torch.cat([audio_cond, audio_rows])
        step_t, step_index = ref2va_step_timesteps(layout, 1 - vs[1], 1 - as_[1])  # 4 distinct values
        index = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]),
                                          tables.index_of(0.999), tables.index_of(1.0))
        ours_v, ours_a = dit(rows, audio, text, layout, tables, index)
        ref_v, ref_a = ref(hidden_states=rows[None], audio_hidden_states=audio[None],
                           encoder_hidden_states=text[None], timestep=step_t, timestep_indices=step_index,
                           token_tags=layout.token_tags, position_ids=layout.positions,
                           video_indices=layout.video_index, audio_indices=layout.audio_index,
                           text_indices=layout.text_index, return_dict=False)
        # the reference audio's timestep matters: running it with the target audio changes the output
        plain = layout.row_timestep_index(tables.index_of(1 - vs[1]), tables.index_of(1 - as_[1]),
                                          tables.index_of(0.999), tables.index_of(1 - as_[1]))
        _, other_a = dit(rows, audio, text, layout, tables, plain)
    ev, ea = rel_err(ours_v, ref_v[0]), rel_err(ours_a, ref_a[0])
    print(f"ref2va first forward: video rel err {ev:.2e}, audio {ea:.2e}")
    assert ev <= TOL and ea <= TOL
    assert rel_err(other_a[layout.num_condition_audio_rows:], ours_a[layout.num_condition_audio_rows:]) > 1e-4


def _diffusers_ref2va(transformer, text, blocks, video_latents, audio_latents, steps, seed):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Ref2VACoreDenoiseStep

    pipe = MiniMaxH3Ref2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer_ref=transformer, scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    out = pipe(prompt_embeds=text[None], text_token_tags=TAGS, normalized_references=_diffusers_references(blocks),
               condition_latents=video_latents, audio_condition_latents=audio_latents, height=HEIGHT, width=WIDTH,
               num_frames=FRAMES, num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
               output=["latents", "audio_latents"])
    return out["latents"], out["audio_latents"]


def test_denoise_matches_diffusers(dits):
    dit, ref = dits
    blocks, seed = MIXED, 7  # every kind of block; the single-reference layouts are checked above
    steps = 3  # sigma points: 2 forwards
    video_latents, audio_latents = _latents(blocks, seed)
    text = torch.randn(TAGS.numel(), DIT_TINY.text_dim, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref_video, ref_audio = _diffusers_ref2va(ref, text, blocks, video_latents, [a.clone() for a in audio_latents],
                                                 steps, seed)
        layout, cond, audio_cond, video_noise, audio_rows, vs, as_, tables = _ours(dit, blocks, video_latents,
                                                                                    audio_latents, steps, seed)
        fixed = None if audio_cond is None else audio_cond.clone()
        video_rows, audio_rows = denoise(dit_model_fn(dit, text, layout, tables, condition_rows=cond,
                                                      audio_condition_rows=audio_cond),
                                         patchify_video(video_noise[0]), audio_rows, vs, as_)
        target = layout.target_layout()
        video = unpatchify_video(video_rows, target)[None]
        audio = rows_to_audio(audio_rows, target)
    assert fixed is None or torch.equal(audio_cond, fixed)  # reference audio never written
    assert video.shape == ref_video.shape == (1, 24, 37, HEIGHT // 16, WIDTH // 16)
    assert audio.shape == ref_audio.shape == (2, 32, 207)
    ev, ea = rel_err(video, ref_video), rel_err(audio, ref_audio)
    print(f"ref2va chain: video rel err {ev:.2e}, audio {ea:.2e}")
    assert ev <= TOL and ea <= TOL
    assert rel_err(video, video_noise) > 0.1
