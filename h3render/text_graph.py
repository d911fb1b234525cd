"""The t2va prompt encode at a bucketed length, replayed from a CUDA graph per bucket on CUDA.

A short prompt's encode is launch-bound: 50 Qwen3-VL decoder layers are ≈ 2,000 kernel launches, and the GPU waits on
Python between them (docs/performance.md §22.4). Replayed from a CUDA graph (`h3render.graphs.ShapeGraphs`), the
released encoder at 77 tokens took 0.046 s against 0.10-0.14 s eager in FP8, 0.023 s against 0.060-0.075 s in bf16
(1x H200, random weights; §31); with §32's few-row FP8 GEMM, 0.023 s in FP8 too. A graph is captured per input
shape, so the token ids are padded at the end to a multiple of `TOKEN_BUCKET`: a queue's prompts share a few shapes,
captured in `Engine.prepare`.

The padding does not change what the real rows compute: the stack is causal (a row attends to itself and the rows
before it), its rotary positions are the token indices, and its norms and MLPs work row by row, so rows 0..Nt-1 of the
padded output are the same function of the same tokens. Their bits can differ from an unpadded run's in the last
place where a GEMM library picks another kernel for another row count: on the released encoder with random weights,
after 50 layers, relative 1.5e-2 at 77 -> 128 tokens in bf16 and at 200 -> 256 in FP8, 0 at 77 -> 128 in FP8 (FP8's
own error against bf16 is 0.104, §22.4). So every t2va encode pads, graph or not: a prompt's states do not depend on
the memory plan or on `graph_text`.
"""

from __future__ import annotations

import torch

from h3render.graphs import ShapeGraphs

# Token ids per bucket: a 77-token prompt runs as 128 rows. 64 keeps the extra rows under one bucket (the GEMMs of a
# short prompt are weight-bound: the extra rows cost next to nothing) and a queue's shapes few.
TOKEN_BUCKET = 64
PAD_ID = 0  # any id in the vocabulary: the real rows never attend to the padding (causal)


def bucket_length(num_tokens: int) -> int:
    """The padded length of a `num_tokens`-token prompt: the next multiple of `TOKEN_BUCKET` (>= 1 token)."""
    if num_tokens < 1:
        raise ValueError(f"a prompt has at least one token, got {num_tokens}")
    return -(-num_tokens // TOKEN_BUCKET) * TOKEN_BUCKET


def padded_ids(ids: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`ids` `[Nt]` int64 -> `[1, bucket_length(Nt)]` int64 on `device`: the ids first, `PAD_ID` after."""
    out = torch.full((1, bucket_length(ids.numel())), PAD_ID, dtype=torch.long)
    out[0, : ids.numel()] = ids
    return out.to(device)


def text_graphs(text_encoder, *, enabled: bool, backend=None) -> ShapeGraphs:
    """The engine's replayer of `text_encoder`'s text-only forward (`[1, L]` ids -> `[1, L, text_dim]`), one graph
    per padded length; eager off CUDA or when not `enabled` (`RunSettings.graph_text`)."""
    return ShapeGraphs(text_encoder, name="text encoder", enabled=enabled, backend=backend)


@torch.no_grad()
def encode_prompt(text_encoder, prompt: str, graphs: ShapeGraphs | None = None) -> torch.Tensor:
    """One t2va prompt's states `[Nt, text_dim]` on the encoder's device in its dtype: tokenized verbatim
    (`TextEncoder.tokenize`), padded to its bucket, run (replayed from `graphs` when given), the padding cut off.

    Raises:
        ValueError: an empty prompt or one with no tokens (`TextEncoder.tokenize`).
    """
    ids = text_encoder.tokenize(prompt)
    x = padded_ids(ids, text_encoder.embed_tokens.weight.device)
    states = graphs(x) if graphs is not None else text_encoder(x)
    # A copy of the real rows: a view would keep the padded tensor alive (and whole in a saved text store).
    return states[0, : ids.numel()].clone()


def capture_prompts(graphs: ShapeGraphs, text_encoder, prompts) -> list[int]:
    """Capture the graphs of `prompts`' buckets not yet captured (warm-up, outside job timings); returns the padded
    lengths captured now. A prompt that does not tokenize is skipped: its job fails on its own, later."""
    device = text_encoder.embed_tokens.weight.device
    lengths = set()
    for prompt in prompts:
        try:
            lengths.add(bucket_length(text_encoder.tokenize(prompt).numel()))
        except ValueError:
            continue
    captured = []
    for length in sorted(lengths):
        x = torch.full((1, length), PAD_ID, dtype=torch.long, device=device)
        if graphs.needs_capture(x):
            graphs.capture(x)
            captured.append(length)
    return captured
