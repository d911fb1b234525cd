"""Work split of the released video-VAE decode: temporal windows x spatial tiles, and their blending.

The released decode (diffusers 0.42.1 `AutoencoderKLMiniMaxH3._decode` / `_decode_clip`) runs the ViT decoder on
overlapping latent windows and overlapping spatial tiles, then

* stitches the tiles of one window with linear ramps against the *original* neighbouring tiles, rows (blend with
  the tile above) then columns (blend with the unblended tile to the left), each tile cropped at its bottom/right
  overlap; a weight-map average does not reproduce the corners;
* cross-fades consecutive windows over `frame_overlap` pixel frames (5 at release).

This module holds the geometry (`plan_decode`) and the tile splitter as plain Python (torch-free: the release
registry reads `TilingConfig` before anything heavy loads); `h3render.models.vae_blend` holds the blends. Together
they let the decode be batched, split across GPUs and streamed frame by frame without changing a pixel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass



@dataclass(frozen=True)
class TilingConfig:
    """Spatial tile geometry in pixels.

    Released values (diffusers 0.42.1 `AutoencoderKLMiniMaxH3.__init__`, tiling on by default): 256 px tiles with at
    least 64 px overlap on both axes; the released frames are the blended-tile ones. A tile at least as large as the
    canvas means "no tiling" on that axis.
    """

    tile_height: int = 256
    tile_width: int = 256
    overlap_height: int = 64
    overlap_width: int = 64


RELEASED_TILING = TilingConfig()


def even_batch(items: int, most: int) -> int:
    """Decoder batch size for `items` work items when every forward runs `most` or fewer of them padded to its
    size (a compiled decoder pads a short batch rather than compile for it): the size with the fewest slots,
    ceil(items / b) * b, from ceil(most / 2) to `most`, the larger on a tie (fewer forwards). `items <= most`: one
    forward of exactly `items`. 960x544x124 (105 items) at 8: 7 (15 forwards, no slot padded; 8 pads 7 of 112);
    1344x768x243 (392 items): 8. Sizes under half of `most` are not tried: each size is one more compile.

    Raises:
        ValueError: `most` < 1.
    """
    if most < 1:
        raise ValueError(f"batch size must be >= 1, got {most}")
    if items <= most:
        return max(items, 1)
    return min(range((most + 1) // 2, most + 1), key=lambda b: (-(-items // b) * b, -b))


@dataclass(frozen=True)
class AxisTiles:
    """Tiles laid over one axis of `length` pixels: `starts[i]`, all of width `size`, `overlaps[i]` between i, i+1."""

    length: int
    size: int
    starts: tuple[int, ...]
    overlaps: tuple[int, ...]


def split_axis(length: int, tile: int, min_overlap: int, align: int, *, name: str = "tile") -> AxisTiles:
    """Lay `tile`-px tiles over `length` px with every overlap >= `min_overlap`, all boundaries `align`-aligned.

    Uses the fewest tiles that cover `length`; the slack is spread round-robin over the overlaps in whole `align`
    steps (the released rule), so the last tile ends exactly at `length`.

    Args:
        length: axis length in px, a multiple of `align` (latent size x spatial compression).
        tile: tile size in px, a multiple of `align`.
        min_overlap: minimum overlap in px, a multiple of `align`, 0 <= min_overlap < tile when tiling is needed.
        align: the spatial compression ratio (16 at release) so tiles cut the latent grid cleanly.
        name: which axis, for error messages.

    Raises:
        ValueError: non-positive sizes, sizes not multiples of `align`, or `min_overlap >= tile` (no tiling can
            advance: the released splitter loops forever on this pair).
    """
    if length <= 0 or tile <= 0 or min_overlap < 0 or align <= 0:
        raise ValueError(f"{name}: length {length}, tile {tile}, overlap {min_overlap} must be positive")
    for label, value in (("length", length), ("tile", tile), ("overlap", min_overlap)):
        if value % align:
            raise ValueError(f"{name}: {label} {value} px is not a multiple of the {align} px latent cell")
    if tile >= length:
        return AxisTiles(length, length, (0,), ())
    if min_overlap >= tile:
        raise ValueError(f"{name}: overlap {min_overlap} px must be smaller than the tile size {tile} px")
    # Smallest count with tile*n - overlap*(n-1) >= length; it exists because tile - overlap > 0.
    count = max(2, math.ceil((length - min_overlap) / (tile - min_overlap)))
    overlaps = [min_overlap] * (count - 1)
    slack = tile * count - min_overlap * (count - 1) - length
    for step in range(slack // align):
        overlaps[step % (count - 1)] += align
    starts = [0]
    for overlap in overlaps:
        starts.append(starts[-1] + tile - overlap)
    return AxisTiles(length, tile, tuple(starts), tuple(overlaps))


@dataclass(frozen=True)
class TemporalGeometry:
    """Clip geometry of the causal encoder, which the decoder windows must mirror.

    Released (diffusers config): `clip_length` 17 px frames per encoder clip, temporal ratio 4, `token_drop` 3:
    5 latents per clip, windows of 5 + 2 latents, 17 + 5 frames per window, cross-fade over 5 frames.
    """

    clip_length: int  # px frames per encoder clip (17)
    temporal_ratio: int  # px frames per latent frame (4)
    token_drop: int  # trailing latents dropped per encode (3)

    @property
    def pre_padding(self) -> int:
        """Leading px frames of a window's raw decode that belong to no frame (3): clip 17 is not a multiple of 4."""
        return (-self.clip_length) % self.temporal_ratio

    @property
    def latents_per_clip(self) -> int:
        return math.ceil(self.clip_length / self.temporal_ratio)

    @property
    def latent_overlap(self) -> int:
        """Extra latents each window reads past its clip (2), the ones `token_drop` left behind."""
        return (-self.token_drop) % self.latents_per_clip

    @property
    def window_latents(self) -> int:
        return self.latents_per_clip + self.latent_overlap

    @property
    def tail_frames(self) -> int:
        """Frames a window decodes past its own clip (5), cross-faded into the next window's head."""
        if self.token_drop == 0:
            return 0
        return max(self.latent_overlap * self.temporal_ratio - self.pre_padding, 0)

    @property
    def frames_per_item(self) -> int:
        return self.clip_length + self.tail_frames

    def kept_frames(self) -> tuple[slice, slice]:
        """Slices of a window's raw decode ([window_latents * ratio] frames): its clip frames, then its tail frames."""
        clip_end = self.latents_per_clip * self.temporal_ratio
        tail_start = clip_end + self.pre_padding
        return slice(self.pre_padding, clip_end), slice(tail_start, tail_start + self.tail_frames)


@dataclass(frozen=True)
class DecodeItem:
    """One unit of decode work: one temporal window x one spatial tile.

    Latent ranges index the *padded* latent (frames past the end repeat the last latent frame, as the reference
    pads). Its output is `[3, frames_per_item, tile_h_px, tile_w_px]`, video frames `frame_start ..
    frame_start + frames_per_item` (before the final trim) at pixels `y0..y0+tile_h_px`, `x0..x0+tile_w_px`.
    """

    index: int  # position in DecodePlan.items
    window: int
    row: int
    col: int
    latent_t: tuple[int, int]
    latent_y: tuple[int, int]
    latent_x: tuple[int, int]
    frame_start: int
    y0: int
    x0: int


@dataclass(frozen=True)
class DecodePlan:
    """Everything needed to decode a latent video as independent items and blend them back.

    Items are ordered window-major, then row, then column; a window's tiles are contiguous.
    """

    latent_frames: int
    latent_height: int
    latent_width: int
    num_frames: int  # decoded frames after the trim (17n+5 for 5n+2 latents)
    height: int  # px
    width: int  # px
    num_windows: int
    geometry: TemporalGeometry
    rows: AxisTiles
    cols: AxisTiles
    items: tuple[DecodeItem, ...]

    @property
    def tiles_per_window(self) -> int:
        return len(self.rows.starts) * len(self.cols.starts)

    def window_items(self, window: int) -> tuple[DecodeItem, ...]:
        n = self.tiles_per_window
        return self.items[window * n : (window + 1) * n]

    def window_frames(self, window: int) -> tuple[int, int]:
        """Video frames [first, stop) that are final once windows <= `window` are decoded (clipped to the trim)."""
        clip = self.geometry.clip_length
        first = window * clip
        stop = first + clip if window < self.num_windows - 1 else first + self.geometry.frames_per_item
        return min(first, self.num_frames), min(stop, self.num_frames)


def plan_decode(
    latent_frames: int,
    latent_height: int,
    latent_width: int,
    *,
    geometry: TemporalGeometry,
    spatial_ratio: int,
    tiling: TilingConfig,
) -> DecodePlan:
    """Plan the released windowed + tiled decode of a `[C, latent_frames, latent_height, latent_width]` latent.

    Mirrors the reference's padding: the latent is padded with copies of its last frame up to whole windows, and the
    frames those copies produce are trimmed at the end, so `num_frames` equals what diffusers returns.

    Raises:
        ValueError: fewer latent frames than one window needs (the reference fails there too), or a bad tiling.
    """
    if min(latent_frames, latent_height, latent_width) <= 0:
        raise ValueError(f"latent shape ({latent_frames}, {latent_height}, {latent_width}) must be positive")
    g = geometry
    if g.token_drop > 0 and g.tail_frames <= 0:
        raise ValueError(f"temporal geometry {g} leaves no frames to cross-fade between windows")
    per_clip = g.latents_per_clip
    tokens = latent_frames + g.token_drop
    pad_latents = (-tokens) % per_clip
    num_windows = (tokens + pad_latents) // per_clip - int(g.token_drop > 0)
    if num_windows <= 0:
        raise ValueError(
            f"video latent has {latent_frames} frames; at least {per_clip + 1 - g.token_drop} are needed "
            f"(one {per_clip}-latent window after {g.token_drop} dropped)"
        )
    # The reference trims the px frames the padding latents produced: a clip's last latent covers only
    # clip_length % ratio frames, the others `ratio` frames.
    tail_of_clip = g.clip_length % g.temporal_ratio
    pad_frames = sum(
        tail_of_clip if tail_of_clip and (latent_frames + k) % per_clip == 0 else g.temporal_ratio
        for k in range(pad_latents)
    )
    num_frames = num_windows * g.clip_length + g.tail_frames - pad_frames

    rows = split_axis(latent_height * spatial_ratio, tiling.tile_height, tiling.overlap_height, spatial_ratio,
                      name="tile height")
    cols = split_axis(latent_width * spatial_ratio, tiling.tile_width, tiling.overlap_width, spatial_ratio,
                      name="tile width")
    th, tw = rows.size // spatial_ratio, cols.size // spatial_ratio
    items = []
    for w in range(num_windows):
        t0 = w * per_clip
        for r, y0 in enumerate(rows.starts):
            for c, x0 in enumerate(cols.starts):
                ly, lx = y0 // spatial_ratio, x0 // spatial_ratio
                items.append(
                    DecodeItem(
                        index=len(items), window=w, row=r, col=c,
                        latent_t=(t0, t0 + g.window_latents),
                        latent_y=(ly, ly + th), latent_x=(lx, lx + tw),
                        frame_start=w * g.clip_length, y0=y0, x0=x0,
                    )
                )
    return DecodePlan(
        latent_frames=latent_frames, latent_height=latent_height, latent_width=latent_width,
        num_frames=num_frames, height=latent_height * spatial_ratio, width=latent_width * spatial_ratio,
        num_windows=num_windows, geometry=g, rows=rows, cols=cols, items=tuple(items),
    )
