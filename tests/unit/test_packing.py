"""Packed t2va layout vs diffusers 0.42.1's own layout step (bit-exact), and pack/unpack round trips."""

import pytest
import torch

from h3render.packing import (
    audio_to_rows,
    patchify_video,
    rows_to_audio,
    step_timesteps,
    t2va_layout,
    unpatchify_video,
)
from tests._diffusers_ref import diffusers_layout

# (text_len, height, width, frames): 16:9 / 9:16 / 4:3 / 1:1 / 2:1 / 4:1 / tiny canvases, several lengths.
CASES = [
    (7, 768, 1344, 243),
    (300, 1344, 768, 124),
    (1, 768, 1024, 107),
    (53, 768, 768, 362),
    (19, 704, 1440, 22),
    (5, 64, 256, 5),
    (2000, 544, 960, 345),
    (3, 64, 64, 124),
]


@pytest.mark.parametrize("text_len,height,width,frames", CASES)
def test_layout_matches_diffusers_bit_exact(text_len, height, width, frames):
    ours = t2va_layout(text_len, height, width, frames)
    pos, tags, video_idx, audio_idx, text_idx = diffusers_layout(text_len, height, width, frames)
    assert ours.positions.dtype == torch.float64
    assert torch.equal(ours.positions, pos), (ours.positions - pos).abs().max()
    assert torch.equal(ours.token_tags, tags)
    assert torch.equal(ours.video_index, video_idx)
    assert torch.equal(ours.audio_index, audio_idx)
    assert torch.equal(ours.text_index, text_idx)
    assert ours.seq_len == pos.shape[0]


@pytest.mark.parametrize("text_len,height,width,frames", CASES[:4])
def test_step_timesteps_match_diffusers(text_len, height, width, frames):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    layout = t2va_layout(text_len, height, width, frames)
    for video_t, audio_t in [(0.0, 0.0), (0.25, 0.5), (0.9, 0.3), (0.1234567, 0.1234567)]:
        ts, idx = step_timesteps(layout, video_t, audio_t)
        ref_ts, ref_idx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_index, layout.audio_index, 0, 0, layout.text_len, video_t, audio_t, max(video_t, 0.999), 1.0
        )
        assert torch.equal(ts, ref_ts) and torch.equal(idx, ref_idx)
        # row_timestep_index with the sorted slots gives the same per-row index
        slots = {float(v): i for i, v in enumerate(ts)}
        v32, a32 = (float(torch.tensor(x, dtype=torch.float32)) for x in (video_t, audio_t))
        assert torch.equal(layout.row_timestep_index(slots[v32], slots[a32]), idx)
    assert step_timesteps(layout, 0.0, 0.0)[0].numel() == 1


def test_release_shapes_1344x768x243():
    layout = t2va_layout(30, 768, 1344, 243)
    assert (layout.latent_frames, layout.latent_height, layout.latent_width) == (72, 48, 84)
    assert layout.num_video_rows == 72576
    assert layout.num_audio_rows == 810 and layout.audio_len == 405
    assert layout.seq_len == 30 + 810 + 72576
    # text rows (i, 0, 0); first audio latent of each channel at t = text_len; video starts at text_len
    assert layout.positions[29].tolist() == [29.0, 0.0, 0.0]
    assert layout.positions[30, 0] == 30.0 and layout.positions[30 + 405, 0] == 30.0
    assert layout.positions[30 + 810, 0] == 30.0
    # second latent frame starts 5/3 later, the third 5/3 * 5 later
    rows = layout.rows_per_frame
    assert layout.positions[30 + 810 + rows, 0] == pytest.approx(30 + 5 / 3)
    assert layout.positions[30 + 810 + 2 * rows, 0] == pytest.approx(30 + 25 / 3)


@pytest.mark.parametrize("bad", [dict(frames=123), dict(height=700), dict(width=1000), dict(text_len=0)])
def test_layout_rejects_bad_input(bad):
    args = dict(text_len=4, height=768, width=1344, frames=124) | bad
    with pytest.raises(ValueError):
        t2va_layout(**args)


def test_video_patchify_round_trip_and_order():
    layout = t2va_layout(4, 64, 96, 22)  # latent [24, 7, 4, 6]
    latent = torch.randn(24, layout.latent_frames, layout.latent_height, layout.latent_width)
    rows = patchify_video(latent)
    assert rows.shape == (layout.num_video_rows, 96)
    assert torch.equal(unpatchify_video(rows, layout), latent)
    # row (t=1, h'=1, w'=2), value (c=5, kh=1, kw=0) is latent[5, 1, 3, 4]
    r = 1 * (2 * 3) + 1 * 3 + 2
    assert rows[r, 5 * 4 + 1 * 2 + 0] == latent[5, 1, 3, 4]


def test_video_patchify_matches_diffusers():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    latent = torch.randn(1, 24, 7, 4, 6)
    assert torch.equal(patchify_video(latent[0]), patchify_video_latents(latent, (1, 2, 2)))


def test_audio_rows_round_trip_channel_major():
    layout = t2va_layout(4, 64, 64, 124)
    latent = torch.randn(2, 32, layout.audio_len)
    rows = audio_to_rows(latent)
    assert rows.shape == (layout.num_audio_rows, 32)
    assert torch.equal(rows[3], latent[0, :, 3]) and torch.equal(rows[layout.audio_len + 3], latent[1, :, 3])
    assert torch.equal(rows_to_audio(rows, layout), latent)
