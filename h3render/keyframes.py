"""fl2va keyframes: load and validate an image file, choose the canvas, put the keyframes onto it.

What the released model expects (diffusers 0.42.1 `MiniMaxH3ResizeStep`, the numerical oracle):

* keyframes are packed `[first, last]`, absent ones skipped; the first one given is the *leading* keyframe (a
  last-frame-only job makes the last frame the leading one);
* without an explicit canvas, the canvas is the released rule (`h3render.spec.canvas_for_aspect`) at the leading
  keyframe's aspect ratio;
* the leading keyframe is stretched onto the canvas (PIL LANCZOS); the follower is cover-cropped: scaled by
  `s = max(W / w, H / h)` to `(max(W, round(w * s)), max(H, round(h * s)))` (Python's round, half to even) with
  LANCZOS, then cropped at `((rw - W) // 2, (rh - H) // 2)`. diffusers avoids `VaeImageProcessor`'s crop mode on
  purpose: it is 1 px off at some ratios;
* a keyframe already at canvas size passes through untouched.

diffusers takes in-memory PIL images and does no RGB conversion; h3render reads files, so it also: applies the EXIF
orientation (as diffusers' `load_image` does), scales high-bit-depth pixels to 8 bits (a 16-bit PNG's `v` becomes
`round(v * 255 / 65535)`; Pillow's own conversion clips at 255), converts to RGB, flattens any alpha that is not fully
opaque onto white, and says so in the keyframe's info. Errors raise `ValueError` naming the file and the problem; the manifest code adds `file:line: field`.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from h3render.spec import (
    CANVAS_MULTIPLE,
    MAX_ASPECT,
    MIN_ASPECT,
    RELEASED_MAX_PIXELS,
    RELEASED_SHORT_EDGE,
    canvas_for_aspect,
)

if TYPE_CHECKING:
    import torch

ANCHORS = ("first", "last")  # packed order of the keyframes (diffusers `keyframe_anchors`)
ALPHA_BACKGROUND = (255, 255, 255)  # what a transparent pixel becomes: white, as an image viewer shows it


@dataclass(frozen=True)
class Keyframe:
    """One decoded, validated keyframe file.

    Attributes:
        anchor: "first", "last" or a pixel frame index (`packing.keyframe_time`).
        path: the file as given (resolved by the caller).
        image: the decoded picture, EXIF-oriented, mode "RGB" (alpha flattened onto white).
        sha256: hex digest of the file's bytes (what resume compares).
        num_bytes: file size.
        format: Pillow's format name ("PNG", "JPEG", "WEBP", ...).
        source_mode: Pillow mode before conversion ("RGB", "RGBA", "P", "L", ...).
        alpha_flattened: the file had transparency, which was composited onto white.
        exif_transposed: an EXIF orientation tag rotated or flipped the picture.
    """

    anchor: str | int
    path: Path
    image: Image.Image = field(repr=False)
    sha256: str
    num_bytes: int
    format: str
    source_mode: str
    alpha_flattened: bool
    exif_transposed: bool

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in px after EXIF orientation."""
        return self.image.size


@dataclass(frozen=True)
class PreparedKeyframes:
    """The keyframes of one job on its canvas, in packed order.

    Attributes:
        width, height: the canvas in px (multiples of 32).
        anchors: per image, "first", "last" or a pixel frame index, packed order (released fl2va: `("first",)`,
            `("last",)` or `("first", "last")`).
        images: RGB PIL images of exactly `width x height`.
        info: one JSON-able dict per keyframe for the sidecar (see `prepare_keyframes`).
    """

    width: int
    height: int
    anchors: tuple[str | int, ...]
    images: tuple[Image.Image, ...] = field(repr=False)
    info: tuple[dict[str, Any], ...]


def load_keyframe(path: str | Path, anchor: str = "first") -> Keyframe:
    """Read, decode and validate one keyframe file.

    Args:
        path: an image file Pillow decodes (PNG, JPEG, WebP at least; a still image, not an animation).
        anchor: "first", "last" or a pixel frame index (recorded; where the job anchors the picture).

    Raises:
        ValueError: `"<path>: <problem>"` when the file is missing, unreadable, not a decodable still image, or its
            aspect ratio is outside 1:4 ... 4:1.
    """
    if anchor not in ANCHORS and (isinstance(anchor, bool) or not isinstance(anchor, int) or anchor < 0):
        raise ValueError(f"keyframe anchor must be one of {ANCHORS} or a frame index >= 0, got {anchor!r}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: keyframe image not found")
    if not path.is_file():
        raise ValueError(f"{path}: keyframe image is not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read keyframe image ({exc.strerror or exc})") from None
    # Decode the very bytes that were hashed, so the recorded sha256 is the content that was rendered.
    try:
        with Image.open(io.BytesIO(data)) as opened:
            fmt = opened.format or "unknown"
            frames = getattr(opened, "n_frames", 1)
            if frames > 1:
                raise ValueError(f"{path}: keyframe image is an animation ({frames} frames); give a still image")
            opened.load()
            oriented = ImageOps.exif_transpose(opened)
            exif_transposed = _orientation(opened) > 1
            source_mode = opened.mode
            try:
                image = _to_rgb(oriented)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
    except ValueError:
        raise
    except UnidentifiedImageError:
        raise ValueError(f"{path}: not a decodable image (Pillow recognizes no image format in its "
                         f"{len(data):,} bytes)") from None
    except (OSError, SyntaxError, Image.DecompressionBombError, EOFError) as exc:
        raise ValueError(f"{path}: not a decodable image ({type(exc).__name__}: {exc})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{path}: keyframe image is empty ({width}x{height})")
    ratio = width / height
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise ValueError(f"{path}: keyframe aspect ratio {width}x{height} ({ratio:.3g}:1) is outside the supported "
                         f"1:4 ... 4:1")
    return Keyframe(anchor=anchor, path=path, image=image, sha256=hashlib.sha256(data).hexdigest(),
                    num_bytes=len(data), format=fmt, source_mode=source_mode,
                    alpha_flattened=_has_alpha(oriented), exif_transposed=exif_transposed)


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(0x0112, 1))  # EXIF Orientation tag; 1 = as stored
    except Exception:  # a malformed EXIF block is no reason to refuse the picture
        return 1


def _has_alpha(image: Image.Image) -> bool:
    """Whether some pixel is less than fully opaque: an RGBA file whose alpha is 255 everywhere has nothing to
    flatten, and saying "alpha flattened" for it would send the user looking for a problem that is not there."""
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return image.getchannel("A").getextrema()[0] < 255
    if "transparency" in image.info and image.mode in ("P", "L", "RGB"):  # a palette / tRNS transparent colour
        return image.convert("RGBA").getchannel("A").getextrema()[0] < 255
    return False


# Pillow's integer modes wider than 8 bits. PNG stores 16-bit greyscale as I;16 (older Pillow: I); the full range
# 0..65535 maps onto 0..255.
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_SIXTEEN_BIT_MAX = 65535


def _to_eight_bit(image: Image.Image) -> Image.Image:
    """An "L" image from a 16-bit or float greyscale one, scaled by value (`round(v * 255 / 65535)`; float: 0..1
    -> `round(v * 255)`), because `convert("L")` clips every value above 255 to white.

    Raises:
        ValueError: pixel values outside the mode's range (a 32-bit "I" above 65535, a float outside 0..1), which
            no scale maps without guessing the file's intended range.
    """
    values = np.asarray(image)
    if image.mode == "F":
        top = 1.0
        what = "float pixel values"
    else:
        top = float(_SIXTEEN_BIT_MAX)
        what = f"{image.mode} pixel values"
    low, high = float(values.min()), float(values.max())
    if low < 0 or high > top or not np.isfinite(values).all():
        raise ValueError(f"{what} span {low:g} ... {high:g}, outside 0 ... {top:g}; convert the keyframe to an "
                         f"8- or 16-bit image")
    scaled = np.rint(values.astype(np.float64) * (255.0 / top)).astype(np.uint8)
    return Image.fromarray(scaled, "L")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB copy; high-bit-depth greyscale is scaled to 8 bits; transparency is composited onto `ALPHA_BACKGROUND`
    (a plain `convert("RGB")` would keep whatever colour the transparent pixels happen to store)."""
    if image.mode in _SIXTEEN_BIT_MODES or image.mode == "F":
        image = _to_eight_bit(image)
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resolve_canvas(
    leading: Keyframe | Image.Image,
    width: int | None = None,
    height: int | None = None,
    *,
    short_edge: int = RELEASED_SHORT_EDGE,
    max_pixels: int = RELEASED_MAX_PIXELS,
) -> tuple[int, int]:
    """(width, height) of an fl2va job: the explicit pair when given, else the canvas rule at the leading keyframe's
    aspect ratio (released: short edge 768, area cap 768 x 1344, multiples of 32; a 4:3 keyframe -> 1024 x 768).

    Raises:
        ValueError: only one of width/height given, or not positive multiples of 32.
    """
    if (width is None) != (height is None):
        raise ValueError("width and height must be given together, or neither (the canvas then follows the "
                         "leading keyframe)")
    if width is None:
        return canvas_for_aspect(*leading.size, short_edge=short_edge, max_pixels=max_pixels)
    if width <= 0 or height <= 0 or width % CANVAS_MULTIPLE or height % CANVAS_MULTIPLE:
        raise ValueError(f"canvas {width}x{height}: width and height must be positive multiples of {CANVAS_MULTIPLE}")
    return int(width), int(height)


def cover_crop_box(src_w: int, src_h: int, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """The follower's cover crop: the resized size `(rw, rh)` and the crop box `(left, top, right, bottom)` in it.

    `s = max(W / w, H / h)`; `rw = max(W, round(w * s))`, `rh = max(H, round(h * s))` with Python's round (half to
    even, as the reference); `left = (rw - W) // 2`, `top = (rh - H) // 2`.
    """
    scale = max(width / src_w, height / src_h)
    resized = (max(width, round(src_w * scale)), max(height, round(src_h * scale)))
    left, top = max(0, (resized[0] - width) // 2), max(0, (resized[1] - height) // 2)
    return resized, (left, top, left + width, top + height)


def fit_keyframe(image: Image.Image, width: int, height: int, leading: bool) -> tuple[Image.Image, dict[str, Any]]:
    """Put one RGB image onto the canvas: untouched at canvas size, else stretched (leading) or cover-cropped.

    Returns:
        `(image of exactly width x height, {"resize": "none" | "stretch" | "cover-crop", ...})`; a cover crop also
        records `"resized_to": [rw, rh]` and `"crop_box": [left, top, right, bottom]`.
    """
    if image.size == (width, height):
        return image, {"resize": "none"}
    if leading:
        return image.resize((width, height), Image.Resampling.LANCZOS), {"resize": "stretch"}
    resized_size, box = cover_crop_box(*image.size, width, height)
    resized = image.resize(resized_size, Image.Resampling.LANCZOS)
    return resized.crop(box), {"resize": "cover-crop", "resized_to": list(resized_size), "crop_box": list(box)}


def prepare_keyframes(
    first: Keyframe | None,
    last: Keyframe | None,
    width: int | None = None,
    height: int | None = None,
    *,
    short_edge: int = RELEASED_SHORT_EDGE,
    max_pixels: int = RELEASED_MAX_PIXELS,
) -> PreparedKeyframes:
    """The job's canvas and its keyframes on it, in packed order `[first, last]` (absent ones skipped).

    Each info dict: `anchor`, `path`, `sha256`, `bytes`, `format`, `mode` (before conversion), `size` [w, h] of the
    decoded picture, `canvas` [W, H], `resize` (and the crop geometry, see `fit_keyframe`), plus `"alpha": "flattened
    onto white"` and `"exif_transposed": true` when they applied.

    Raises:
        ValueError: no keyframe given; a canvas error (see `resolve_canvas`).
    """
    return prepare_keyframe_list([k for k in (first, last) if k is not None], width, height, short_edge=short_edge,
                                 max_pixels=max_pixels)


def prepare_keyframe_list(
    given: list[Keyframe],
    width: int | None = None,
    height: int | None = None,
    *,
    short_edge: int = RELEASED_SHORT_EDGE,
    max_pixels: int = RELEASED_MAX_PIXELS,
) -> PreparedKeyframes:
    """`prepare_keyframes` for any keyframes in packed order (by frame: first, frame indices ascending, last): the
    leading one (the first of the list) sets the canvas when none is given and is stretched onto it, the others are
    cover-cropped, as diffusers treats its follower.

    Raises:
        ValueError: no keyframe given; a canvas error (see `resolve_canvas`).
    """
    if not given:
        raise ValueError("fl2va needs a first frame, a last frame or both")
    canvas_w, canvas_h = resolve_canvas(given[0], width, height, short_edge=short_edge, max_pixels=max_pixels)
    images, infos = [], []
    for index, keyframe in enumerate(given):
        fitted, how = fit_keyframe(keyframe.image, canvas_w, canvas_h, leading=index == 0)
        info = {"anchor": keyframe.anchor, "path": str(keyframe.path), "sha256": keyframe.sha256,
                "bytes": keyframe.num_bytes, "format": keyframe.format, "mode": keyframe.source_mode,
                "size": list(keyframe.size), "canvas": [canvas_w, canvas_h], **how}
        if keyframe.alpha_flattened:
            info["alpha"] = "flattened onto white"
        if keyframe.exif_transposed:
            info["exif_transposed"] = True
        images.append(fitted)
        infos.append(info)
    return PreparedKeyframes(canvas_w, canvas_h, tuple(k.anchor for k in given), tuple(images), tuple(infos))


def keyframe_pixels(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as the video VAE's one-frame clip: `[3, 1, H, W]` uint8 (CPU).

    `VideoVAE.encode_condition` takes it as is (it divides by 255 in float32, as diffusers'
    `encode_vae_condition` does).
    """
    import torch  # here only: the manifest reader decodes keyframes (`load_keyframe`) before torch is imported

    if image.mode != "RGB":
        raise ValueError(f"keyframe pixels need an RGB image, got mode {image.mode}")
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)[:, None].contiguous()
