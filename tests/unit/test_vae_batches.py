"""The video decode's batch size when compiled decoder blocks pad every short batch (`vae_tiling.even_batch`,
`VideoVAE.batch_for`, the warm-up's sizes): the fewest padded decoder slots, and the sizes warmed are the ones run."""

from types import SimpleNamespace

import pytest
import torch

import h3render.models.video_vae as video_vae
import h3render.parallel.vae as parallel_vae
from h3render import spec
from h3render.jobs import Job
from h3render.models.vae_tiling import even_batch
from h3render.models.video_vae import COMPILED_SHAPES, VideoVAE
from h3render.models.video_vae_config import VIDEO_VAE_TINY, VideoVAEConfig
from h3render.runner import distinct_setups
from h3render.settings import RunSettings
from h3render.warmup import WarmUp


def _slots(items: int, b: int) -> int:
    return -(-items // b) * b


def _warmed(vae, jobs, rank=0, world=1) -> set[tuple[int, int, int]]:
    """The (width, height, batch size) that `WarmUp` compiles for `jobs` on `rank` of `world` at `--vae-batch 8`."""
    owner = SimpleNamespace(c=SimpleNamespace(video_vae=vae), ctx=SimpleNamespace(rank=rank, world_size=world),
                            settings=RunSettings(vae_batch=8))
    return WarmUp._vae_batches(owner, jobs)


@pytest.mark.parametrize("items,most,expected", [
    (105, 8, 7),  # 960x544x124 on one GPU: 15 forwards of 7, where 8 pads 7 of 112 slots
    (392, 8, 8),  # 1344x768x243: 49 x 8, no pad (7 ties at 392: the larger, fewer forwards)
    (13, 8, 7),  # 14 slots against 16
    (5, 8, 5),  # under one batch: one forward of exactly the items
    (1, 8, 1),
    (9, 1, 1),
    (17, 4, 3),  # 18 slots, as 2 gives: the larger on a tie
    (0, 8, 1),
])
def test_even_batch_takes_the_fewest_slots(items, most, expected):
    assert even_batch(items, most) == expected


def test_even_batch_refuses_a_batch_size_under_one():
    with pytest.raises(ValueError, match="batch size must be >= 1, got 0"):
        even_batch(5, 0)


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
        return _warmed(vae, jobs, rank, world)

    plans = [vae.plan_decode(spec.latent_frames(f), h // 16, w // 16) for w, h, f in ((960, 544, 124),
                                                                                      (1344, 768, 243))]
    assert [(p.num_windows, p.tiles_per_window) for p in plans] == [(7, 15), (14, 28)]  # 105 and 392 items
    assert sizes(0, 1) == {(960, 544, 7), (1344, 768, 8)}
    assert sizes(0, 1, compiled=False) == {(960, 544, 8), (1344, 768, 8)}  # eager: a short batch runs short
    # two ranks: 8 + 7 of each 15-tile window (56 and 49 items: 8 and 7), 14 + 14 of each 28 (196 = 28 x 7; 8 pads 4)
    assert sizes(0, 2) == {(960, 544, 8), (1344, 768, 7)}
    assert sizes(1, 2) == {(960, 544, 7), (1344, 768, 7)}
    assert vae.batch_for(105, 8) == 7


def _decoded_sizes(vae, plan, monkeypatch, rank=0, world=1):
    """The batch sizes the decode of `plan` runs on `rank` of `world` (one GPU: `VideoVAE`'s own stream; several:
    `parallel.vae`'s), with the decoder, the stitch and the gather stubbed."""
    sizes = []

    def decode_items(latent, items, batch_size):
        sizes.append(batch_size)
        return [None] * len(items)

    monkeypatch.setattr(vae, "decode_items", decode_items)
    monkeypatch.setattr(video_vae, "stitch_window", lambda *a: None)
    monkeypatch.setattr(parallel_vae, "stitch_window", lambda *a: None)
    monkeypatch.setattr(parallel_vae, "_gather_tiles", lambda outs, n, shape, ctx: [None] * n)
    if world == 1:
        list(vae._stitched_windows(None, plan, 8))
    else:
        ctx = SimpleNamespace(rank=rank, world_size=world, is_main=rank == 0)
        list(parallel_vae._stitched_windows(vae, None, plan, ctx, 8))
    return set(sizes)


def test_the_decode_runs_the_sizes_the_warm_up_compiles(monkeypatch):
    with torch.device("meta"):
        vae = VideoVAE(VideoVAEConfig())
    vae.pad_batches = True
    jobs = [Job(id="a", prompt="p", width=960, height=544, frames=124, seed=0, steps=4, mode="t2va", output="a.mp4"),
            Job(id="b", prompt="p", width=1344, height=768, frames=243, seed=0, steps=4, mode="t2va", output="b.mp4")]
    for world in (1, 2, 3):
        for rank in range(world):
            warmed = _warmed(vae, jobs, rank, world)
            for job in jobs:
                plan = vae.plan_decode(spec.latent_frames(job.frames), job.height // 16, job.width // 16)
                run = _decoded_sizes(vae, plan, monkeypatch, rank, world)
                # every forward but the last runs the size; the last runs it padded (`decode_items`)
                assert run == {b for w, h, b in warmed if (w, h) == (job.width, job.height)}, (world, rank, job.id)


def test_distinct_setups_keeps_a_job_per_window_plan():
    # the windows' lengths set the decode's batch sizes and the audio graphs' lengths: two window plans of one
    # canvas and length are two setups to warm
    base = dict(prompt="p", width=960, height=544, frames=498, seed=0, steps=4, mode="t2va")
    jobs = [Job(id="a", output="a.mp4", window=124, overlap=22, **base),
            Job(id="b", output="b.mp4", window=158, overlap=22, **base),
            Job(id="c", output="c.mp4", window=158, overlap=22, **base), Job(id="d", output="d.mp4", **base)]
    with torch.device("meta"):
        vae = VideoVAE(VideoVAEConfig())
    vae.pad_batches = True
    assert _warmed(vae, jobs[:1]) != _warmed(vae, jobs[1:2])  # the premise
    assert [j.id for j in distinct_setups(jobs)] == ["a", "b", "d"]


def test_compiling_the_blocks_makes_room_for_every_batch_size():
    import torch._dynamo

    saved = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 8  # Dynamo's default
        VideoVAE(VIDEO_VAE_TINY).compile_blocks_(dynamic=False)  # (compiles lazily: nothing runs here)
        assert torch._dynamo.config.recompile_limit == COMPILED_SHAPES >= 8 * 8
    finally:
        torch._dynamo.config.recompile_limit = saved
