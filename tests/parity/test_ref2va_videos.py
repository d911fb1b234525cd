"""ref2va video references, the steps h3render has so far, vs diffusers 0.42.1 on the same files: PyAV decode
(`_decode_video_file`: frames, frame rate, soundtrack), the 24 fps slot resample, cut and canvas
(`MiniMaxH3Ref2VASetupStep._normalize_video_condition`: 24 fps untouched, 30 fps resampled, portrait on its own
canvas, longer than the target cut), and the snap to 17n + 5 frames before the video VAE encode. Frames must be
bit-equal. (The conditioner's video presentation, which needs torchvision, is not in h3render yet.)"""

import numpy as np
import pytest
import torch

from h3render.checkpoint.releases import RELEASES
from h3render.references import decode_audio, decode_video, encode_frames, normalize_video
from tests._media import mp4

pytest.importorskip("diffusers")

TINY = RELEASES["tiny"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {"24": mp4(d / "v24.mp4", frames=30, fps=24, size=(96, 64)),  # 3:2 -> its own canvas
            "30": mp4(d / "v30.mp4", frames=30, fps=30, size=(96, 64), sound_rate=None),
            "portrait": mp4(d / "p.mp4", frames=24, fps=24, size=(64, 112), sound_rate=44100, channels=1)}


@pytest.mark.parametrize("name,num_frames", [("24", 22), ("30", 124), ("portrait", 124)])
def test_decode_and_normalize_match_diffusers(videos, name, num_frames):
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.references import _decode_video_file

    frames, fps, their_sound, their_rate = _decode_video_file(str(videos[name]))
    mine, my_fps = decode_video(videos[name])
    assert my_fps == fps and np.array_equal(mine, frames)
    if their_sound is not None:
        sound, rate = decode_audio(videos[name])
        assert rate == their_rate and torch.equal(sound, their_sound)
    theirs = MiniMaxH3Ref2VASetupStep._normalize_video_condition(
        frames, fps, num_frames, 32, TINY.canvas_short_edge, TINY.canvas_max_pixels, 24.0)
    ours = normalize_video(mine, my_fps, num_frames, short_edge=TINY.canvas_short_edge,
                           max_pixels=TINY.canvas_max_pixels)
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
    if name == "30":
        assert ours.shape[0] == 24  # 30 frames at 30 fps -> 24 at 24 fps
    if name == "24":
        assert ours.shape[0] == 22  # cut to the target
    if name == "portrait":
        assert ours.shape[1] > ours.shape[2]  # its own (portrait) canvas, not the target's


def test_encode_frames_snap():
    assert [encode_frames(n) for n in (13, 17, 18, 21, 22, 38, 39, 124, 243)] == [13, 17, 18, 21, 22, 22, 39, 124,
                                                                                     243]
    # diffusers' own arithmetic in MiniMaxH3Ref2VAReferenceEncoderStep (frames[:n] keeps a shorter clip whole)
    assert all(encode_frames(n) == len(range(n)[: max(1, (n - 5) // 17) * 17 + 5]) for n in range(13, 400))
