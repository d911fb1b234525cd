"""The video decode's batch size when compiled decoder blocks pad every short batch (`vae_tiling.even_batch`,
`VideoVAE.batch_for`, the warm-up's sizes): the fewest padded decoder slots, and the sizes warmed are the ones run."""

from types import SimpleNamespace

import pytest
import torch

from h3render import spec
from h3render.jobs import Job
from h3render.models.vae_tiling import even_batch
from h3render.models.video_vae import VideoVAE
from h3render.models.video_vae_config import VideoVAEConfig
from h3render.settings import RunSettings
from h3render.warmup import WarmUp


def _slots(items: int, b: int) -> int:
    return -(-items // b) * b


@pytest.mark.parametrize("items,most,expected", [
    (105, 8, 7),  # 960x544x124 on one GPU: 15 forwards of 7, where 8 pads 7 of 112 slots
    (392, 8, 8),  # 1344x768x243: 49 x 8, no pad (7 ties at 392: the larger, fewer forwards)
    (13, 8, 7),  # 14 slots against 16
    (5, 8, 5),  # under one batch: one forward of exactly the items
    (1, 8, 1),
    (9, 1, 1),
    (17, 4, 3),  # 18 slots; 2 is under half of 4, not tried (it would be 18 too)
])
def test_even_batch_takes_the_fewest_slots(items, most, expected):
    assert even_batch(items, most) == expected


def test_even_batch_never_pads_more_than_the_largest_size():
    for most in range(1, 17):
        for items in range(1, 400):
            b = even_batch(items, most)
            assert 1 <= b <= most and _slots(items, b) <= _slots(items, most), (items, most)
            assert items <= most or 2 * b >= most, (items, most)


def test_the_warm_up_compiles_the_sizes_the_decode_runs():
    with torch.device("meta"):
        vae = VideoVAE(VideoVAEConfig())  # the released geometry: 256 px tiles, 64 px overlap
    jobs = [Job(id=f"j{i}", prompt="p", width=w, height=h, frames=f, seed=0, steps=4, mode="t2va", output=f"{i}.mp4")
            for i, (w, h, f) in enumerate(((960, 544, 124), (1344, 768, 243), (960, 544, 124)))]

    def sizes(rank, world, compiled=True):
        vae.pad_batches = compiled
        owner = SimpleNamespace(c=SimpleNamespace(video_vae=vae), ctx=SimpleNamespace(rank=rank, world_size=world),
                                settings=RunSettings(vae_batch=8))
        return WarmUp._vae_batches(owner, jobs)

    plans = [vae.plan_decode(spec.latent_frames(f), h // 16, w // 16) for w, h, f in ((960, 544, 124),
                                                                                      (1344, 768, 243))]
    assert [(p.num_windows, p.tiles_per_window) for p in plans] == [(7, 15), (14, 28)]  # 105 and 392 items
    assert sizes(0, 1) == {(960, 544, 7), (1344, 768, 8)}
    assert sizes(0, 1, compiled=False) == {(960, 544, 8), (1344, 768, 8)}  # eager: a short batch runs short
    # two ranks: 8 + 7 of each 15-tile window (56 and 49 items: 8 and 7), 14 + 14 of each 28 (196 = 28 x 7; 8 pads 4)
    assert sizes(0, 2) == {(960, 544, 8), (1344, 768, 7)}
    assert sizes(1, 2) == {(960, 544, 7), (1344, 768, 7)}
    assert vae.batch_for(105, 8) == 7
