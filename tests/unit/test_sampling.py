"""Sigma schedules, Euler step, noise and the denoising loop vs diffusers 0.42.1 `MiniMaxH3Scheduler` and
`MiniMaxH3PrepareLatentsStep`, plus the loop with a fake model."""

import pytest
import torch

from h3render.packing import patchify_video, t2va_layout
from h3render.sampling import (
    denoise,
    draw_noise,
    euler_step,
    schedule_timesteps,
    shifted_sigmas,
    sigma_schedule,
    timesteps_of,
)


def reference_scheduler(num_points, shift):
    from diffusers import MiniMaxH3Scheduler

    s = MiniMaxH3Scheduler(shift=shift)
    s.set_timesteps(num_points)
    return s


@pytest.mark.parametrize("num_points", [50, 5, 2])
@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_sigma_schedule_matches_diffusers(num_points, shift):
    ref = reference_scheduler(num_points, shift)
    ours = sigma_schedule(num_points, shift)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref.sigmas), (ours - ref.sigmas).abs().max()
    assert torch.equal(timesteps_of(ours), ref.timesteps)
    assert ours.numel() - 1 == ref.timesteps.numel()  # N points -> N - 1 forwards (no duplicates at these N)
    assert ours[0] == 1.0 and ours[-1] == 0.0


def test_sigma_schedule_values_and_errors():
    s = sigma_schedule(5, 12.0)
    # 0.75 -> 12*.75/(1+11*.75) = 9/9.25
    assert float(s[1]) == pytest.approx(9 / 9.25, rel=1e-6)
    with pytest.raises(ValueError):
        sigma_schedule(1, 12.0)
    with pytest.raises(ValueError):
        sigma_schedule(5, 0.0)


def test_shifted_sigmas_fasth3_positions():
    pos = (0.999, 0.749, 0.5, 0.25, 0.0)
    ours = shifted_sigmas(pos, 12.0)
    ref = reference_scheduler(5, 12.0)
    ref_shifted = 12.0 * torch.tensor(pos) / (1 + 11.0 * torch.tensor(pos))
    assert torch.equal(ours, ref_shifted)
    ref.set_timesteps(sigmas=ours)  # the reference accepts it as a valid explicit schedule
    assert torch.equal(ref.sigmas, ours)
    assert float(ours[0]) == pytest.approx(12 * 0.999 / (1 + 11 * 0.999), rel=1e-6)
    with pytest.raises(ValueError):
        shifted_sigmas((1.0, 0.5, 0.6, 0.0), 12.0)
    with pytest.raises(ValueError):
        shifted_sigmas((1.0, 0.5), 12.0)


def test_euler_step_matches_scheduler_step():
    ref = reference_scheduler(7, 3.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g)
    sigmas = sigma_schedule(7, 3.0)
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(40, 32, generator=g)
        expect = ref.step(v, t, x, return_dict=False)[0]
        got = euler_step(x, v, sigmas[i], sigmas[i + 1])
        assert torch.equal(got, expect), i
        # and it is the data-ward Euler update x + (sigma - sigma_next) * v (not flux's sign)
        assert torch.allclose(got, x + (sigmas[i] - sigmas[i + 1]) * v, atol=1e-5)
        x = got


def test_draw_noise_matches_prepare_latents_step():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.utils.torch_utils import randn_tensor

    layout = t2va_layout(5, 64, 96, 22)
    video, audio = draw_noise(1234, layout)
    g = torch.Generator("cpu").manual_seed(1234)
    ref_video = randn_tensor((1, 24, 7, 4, 6), generator=g, device=torch.device("cpu"), dtype=torch.float32)
    ref_audio = randn_tensor((layout.num_audio_rows, 32), generator=g, device=torch.device("cpu"),
                             dtype=torch.float32)
    assert video.shape == (1, 24, layout.latent_frames, layout.latent_height, layout.latent_width)
    assert torch.equal(video, ref_video) and torch.equal(audio, ref_audio)
    assert torch.equal(patchify_video(video[0]), patchify_video_latents(ref_video, (1, 2, 2)))
    assert not torch.equal(draw_noise(1235, layout)[0], video)


def test_denoise_with_fake_model_reaches_target():
    """A fake model whose velocity points at fixed targets (v = (x0 - x) / sigma) must land on them exactly in any
    number of steps, and sees t = 1 - sigma of each schedule."""
    g = torch.Generator().manual_seed(1)
    target_v, target_a = torch.randn(12, 96, generator=g), torch.randn(8, 32, generator=g)
    vs, as_ = sigma_schedule(6, 12.0), sigma_schedule(6, 3.0)
    seen = []

    def model_fn(video_rows, audio_rows, video_t, audio_t):
        seen.append((float(video_t), float(audio_t)))
        return (target_v - video_rows) / (1 - video_t), (target_a - audio_rows) / (1 - audio_t)

    steps = []
    v, a = denoise(model_fn, torch.randn(12, 96, generator=g), torch.randn(8, 32, generator=g), vs, as_,
                   on_step=lambda i, *_: steps.append(i))
    assert steps == list(range(5))
    assert seen == [(float(1 - vs[i]), float(1 - as_[i])) for i in range(5)]
    assert torch.allclose(v, target_v, atol=1e-5) and torch.allclose(a, target_a, atol=1e-5)


def test_denoise_matches_two_reference_schedulers():
    """The loop = diffusers' update block: scheduler.step on video rows, audio_scheduler.step on audio rows."""
    g = torch.Generator().manual_seed(2)
    v0, a0 = torch.randn(10, 96, generator=g), torch.randn(6, 32, generator=g)
    w_v, w_a = torch.randn(96, 96, generator=g) / 10, torch.randn(32, 32, generator=g) / 6

    def model_fn(video_rows, audio_rows, video_t, audio_t):
        return torch.tanh(video_rows @ w_v) * (1 + video_t), torch.sin(audio_rows @ w_a) - audio_t

    v, a = denoise(model_fn, v0, a0, sigma_schedule(5, 12.0), sigma_schedule(5, 3.0))
    sv, sa = reference_scheduler(5, 12.0), reference_scheduler(5, 3.0)
    rv, ra = v0.clone(), a0.clone()
    for t, ta in zip(sv.timesteps, sa.timesteps):
        pv, pa = model_fn(rv, ra, t, ta)
        rv = sv.step(pv, t, rv, return_dict=False)[0]
        ra = sa.step(pa, ta, ra, return_dict=False)[0]
    assert torch.equal(v, rv) and torch.equal(a, ra)


def test_denoise_rejects_mismatched_schedules():
    with pytest.raises(ValueError, match="same length"):
        denoise(lambda *a: None, torch.zeros(1, 96), torch.zeros(1, 32), sigma_schedule(5, 12.0),
                sigma_schedule(4, 3.0))


def test_schedule_timesteps_sorted_distinct():
    vs, as_ = sigma_schedule(5, 12.0), sigma_schedule(5, 3.0)
    ts = schedule_timesteps(vs, as_)
    assert ts[0] == 0.0 and bool((ts[1:] > ts[:-1]).all())
    assert ts.numel() == 7  # step 0 shared (t = 0), then 3 + 3 distinct
