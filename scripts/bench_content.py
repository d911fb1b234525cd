"""Picture content for the benchmark's media path: synthetic clips (the media stage) and the e2e / memplans option
`--e2e-content`, which keeps the real video VAE decode but paints a moving scene over each decoded chunk before
the renderer's media path sees it.

Why: with random weights the decode is noise, and x264 on noise (119 Mbit/s at 1344x768) is slower than the
decode, so the writer's queue pushes back on the decode loop and a benchmark charges x264's time to the render;
footage encodes several times faster (docs/performance.md §6.6).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

CONTENTS = ("noise", "moving")


def synthetic_video(first: int, n: int, height: int, width: int, kind: str, device, grain: float = 0.01,
                    seed: int = 0) -> torch.Tensor:
    """Frames `first .. first+n-1` of a synthetic clip: float [3, n, H, W] in [0, 1] on `device`.

    kind "moving": a slowly panning colour gradient, a fine drifting texture, six soft-edged discs on smooth
    paths and fresh Gaussian grain of std `grain` per frame (a stand-in for decoded footage: motion, edges and
    some noise for x264 to spend bits on). kind "noise": independent uniform noise per pixel (what random
    weights decode to; x264's worst case).
    """
    g = torch.Generator(device=device).manual_seed(seed * 100_003 + first)
    if kind == "noise":
        return torch.rand(3, n, height, width, device=device, generator=g)
    if kind != "moving":
        raise ValueError(f"synthetic_video: kind must be moving or noise, got {kind!r}")
    t = ((first + torch.arange(n, device=device, dtype=torch.float32)) / 24).view(n, 1, 1)  # seconds
    y = torch.linspace(0, 1, height, device=device).view(1, height, 1)
    x = torch.linspace(0, width / height, width, device=device).view(1, 1, width)
    two_pi = 2 * torch.pi
    video = torch.stack([
        0.45 + 0.25 * torch.sin(two_pi * (0.6 * x + 0.3 * y - 0.05 * t)),
        0.45 + 0.25 * torch.sin(two_pi * (0.4 * x - 0.5 * y + 0.04 * t) + 1.0),
        0.45 + 0.25 * torch.cos(two_pi * (0.3 * x + 0.2 * y + 0.03 * t)),
    ])  # [3, n, H, W]
    video = video + 0.04 * torch.sin(two_pi * (9 * x + 0.5 * t)) * torch.sin(two_pi * (7 * y - 0.4 * t))
    aspect = width / height
    for k in range(6):
        cx = aspect * (0.5 + 0.4 * torch.sin(0.35 * (k + 1) * t + k))  # [n, 1, 1]
        cy = 0.5 + 0.35 * torch.cos(0.25 * (k + 2) * t + 2 * k)
        radius = 0.06 + 0.02 * k
        inside = torch.sigmoid((radius - torch.sqrt((x - cx) ** 2 + (y - cy) ** 2)) * 300)  # [n, H, W]
        colour = torch.tensor([(k * 0.37) % 1, (k * 0.61 + 0.2) % 1, (k * 0.13 + 0.5) % 1],
                              device=device).view(3, 1, 1, 1)
        video = video * (1 - inside) + colour * inside
    video = video + grain * torch.randn(3, n, height, width, device=device, generator=g)
    return video.clamp(0, 1)


def parse_contents(text: str) -> list[str]:
    """`"noise,moving"` -> ["noise", "moving"] (each of CONTENTS, in the order given)."""
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in CONTENTS]
    if bad or not kinds:
        raise ValueError(f"--e2e-content: expected a comma-separated list of {', '.join(CONTENTS)}, got {text!r}")
    return kinds


class MovingScenes:
    """The "moving" scene of `synthetic_video` per canvas, made once before the timed renders and painted over
    decoded chunks at the cost of one gather and one scale on the chunk's device.

    Each canvas holds `period` frames as uint8 `[3, period, H, W]` (1344x768, 48 frames: 149 MB), and frame i of
    a clip shows frame `i % period` (a 2 s loop at 24 fps: x264 veryfast references one frame back, so the loop
    costs it nothing it would not spend on footage). Generating the scene per chunk instead would add ~10 ms of
    element-wise work per chunk to the decode it stands in for.
    """

    def __init__(self, device: torch.device, period: int = 48, grain: float = 0.01) -> None:
        if period < 1:
            raise ValueError(f"MovingScenes: period must be >= 1, got {period}")
        self.device, self.period, self.grain = torch.device(device), period, grain
        self.banks: dict[tuple[int, int], torch.Tensor] = {}

    def prepare(self, height: int, width: int) -> None:
        """Make the scene for a `height` x `width` canvas (once; a few slices of frames at a time)."""
        if (height, width) in self.banks:
            return
        bank = torch.empty(3, self.period, height, width, dtype=torch.uint8, device=self.device)
        for first in range(0, self.period, 8):
            n = min(8, self.period - first)
            video = synthetic_video(first, n, height, width, "moving", self.device, grain=self.grain)
            bank[:, first:first + n] = video.mul_(255).round_().to(torch.uint8)
        self.banks[(height, width)] = bank

    @property
    def nbytes(self) -> int:
        """Device bytes the scenes hold (they stay allocated through the timed renders)."""
        return sum(b.numel() for b in self.banks.values())

    def paint_(self, first: int, frames: torch.Tensor) -> torch.Tensor:
        """Overwrite `frames` [3, n, H, W] (float, the decoded chunk of clip frames `first .. first+n-1`) with the
        scene's frames, in place, as values in [0, 1] in the chunk's dtype; returns `frames`.

        Raises:
            KeyError: no scene was prepared for the chunk's canvas (making one here would time it as decode).
        """
        _, n, height, width = frames.shape
        bank = self.banks.get((height, width))
        if bank is None:
            raise KeyError(f"MovingScenes: no scene prepared for {width}x{height} (prepare() before the render)")
        index = (torch.arange(n, device=bank.device) + first) % self.period  # [n]
        return frames.copy_(bank.index_select(1, index)).mul_(1 / 255)


class Painted:
    """A decode stream `(first, frames [3, n, H, W])` with each chunk painted by `MovingScenes.paint_`.

    `frames`, `chunks`: what was painted (a row says "moving" only if every frame was).
    """

    def __init__(self, scenes: MovingScenes) -> None:
        self.scenes = scenes
        self.frames = self.chunks = 0

    def __call__(self, stream: Iterator) -> Iterator:
        for first, chunk in stream:
            chunk = self.scenes.paint_(first, chunk)
            self.frames += chunk.shape[1]
            self.chunks += 1
            yield first, chunk


@contextlib.contextmanager
def content(engine, kind: str, scenes: MovingScenes | None):
    """Within the block, `engine`'s renders show `kind` (CONTENTS): "noise" changes nothing (what the random weights
    decode), the others paint `scenes` over every decoded chunk on the writing rank (`engine.plan.decode_stream`,
    the one seam all the renderer's decodes pass). Yields the record for the row: content, frames painted, the
    scenes' device bytes."""
    record: dict = {"content": kind}
    if kind == "noise" or not engine.plan.writes:
        yield record
        return
    painted = Painted(scenes)
    decode_stream = engine.plan.decode_stream

    def painted_stream(vae, latent, batch_size):
        return painted(decode_stream(vae, latent, batch_size))

    engine.plan.decode_stream = painted_stream  # an instance attribute over the method, removed below
    try:
        yield record
    finally:
        del engine.plan.decode_stream
        record.update(content_frames=painted.frames, content_chunks=painted.chunks, content_bank_bytes=scenes.nbytes)
