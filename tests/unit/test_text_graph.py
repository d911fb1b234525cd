"""The t2va prompt encode at a bucketed length, replayed from a graph per bucket (`h3render.text_graph`).

On CPU the graphs are played by test_graphs' stand-in (its replay recomputes into the same static output, as a CUDA
graph rewrites the same memory); where CUDA is present the replay case also runs real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from h3render.checkpoint.builtin import tiny_tokenizer
from h3render.checkpoint.releases import QWEN3VL_TINY
from h3render.models.text_encoder import TextEncoder
from h3render.text_graph import (TOKEN_BUCKET, bucket_length, capture_prompts, encode_prompt, padded_ids,
                                 text_graphs)
from tests.unit.test_graphs import BACKENDS, ReplayInPlace

PROMPTS = ["a red fox runs through snow", "waves", "a long prompt " * 30]


def tiny_encoder(device: str = "cpu") -> TextEncoder:
    torch.manual_seed(0)
    te = TextEncoder(QWEN3VL_TINY["text_config"], read_layer=3, tokenizer=tiny_tokenizer()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in te.parameters():  # off the init, norm gains too: a row that saw the padding would change
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g) if p.ndim == 1
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return te.to(device)


def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 63, 64, 65, 77, 128, 129, 2000)] == [64, 64, 64, 128, 128, 128, 192, 2048]
    with pytest.raises(ValueError, match="at least one token"):
        bucket_length(0)


def test_padded_ids_put_the_prompt_first():
    ids = torch.arange(5, 75)
    x = padded_ids(ids, "cpu")
    assert x.shape == (1, 128) and x.dtype == torch.long
    assert torch.equal(x[0, :70], ids) and bool((x[0, 70:] == 0).all())


def test_padded_encode_is_the_unpadded_one():
    """The padding comes after the prompt, and the stack is causal: the real rows are the unpadded encode's (to fp32
    rounding). Padding in front would move every row's rotary position and context: the second check is the premise
    that this test would catch it."""
    te = tiny_encoder()
    prompt = PROMPTS[0]
    ids = te.tokenize(prompt)
    assert bucket_length(ids.numel()) > ids.numel()  # the premise: something is padded
    ours = encode_prompt(te, prompt)
    ref = te.encode(prompt)
    assert ours.shape == ref.shape == (ids.numel(), te.text_dim)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    front = torch.zeros(1, bucket_length(ids.numel()), dtype=torch.long)
    front[0, -ids.numel():] = ids
    with torch.no_grad():
        shifted = te(front)[0, -ids.numel():]
    assert (shifted - ref).norm() / ref.norm() > 0.05


@pytest.mark.parametrize("device, backend", BACKENDS)
def test_replayed_encode_equals_the_eager_one(device, backend):
    te = tiny_encoder(device)
    graphs = text_graphs(te, enabled=True, backend=backend())
    for prompt in PROMPTS + PROMPTS[:1]:  # the first prompt again: replayed from its graph, fresh output
        eager = encode_prompt(te, prompt)
        replayed = encode_prompt(te, prompt, graphs)
        assert torch.equal(replayed, eager)
    shapes = sorted(c["shape"][-1] for c in graphs.captures)
    assert shapes == sorted({bucket_length(te.tokenize(p).numel()) for p in PROMPTS})


def test_capture_prompts_once_per_bucket():
    te = tiny_encoder()
    impl = ReplayInPlace()
    graphs = text_graphs(te, enabled=True, backend=impl)
    short, other_short, long = "waves", "a red fox", "a long prompt " * 30
    assert bucket_length(te.tokenize(short).numel()) == bucket_length(te.tokenize(other_short).numel())
    captured = capture_prompts(graphs, te, [short, other_short, long, ""])  # "" never tokenizes: skipped
    assert captured == sorted({TOKEN_BUCKET, bucket_length(te.tokenize(long).numel())})
    assert impl.captures == 2
    assert capture_prompts(graphs, te, [long]) == [] and impl.captures == 2
    encode_prompt(te, short, graphs)
    assert impl.captures == 2 and impl.replays == 1


def test_disabled_runs_eagerly():
    te = tiny_encoder()
    impl = ReplayInPlace()
    graphs = text_graphs(te, enabled=False, backend=impl)
    assert capture_prompts(graphs, te, PROMPTS) == []
    assert torch.equal(encode_prompt(te, PROMPTS[0], graphs), encode_prompt(te, PROMPTS[0]))
    assert impl.captures == 0 and impl.replays == 0


def test_engine_captures_its_jobs_buckets_in_prepare_and_replays_them(tmp_path):
    """`Engine.prepare` captures the padded lengths of its jobs' prompts and records them; the job then replays its
    graph: no capture inside the job."""
    from h3render.engine import Engine
    from h3render.jobs import Job
    from h3render.parallel.groups import ParallelContext
    from h3render.settings import RunSettings

    engine = Engine.load(RunSettings(progress=False), ParallelContext(0, 1, 0, torch.device("cpu")))
    impl = ReplayInPlace()
    engine.text_graphs = text_graphs(engine.c.text_encoder, enabled=True, backend=impl)
    jobs = [Job(id=name, prompt=prompt, width=224, height=128, frames=22, seed=3, steps=2, mode="t2va", output=name)
            for name, prompt in (("a", "Waves on a pebble beach"), ("b", "a long prompt " * 30))]
    engine.prepare(jobs)
    te = engine.c.text_encoder
    lengths = sorted({bucket_length(te.tokenize(j.prompt).numel()) for j in jobs})
    assert engine.warmup["text_graph_tokens"] == lengths and impl.captures == len(lengths)
    replays = impl.replays
    engine.render(jobs[0], tmp_path / "a.mp4", tmp_path / "a.json")
    assert impl.captures == len(lengths) and impl.replays > replays
