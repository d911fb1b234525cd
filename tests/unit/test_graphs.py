"""CUDA-graph wrapper (`h3render.graphs.ShapeGraphs`) and the audio decode it replays.

On CPU a stand-in backend plays the graph: its replay recomputes into the SAME static output buffer, as a CUDA graph
replay overwrites it, so reusing a stale static input or handing out the static output itself is caught. Where CUDA
is present the same tests also run against real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from h3render.graphs import ShapeGraphs
from h3render.models.audio_vae import AudioVAE
from h3render.models.audio_vae_config import AUDIO_VAE_TINY


class ReplayInPlace:
    """CPU stand-in for CUDA graphs: capture runs `fn` once; replay runs it again on the static input and writes the
    result into the static output captured first (a CUDA graph replay rewrites the same memory)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, fn, static_in):
        self.captures += 1
        static_out = fn(static_in)

        def replay():
            self.replays += 1
            static_out.copy_(fn(static_in))

        return replay, static_out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, backend factory): the CPU stand-in everywhere, real CUDA graphs where a GPU exists.
BACKENDS = [pytest.param("cpu", ReplayInPlace, id="cpu-standin"),
            pytest.param("cuda", lambda: None, id="cuda", marks=needs_cuda)]


def tiny_audio_vae(device: str, seed: int = 0) -> AudioVAE:
    torch.manual_seed(0)  # latents_mean/std are config, not state: the same for every seed
    cfg = dataclasses.replace(AUDIO_VAE_TINY, latents_mean=tuple((0.1 * torch.randn(32)).tolist()),
                              latents_std=tuple((0.5 + torch.rand(32)).tolist()))
    torch.manual_seed(seed)
    vae = AudioVAE(cfg).eval()
    with torch.no_grad():
        for p in vae.parameters():  # off the init, so every parameter matters
            p.add_(0.1 * torch.randn_like(p))
    return vae.to(device)


def latents(device: str, length: int, seed: int) -> torch.Tensor:
    return torch.randn(2, 32, length, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device, backend", BACKENDS)
def test_replays_fresh_input_into_fresh_output(device, backend):
    """Two decodes of different latents: different outputs, each equal to eager, the first not overwritten."""
    vae = tiny_audio_vae(device)
    graphs = ShapeGraphs(vae.decode, name="audio", backend=backend())
    z1, z2 = latents(device, 12, 1), latents(device, 12, 2)
    eager1, eager2 = vae.decode(z1), vae.decode(z2)
    assert graphs.graphs_on(device)
    assert graphs.capture(torch.zeros_like(z1)) > 0.0  # captured on zeros: replays must not return zeros' decode
    out1 = graphs(z1)
    out2 = graphs(z2)
    assert not torch.equal(out1, out2)
    assert torch.equal(out1, eager1)  # a stale static output would now hold z2's decode
    assert torch.equal(out2, eager2)
    assert out1.data_ptr() != out2.data_ptr()
    assert len(graphs.captures) == 1 and graphs.captures[0]["shape"] == [2, 32, 12]


@pytest.mark.parametrize("device, backend", BACKENDS)
def test_one_graph_per_shape_captured_on_first_use(device, backend):
    impl = backend()
    calls = []

    def fn(x):
        calls.append(tuple(x.shape))
        return x * 2 + 1

    graphs = ShapeGraphs(fn, backend=impl)
    a, b = torch.arange(6.0, device=device).view(2, 3), torch.arange(8.0, device=device).view(2, 4)
    assert graphs.needs_capture(a)
    assert torch.equal(graphs(a), a * 2 + 1)  # first use captures
    assert not graphs.needs_capture(a) and graphs.needs_capture(b)
    assert torch.equal(graphs(b), b * 2 + 1)
    assert torch.equal(graphs(a + 1), (a + 1) * 2 + 1)
    assert graphs.capture(a) == 0.0  # already there
    assert sorted(c["shape"] for c in graphs.captures) == [[2, 3], [2, 4]]
    if isinstance(impl, ReplayInPlace):
        assert impl.captures == 2 and impl.replays == 3
    graphs.reset()
    assert graphs.needs_capture(a) and graphs.captures == []


def test_cpu_without_backend_runs_eagerly():
    vae = tiny_audio_vae("cpu")
    graphs = ShapeGraphs(vae.decode)
    z = latents("cpu", 9, 3)
    assert not graphs.graphs_on("cpu") and not graphs.needs_capture(z)
    assert graphs.capture(z) == 0.0
    assert torch.equal(graphs(z), vae.decode(z))
    assert graphs.captures == []
    off = ShapeGraphs(vae.decode, enabled=False, backend=ReplayInPlace())
    assert not off.graphs_on("cpu") and torch.equal(off(z), vae.decode(z))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_inference_caches_follow_the_weights(device):
    """Cached weight-norm weights / Snake coefficients / filters are rebuilt when parameters change in place or are
    replaced, and the no-grad fast path equals the autograd reference form (bit for bit on CPU; on CUDA within
    float32 rounding: cuDNN may pick other convolution algorithms for the two forms, seen on an H200)."""

    def same(a, b):
        if device == "cpu":
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    def differs(a, b):  # a stale cache would leave the output (near) unchanged
        return (a - b).abs().max().item() > 1e-4 * b.abs().max().item()

    vae = tiny_audio_vae(device).set_fused_activations(False)  # the torch fast path (Triton: test_alias_free.py)
    z = latents(device, 10, 4)
    before = vae.decode(z)
    with torch.enable_grad():  # reference forms: no caches, no in-place activations
        reference = vae.decoder(vae.dec_in_proj(z * vae.latents_std + vae.latents_mean))[:, 0]
    assert same(before, reference.detach())

    other = tiny_audio_vae(device).set_fused_activations(False)  # same activation path as vae
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.1)
    vae.load_state_dict(other.state_dict())  # copy_ into the same parameters
    got, want = vae.decode(z), other.decode(z)
    assert same(got, want), f"max |diff| {(got - want).abs().max().item():.3e} (max |want| {want.abs().max():.3e})"
    assert differs(got, before)

    with torch.no_grad():
        vae.decoder.conv_post.weight_g.mul_(0.5)  # one gain, in place
    halved = vae.decode(z)
    assert differs(halved, other.decode(z))
    vae.decoder.conv_post.weight_g = torch.nn.Parameter(other.decoder.conv_post.weight_g.clone())  # replaced
    assert same(vae.decode(z), other.decode(z))

    first = tiny_audio_vae(device, seed=1).set_fused_activations(False)
    second = tiny_audio_vae(device, seed=2).set_fused_activations(False)
    first_out, second_out = first.decode(z), second.decode(z)
    first.load_state_dict(second.state_dict(), assign=True)  # other tensors, with the same version counts
    assert same(first.decode(z), second_out) and differs(first_out, second_out)


def test_renderer_captures_in_prepare_and_records_a_new_length(tmp_path):
    """The Renderer replays the audio decode from graphs captured in `prepare`; a length prepare did not see is
    captured by its first job and reported in the sidecar as warm-up (CPU stand-in for CUDA graphs)."""
    from h3render.jobs import Job
    from h3render.spec import audio_latents as audio_latents_for
    from h3render.parallel.groups import ParallelContext
    from h3render.engine import Engine
    from h3render.settings import RunSettings

    ctx = ParallelContext(0, 1, 0, torch.device("cpu"))
    renderer = Engine.load(RunSettings(progress=False), ctx)
    assert not renderer.audio_decode.graphs_on("cpu")  # on CPU the Renderer decodes eagerly
    standin = ReplayInPlace()
    renderer.audio_decode = ShapeGraphs(renderer.c.audio_vae.decode, backend=standin)

    def job(frames: int) -> Job:
        return Job(id=f"j{frames}", prompt="Rain on a tin roof", width=224, height=128, frames=frames, seed=1,
                   steps=2, mode="t2va", output=f"j{frames}")

    renderer.prepare([job(22)])
    assert standin.captures == 1 and renderer.warmup["audio_graph_latents"] == [audio_latents_for(22)]
    first = renderer.render(job(22), tmp_path / "a.mp4", tmp_path / "a.json")
    assert "job_warmup" not in first["extra"] and standin.captures == 1 and standin.replays == 1
    second = renderer.render(job(39), tmp_path / "b.mp4", tmp_path / "b.json")
    capture = second["extra"]["job_warmup"]["audio_graph_capture"]
    assert capture["latents"] == audio_latents_for(39) and capture["seconds"] > 0
    assert second["timings"]["warmup_s"]["audio_graph_capture"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["extra"]["job_warmup"] == second["extra"]["job_warmup"]
    third = renderer.render(job(39), tmp_path / "c.mp4", tmp_path / "c.json")
    assert "job_warmup" not in third["extra"] and standin.captures == 2 and standin.replays == 3


def test_inference_caches_survive_a_no_op_move_and_follow_a_real_one():
    """`.to()` to where the weights already are keeps the cached tensors (a captured graph reads them by address);
    a real move or cast rebuilds them."""
    vae = tiny_audio_vae("cpu").set_fused_activations(False)
    z = latents("cpu", 8, 5)
    expected = vae.decode(z)
    conv = vae.decoder.conv_post
    with torch.no_grad():
        cached = conv.weight()
        vae.to("cpu")
        assert conv.weight() is cached
        vae.double()
        assert conv.weight() is not cached and conv.weight().dtype == torch.float64
        vae.float()
    assert torch.equal(vae.decode(z), expected)


def test_weights_made_in_inference_mode_are_not_cached():
    """Tensors created under torch.inference_mode() track no version counter: the decode computes their derived
    tensors afresh instead of failing."""
    with torch.inference_mode():
        vae = tiny_audio_vae("cpu").set_fused_activations(False)
        z = latents("cpu", 6, 6)
        out = vae.decode(z)
    assert torch.equal(out, tiny_audio_vae("cpu").set_fused_activations(False).decode(z))


class FailingCapture:
    def capture(self, fn, static_in):
        fn(static_in)
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager():
    vae = tiny_audio_vae("cpu")
    graphs = ShapeGraphs(vae.decode, name="audio", backend=FailingCapture())
    z = latents("cpu", 7, 7)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert graphs.capture(z) == 0.0
    assert "not permitted" in graphs.failure and not graphs.graphs_on("cpu")
    assert torch.equal(graphs(z), vae.decode(z)) and graphs.captures == []


def test_a_capture_that_fails_inside_a_call_still_returns_the_eager_result():
    """The first call of a shape captures; when that capture fails the call itself answers eagerly (it raised
    KeyError before) and later calls stay eager."""
    vae = tiny_audio_vae("cpu")
    graphs = ShapeGraphs(vae.decode, name="audio", backend=FailingCapture())
    z = latents("cpu", 7, 7)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        out = graphs(z)
    assert torch.equal(out, vae.decode(z)) and graphs.failure is not None and not graphs.graphs_on("cpu")

