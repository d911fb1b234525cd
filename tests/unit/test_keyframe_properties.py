"""Property tests of every keyframe file kind the loaders accept (issue #28 item 10): PNG 8/16-bit, greyscale, RGB,
RGBA, palette (with and without a transparent colour), JPEG, WebP (lossless and lossy), each possibly truncated or
behind the wrong extension. Each either loads as the right RGB picture (exact for lossless files: 16-bit scaled by
value, transparency composited onto white, a palette looked up) or is one line naming the file, as a `ValueError`
from `load_keyframe` and as a usage error (exit 2) of `batch --dry-run`: never a traceback."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from h3render.keyframes import ALPHA_BACKGROUND, load_keyframe

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (format, Pillow mode): what each format can store. "P+t": a palette with a transparent index (tRNS).
KINDS = [("PNG", m) for m in ("1", "L", "LA", "P", "P+t", "RGB", "RGBA", "I;16")] + \
        [("JPEG", m) for m in ("L", "RGB")] + [("WEBP", m) for m in ("RGB", "RGBA")]
EXTENSIONS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp"}


def _picture(mode: str, width: int, height: int, seed: int):
    """(a Pillow image in `mode`, the RGB uint8 array h3render must make of it)."""
    rng = np.random.default_rng(seed)
    white = np.array(ALPHA_BACKGROUND, dtype=np.float64)
    if mode == "I;16":
        values = rng.integers(0, 65536, (height, width), dtype=np.uint16)
        grey = np.rint(values.astype(np.float64) * 255 / 65535).astype(np.uint8)  # scaled by value, not clipped
        return Image.fromarray(values), np.repeat(grey[..., None], 3, axis=2)
    if mode in ("P", "P+t"):
        palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
        index = rng.integers(0, 256, (height, width), dtype=np.uint8)
        if mode == "P+t":
            index[0, 0] = 7
        image = Image.fromarray(index)
        image.putpalette(palette.flatten().tolist())  # an "L" image with a palette becomes "P"
        rgb = palette[index].copy()
        if mode == "P+t":
            image.info["transparency"] = 7
            rgb[index == 7] = ALPHA_BACKGROUND
        return image, rgb
    channels = {"1": 1, "L": 1, "LA": 2, "RGB": 3, "RGBA": 4}[mode]
    data = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    if mode == "1":
        bits = data[..., 0] > 127
        return Image.fromarray(bits), np.repeat((bits * 255).astype(np.uint8)[..., None], 3, axis=2)
    if mode == "L":
        return Image.fromarray(data[..., 0]), np.repeat(data, 3, axis=2)
    colour = np.repeat(data[..., :1], 3, axis=2) if mode == "LA" else data[..., :3]
    image = Image.fromarray(data)  # (h, w, 2) is "LA", 3 "RGB", 4 "RGBA"
    assert image.mode == mode
    if channels in (2, 4):
        alpha = data[..., -1:].astype(np.float64) / 255
        return image, colour * alpha + white * (1 - alpha)
    return image, colour


def _encode(image: Image.Image, fmt: str, lossless: bool) -> bytes:
    out = io.BytesIO()
    options = {"WEBP": {"lossless": lossless, "quality": 95}, "JPEG": {"quality": 95}}.get(fmt, {})
    if "transparency" in image.info:
        options["transparency"] = image.info["transparency"]
    image.save(out, format=fmt, **options)
    return out.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("keyframes")


@FAST
@given(kind=st.sampled_from(KINDS), width=st.integers(8, 48), height=st.integers(8, 48), seed=st.integers(0, 99),
       lossless=st.booleans(), wrong_extension=st.booleans(),
       cut=st.one_of(st.none(), st.floats(0.0, 0.95, allow_subnormal=False)), data=st.data())
def test_every_keyframe_file_kind_loads_right_or_is_one_line(folder, kind, width, height, seed, lossless,
                                                             wrong_extension, cut, data):
    fmt, mode = kind
    image, want = _picture(mode, width, height, seed)
    encoded = _encode(image, fmt, lossless)
    if cut is not None:
        encoded = encoded[:int(len(encoded) * cut)]
    others = [ext for f, ext in EXTENSIONS.items() if f != fmt]
    suffix = data.draw(st.sampled_from(others)) if wrong_extension else EXTENSIONS[fmt]
    path = folder / f"k{seed}-{width}x{height}{suffix}"
    path.write_bytes(encoded)
    ratio = width / height
    try:
        keyframe = load_keyframe(path)
    except ValueError as exc:
        message = str(exc)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
        assert cut is not None or not 0.25 <= ratio <= 4, message  # only a cut file (or no picture) is refused
        return
    got = np.asarray(keyframe.image)
    assert keyframe.image.mode == "RGB" and got.shape == (height, width, 3)
    assert keyframe.format == fmt  # found by content, whatever the extension says
    exact = fmt == "PNG" or (fmt == "WEBP" and lossless)
    if exact:
        assert np.abs(got.astype(np.int16) - np.rint(want).astype(np.int16)).max() <= (1 if mode in ("LA", "RGBA")
                                                                                       else 0)
    else:  # lossy: the decoder's picture (Pillow's own decode of the same bytes), alpha composited onto white
        with Image.open(io.BytesIO(encoded)) as decoded:
            rgba = np.asarray(decoded.convert("RGBA")).astype(np.float64)
        alpha = rgba[..., 3:] / 255
        reference = rgba[..., :3] * alpha + np.array(ALPHA_BACKGROUND, dtype=np.float64) * (1 - alpha)
        assert np.abs(got.astype(np.float64) - reference).max() <= 1
    assert keyframe.alpha_flattened == (mode in ("LA", "RGBA", "P+t") and bool((np.asarray(image.convert("RGBA"))
                                                                               [..., 3] < 255).any()))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), cut=st.one_of(st.none(), st.floats(0.0, 0.9, allow_subnormal=False)))
def test_a_keyframe_of_any_kind_in_a_manifest_is_a_plan_or_one_line(folder, kind, cut):
    """The same files through `batch --dry-run`: a plan (exit 0), or one `file:line:` error naming the keyframe
    (exit 2); never a traceback."""
    from tests._cli import invoke, one_error_line

    fmt, mode = kind
    image, _ = _picture(mode, 64, 48, 1)
    encoded = _encode(image, fmt, lossless=True)
    if cut is not None:
        encoded = encoded[:int(len(encoded) * cut)]
    path = folder / f"m-{fmt}-{mode.replace(';', '')}-{cut}{EXTENSIONS[fmt]}"
    path.write_bytes(encoded)
    manifest = folder / "m.jsonl"
    manifest.write_text(json.dumps({"prompt": "x", "output": "x", "first_frame": str(path)}) + "\n")
    result = invoke("batch", str(manifest), "--out-dir", str(folder / "out"), "--dry-run")
    if result.exit_code == 0:
        assert cut is None or cut > 0, result.output
        return
    line = one_error_line(result)
    assert f"{manifest}:1" in line and str(path) in line, line
