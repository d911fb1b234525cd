"""Attention backend chooser and dispatch, on CPU: auto picks SDPA, SDPA equals explicit softmax attention, and
the FlashAttention-3 path hands [B, S, H, D] through unchanged (checked with a stand-in FA3 function)."""

import dataclasses
import math

import pytest
import torch

import h3render.models.attention as attn_mod
from h3render.models.attention import attention, current_backend, naive_attention, select_backend
from tests._numerics import assert_close


@pytest.fixture(autouse=True)
def fresh_selection(monkeypatch):
    # The choice is process-wide: start each test unselected and restore afterwards. CPU-only machine semantics
    # are forced so that the test means the same on a GPU host.
    monkeypatch.setattr(attn_mod, "_selected", None)
    monkeypatch.setattr(attn_mod, "_fa3_func", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_selects_sdpa_without_gpu(monkeypatch):
    monkeypatch.setattr(attn_mod, "_load_fa3", lambda: None)  # a GPU host may have FA3 installed: pretend it has not
    assert attn_mod.available_backends() == ["sdpa"]
    assert current_backend() == "sdpa"  # first use selects
    assert select_backend(None) == "sdpa"
    assert select_backend("auto") == "sdpa"


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 37, 3, 16), (1, 129, 2, 128)])
def test_sdpa_matches_naive_softmax_attention(shape):
    g = torch.Generator().manual_seed(shape[1])
    q, k, v = (torch.randn(shape, generator=g) * 2 for _ in range(3))
    out = attention(q, k, v)
    assert current_backend() == "sdpa"
    assert out.shape == shape
    ref = naive_attention(q, k, v)
    assert_close(out, ref, 1e-5, f"attention (sdpa) vs naive softmax {shape}")
    # Non-causal: the first query sees the last key.
    v2 = v.clone()
    v2[:, -1] += 100.0
    if shape[1] > 1:
        assert not torch.allclose(attention(q, k, v2)[:, 0], out[:, 0])


def test_naive_attention_is_softmax_attention():
    q = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 0.0]]]]).view(1, 2, 1, 2)  # [B=1, S=2, H=1, D=2]
    k = torch.tensor([[1.0, 0.0], [0.0, 0.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(1, 2, 1, 2)
    w = torch.tensor([1.0, 0.0]) / 2**0.5
    p0 = torch.softmax(w, 0)  # query 0's weights over the two keys
    expected0 = p0[0] * v[0, 0, 0] + p0[1] * v[0, 1, 0]
    expected1 = (v[0, 0, 0] + v[0, 1, 0]) / 2  # query 1 scores both keys 0
    out = naive_attention(q, k, v)
    torch.testing.assert_close(out[0, 0, 0], expected0)
    torch.testing.assert_close(out[0, 1, 0], expected1)


def test_named_backends_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="not available"):
        select_backend("fa3")
    with pytest.raises(ValueError, match="not available"):
        select_backend("cudnn")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash")
    assert select_backend("sdpa") == "sdpa"


def test_fa3_path_passes_bshd_and_unwraps_tuple(monkeypatch):
    calls = []

    def fake_flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append((tuple(q.shape), causal, softmax_scale))
        out = naive_attention(q, k, v)
        return out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # older FA3 builds return (out, lse)

    monkeypatch.setattr(attn_mod, "_load_fa3", lambda: fake_flash_attn_func)
    assert attn_mod.available_backends() == ["fa3", "sdpa"]
    assert select_backend("fa3") == "fa3"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, 16, generator=g) for _ in range(3))
    out = attn_mod.runner("fa3")(q, k, v)  # `attention` itself runs host tensors through SDPA (next test)
    assert calls == [((2, 37, 3, 16), False, None)]
    torch.testing.assert_close(out, naive_attention(q, k, v))


def test_host_tensors_use_sdpa_whatever_gpu_backend_was_selected(monkeypatch):
    # A CPU render on a GPU host (`--device cpu`, gloo ranks): the process-wide choice was measured on the GPU
    # ("cudnn" here), and cuDNN on host tensors fails with "No viable backend" (seen on the H200 machine).
    monkeypatch.setattr(attn_mod, "_selected", "cudnn")
    monkeypatch.setitem(attn_mod.REGISTRY, "cudnn", dataclasses.replace(
        attn_mod.REGISTRY["cudnn"], run=lambda *a: pytest.fail("GPU backend given host tensors")))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 29, 2, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v), naive_attention(q, k, v), atol=1e-5, rtol=1e-5)


_CUDA = torch.cuda.is_available()  # read before the autouse fixture hides the GPU


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _CUDA,
                                                                                  reason="needs CUDA"))])
def test_the_cudnn_backend_runs_inputs_cudnn_has_no_kernel_for(device):
    # Heads of dim 16 (the built-in tiny model's): cuDNN alone raised "No available kernel" and failed the job
    # whenever the probe had picked cuDNN (tests/e2e/test_signals.py on the H200, 2026-12-02); host tensors too.
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 37, 2, 16, generator=g).to(device) for _ in range(3))
    out = attn_mod.REGISTRY["cudnn"].run(q, k, v)
    torch.testing.assert_close(out.cpu(), naive_attention(q, k, v).cpu(), atol=1e-5, rtol=1e-5)


def test_attention_rejects_mismatched_inputs():
    q = torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        attention(q, q[:, :4], q)
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="dtype"):
        attention(q, q.double(), q)


def test_cpu_attention_in_chunks_is_bit_identical_to_one_call():
    """`cpu_attention` cuts a large CPU attention into query chunks (so a signal is handled between them); the chunks
    cut where torch's flash kernel cuts its own query blocks, so the output is the whole call's, bit for bit, in fp32
    and bf16 (a CPU render keeps its bytes, and 2 CPU ranks, which split the heads, still equal 1)."""
    torch.manual_seed(0)
    # 2048 + 1 / + 33 rows: a last chunk of 1 or 33 rows gave other fp32 bits than one call.
    for dtype, rows in ((torch.float32, 2049), (torch.float32, 2081), (torch.bfloat16, 2049)):
        q, k, v = (torch.randn(1, rows, 2, 16).to(dtype) for _ in range(3))
        whole = attn_mod._sdpa(q, k, v)
        for work in (1, 1024 * rows * 2 * 16):  # chunks of CPU_CHUNK_MIN_ROWS rows, and of 1024
            assert torch.equal(attn_mod.cpu_attention(q, k, v, chunk_work=work), whole), (dtype, rows, work)
        assert torch.equal(attn_mod.cpu_attention(q, k, v, chunk_work=1 << 40), whole)


def test_a_signal_during_the_dits_attention_at_the_largest_tiny_canvas_is_handled_within_a_chunk(monkeypatch):
    """One SDPA call over the tiny model's largest canvas (max_video_rows query rows) held a signal until it
    returned: ~11 s on a 2-core host (27 s under load), so SIGTERM was not honoured for that long. Now the signal
    (here SIGALRM, 20 ms into the first chunk) is handled after the chunk it arrived in: the call stops part-way,
    within a chunk's time. Through the DiT block's own attention function (`sdpa_attention` off CUDA) and through
    `attention` (the Ulysses ranks' base)."""
    import signal
    import time

    from h3render.checkpoint.releases import RELEASES
    from h3render.models.dit import Attention

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    rows = RELEASES["tiny"].limits().max_video_rows
    cfg = RELEASES["tiny"].dit
    block = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
    q = torch.randn(1, rows, cfg.num_attention_heads, cfg.attention_head_dim)
    real, started = attn_mod._sdpa, []

    def counted(q_, k_, v_):
        if not started:
            signal.setitimer(signal.ITIMER_REAL, 0.02)
        started.append(q_.shape[1])
        return real(q_, k_, v_)

    t0 = time.perf_counter()
    real(q[:, :attn_mod.CPU_CHUNK_MIN_ROWS], q, q)  # what one chunk takes on this machine now (~0.3 s idle)
    chunk_s = time.perf_counter() - t0
    monkeypatch.setattr(attn_mod, "_sdpa", counted)
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        for fn in (block.attention, attention):
            started.clear()
            t0 = time.perf_counter()
            with pytest.raises(Stop):
                fn(q, q, q)
            seconds = time.perf_counter() - t0
            assert sum(started) < rows / 4, started  # stopped after a chunk, not after the whole call
            assert seconds < 3 * chunk_s + 0.5, (seconds, chunk_s, started)  # a chunk or two, of ~31
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("sparse", [None, "packed v", "v in tile order", "v in tile order, unfused"])
def test_the_qkv_projection_output_is_freed_before_attending(sparse, monkeypatch):
    """The projection output `[S, 3 * heads * head_dim]` is dead once q, k, v are normalized; alive through the
    attention call it was the streamed plan's peak (3.2 GB at 1344x768x243, docs/performance.md §20). VSA too, with
    v packed or written in the Triton fine stage's tile order (`Attention.vsa_v_tiles`), there with the tile means
    from the same pass (`Attention.vsa_fused_prep`, `kernels.vsa.vsa_prep`) or not."""
    import weakref

    from h3render.kernels.vsa import tile_plan
    from h3render.models.dit import Attention

    torch.manual_seed(0)
    module = Attention(64, 4, 16, 1e-6)
    project, refs, alive, v_rows = module.qkv_proj.forward, [], [], []

    def tracked(x):
        out = project(x)
        refs.append(weakref.ref(out))
        return out

    def attend(q, k, v, gate=None):
        alive.append(refs[-1]() is not None)
        return v

    class StandIn:  # `SparseAttention`'s interface as `Attention.forward` uses it
        plan = tile_plan((49,), (1, 1, 1))  # 50 rows in 2 tiles: v in tile order has 128 rows

        def triton_fine(self, x):
            return sparse.startswith("v in tile order")

        def __call__(self, q, k, v, gate, *, v_tiles=False, pooled=None):
            v_rows.append((v.shape[0], v_tiles, pooled is not None))
            return attend(q, k, q, gate)

    if sparse:  # VSA: the gate projection reads the same input
        module.gate_proj = torch.nn.Linear(64, 64, bias=False)
    module.qkv_proj.forward = tracked
    module.attention = attend
    monkeypatch.setattr(Attention, "vsa_fused_prep", sparse != "v in tile order, unfused")
    with torch.no_grad():
        out = module(torch.randn(50, 64), None, StandIn() if sparse else None)
    assert out.shape == (50, 64) and alive == [False]
    assert v_rows == ({None: [], "packed v": [(50, False, False)], "v in tile order": [(128, True, True)],
                       "v in tile order, unfused": [(128, True, False)]}[sparse])


def test_auto_choice_is_the_first_agreeing_backend_whatever_the_timing(monkeypatch):
    """Two processes on one GPU timed FA3 and cuDNN differently under load and rendered one seed to different bits
    (GPU suite, 2026-12-03): the automatic choice is the registry's order, checked for agreement, never timed."""
    import time

    calls = []

    def slow_but_right(q, k, v):
        calls.append("fa3")
        time.sleep(0.05)
        return attn_mod.sdpa_attention(q, k, v)

    def fast_but_wrong(q, k, v):
        calls.append("cudnn")
        return attn_mod.sdpa_attention(q, k, v) * 1.5

    backends = {"fa3": slow_but_right, "cudnn": fast_but_wrong}
    monkeypatch.setattr(attn_mod, "available_backends", lambda: ["fa3", "cudnn", "sdpa"])
    for name, fn in backends.items():
        monkeypatch.setitem(attn_mod.REGISTRY, name, attn_mod.AttentionBackend(name, lambda: True, fn))
    name, errors = attn_mod.preferred_for((1, 64, 2, 16), device="cpu")
    assert name == "fa3" and calls == ["fa3"] and errors["fa3"] < 1e-2  # cuDNN never ran: fa3 agreed first
    # fa3 disagreeing (or failing) passes the choice down the order; cudnn's 50 % error skips it as well.
    monkeypatch.setitem(attn_mod.REGISTRY, "fa3", attn_mod.AttentionBackend("fa3", lambda: True, fast_but_wrong))
    name, errors = attn_mod.preferred_for((1, 64, 2, 16), device="cpu")
    assert name == "sdpa" and errors["fa3"] == pytest.approx(0.5, rel=1e-2) and errors["cudnn"] > 0.4

    def fails(q, k, v):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(attn_mod.REGISTRY, "fa3", attn_mod.AttentionBackend("fa3", lambda: True, fails))
    monkeypatch.setitem(attn_mod.REGISTRY, "cudnn", attn_mod.AttentionBackend("cudnn", lambda: True, slow_but_right))
    assert attn_mod.preferred_for((1, 64, 2, 16), device="cpu") == ("cudnn", {"fa3": math.inf, "cudnn": 0.0})
