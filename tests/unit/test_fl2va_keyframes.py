"""fl2va keyframes: file checks, canvas, stretch / cover-crop, pixel-exact against diffusers 0.42.1's own
`MiniMaxH3ResizeStep` on the same PIL images."""

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from h3render.keyframes import cover_crop_box, keyframe_pixels, load_keyframe, prepare_keyframes
from h3render.spec import SPATIAL_COMPRESSION

pytest.importorskip("diffusers")


def _write(path, w, h, seed=0, mode="RGB", fmt=None):
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8), mode).save(path, format=fmt)
    return path


def diffusers_resize(first, last, width=None, height=None):
    """diffusers' ResizeStep on the same decoded images: (canvas (w, h), keyframes, anchors)."""
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    pipe = MiniMaxH3ResizeStep().init_pipeline()
    out = pipe(image=first, last_image=last, height=height, width=width,
               output=["height", "width", "keyframes", "keyframe_anchors"])
    return (out["width"], out["height"]), out["keyframes"], out["keyframe_anchors"]


def _check_against_diffusers(first, last, width=None, height=None):
    ours = prepare_keyframes(first, last, width, height)
    canvas, ref_images, ref_anchors = diffusers_resize(first and first.image, last and last.image, width, height)
    assert (ours.width, ours.height) == canvas
    assert ours.anchors == tuple(ref_anchors)
    assert len(ours.images) == len(ref_images)
    for mine, ref in zip(ours.images, ref_images):
        assert mine.size == ref.size == canvas
        assert np.array_equal(np.asarray(mine), np.asarray(ref))
    return ours


def test_first_only_auto_canvas_from_4_3(tmp_path):
    first = load_keyframe(_write(tmp_path / "a.png", 400, 300), "first")
    ours = _check_against_diffusers(first, None)
    assert (ours.width, ours.height) == (1024, 768)
    info = ours.info[0]
    assert info["resize"] == "stretch" and info["size"] == [400, 300] and info["canvas"] == [1024, 768]
    assert info["sha256"] == hashlib.sha256((tmp_path / "a.png").read_bytes()).hexdigest()
    assert info["format"] == "PNG" and info["bytes"] == (tmp_path / "a.png").stat().st_size


def test_keyframe_already_at_canvas_size_passes_untouched(tmp_path):
    first = load_keyframe(_write(tmp_path / "a.png", 1024, 768, seed=1), "first")
    ours = _check_against_diffusers(first, None)
    assert ours.info[0]["resize"] == "none"
    assert np.array_equal(np.asarray(ours.images[0]), np.asarray(first.image))


def test_last_only_is_the_leading_keyframe(tmp_path):
    last = load_keyframe(_write(tmp_path / "z.webp", 300, 500, seed=2, fmt="WEBP"), "last")
    ours = _check_against_diffusers(None, last)
    assert ours.anchors == ("last",)
    assert (ours.width, ours.height) == (768, 1280)  # 3:5 portrait by the canvas rule
    assert ours.info[0]["resize"] == "stretch" and ours.info[0]["format"] == "WEBP"


def test_both_follower_cover_crop_where_the_library_crop_is_one_pixel_off(tmp_path):
    from diffusers.image_processor import VaeImageProcessor

    first = load_keyframe(_write(tmp_path / "a.jpg", 640, 360, seed=3, fmt="JPEG"), "first")
    last = load_keyframe(_write(tmp_path / "b.png", 999, 1001, seed=4), "last")
    ours = _check_against_diffusers(first, last)
    assert (ours.width, ours.height) == (1344, 768) and ours.anchors == ("first", "last")
    assert ours.info[1]["resize"] == "cover-crop"
    # s = 1344/999: 1001 * s = 1346.69 rounds to 1347 rows; the library floors to 1346 and so crops 1 px elsewhere.
    assert ours.info[1]["resized_to"] == [1344, 1347] and ours.info[1]["crop_box"] == [0, 289, 1344, 1057]
    library = VaeImageProcessor(vae_scale_factor=SPATIAL_COMPRESSION).resize(last.image, height=768, width=1344,
                                                                            resize_mode="crop")
    assert not np.array_equal(np.asarray(library), np.asarray(ours.images[1]))


def test_both_at_an_explicit_canvas(tmp_path):
    first = load_keyframe(_write(tmp_path / "a.png", 400, 300, seed=5), "first")
    last = load_keyframe(_write(tmp_path / "b.png", 300, 400, seed=6), "last")
    ours = _check_against_diffusers(first, last, width=512, height=320)
    assert [i["resize"] for i in ours.info] == ["stretch", "cover-crop"]
    with pytest.raises(ValueError, match="together"):
        prepare_keyframes(first, last, width=512)
    with pytest.raises(ValueError, match="multiples of 32"):
        prepare_keyframes(first, last, width=500, height=320)


def test_cover_crop_box_rounds_half_to_even():
    # 8 x 5 onto 36 x 20: s = max(36/8, 20/5) = 4.5, 5 * 4.5 = 22.5 -> 22 (half to even; half up would give 23).
    assert cover_crop_box(8, 5, 36, 20) == ((36, 22), (0, 1, 36, 21))
    # 5 x 2 onto 96 x 32: s = max(19.2, 16) -> 96 x 38.4 -> 38 rows, top = 3.
    assert cover_crop_box(5, 2, 96, 32) == ((96, 38), (0, 3, 96, 35))


def test_pixels_are_uint8_single_frame(tmp_path):
    image = load_keyframe(_write(tmp_path / "a.png", 64, 32, seed=7), "first").image
    pixels = keyframe_pixels(image)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 1, 32, 64)
    # what diffusers' KeyframeVaeEncoderStep builds: np.array(image) -> permute(2, 0, 1)[None, :, None]
    ref = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None, :, None]
    assert torch.equal(pixels[None], ref)


# -- errors -------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.png: keyframe image not found"):
        load_keyframe(tmp_path / "nope.png")


def test_corrupt_and_truncated_images(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not an image at all")
    with pytest.raises(ValueError, match=r"bad\.png: not a decodable image"):
        load_keyframe(bad)
    good = _write(tmp_path / "cut.png", 64, 64)
    good.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cut\.png: not a decodable image"):
        load_keyframe(good)


def test_rgba_is_flattened_onto_white_and_reported(tmp_path):
    rgba = np.zeros((32, 64, 4), dtype=np.uint8)
    rgba[..., :3] = (10, 200, 30)
    rgba[:, :32, 3] = 255  # left half opaque green, right half fully transparent
    rgba[:, 32:, :3] = (0, 0, 0)  # transparent pixels store black: a plain convert("RGB") would keep it
    path = tmp_path / "alpha.png"
    Image.fromarray(rgba, "RGBA").save(path)
    keyframe = load_keyframe(path, "first")
    pixels = np.asarray(keyframe.image)
    assert keyframe.image.mode == "RGB" and keyframe.source_mode == "RGBA" and keyframe.alpha_flattened
    assert (pixels[:, :32] == (10, 200, 30)).all() and (pixels[:, 32:] == 255).all()
    info = prepare_keyframes(keyframe, None, 64, 32).info[0]
    assert info["alpha"] == "flattened onto white" and info["mode"] == "RGBA" and info["resize"] == "none"


def test_aspect_outside_1_4_to_4_1(tmp_path):
    with pytest.raises(ValueError, match=r"wide\.png: keyframe aspect ratio 500x100 \(5:1\) is outside"):
        load_keyframe(_write(tmp_path / "wide.png", 500, 100))
    assert load_keyframe(_write(tmp_path / "ok.png", 400, 100)).size == (400, 100)  # 4:1 itself is allowed


def test_animation_is_refused(tmp_path):
    path = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (32, 32), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    with pytest.raises(ValueError, match=r"anim\.gif: .*animation \(2 frames\)"):
        load_keyframe(path)


def test_no_keyframe():
    with pytest.raises(ValueError, match="first frame, a last frame or both"):
        prepare_keyframes(None, None)


def test_opaque_rgba_is_not_reported_as_flattened(tmp_path):
    rgba = np.full((32, 64, 4), 255, dtype=np.uint8)
    rgba[..., :3] = (10, 200, 30)
    path = tmp_path / "opaque.png"
    Image.fromarray(rgba, "RGBA").save(path)
    keyframe = load_keyframe(path, "first")
    assert keyframe.source_mode == "RGBA" and not keyframe.alpha_flattened
    assert (np.asarray(keyframe.image) == (10, 200, 30)).all()
    assert "alpha" not in prepare_keyframes(keyframe, None, 64, 32).info[0]


def test_one_translucent_pixel_is_flattened(tmp_path):
    rgba = np.full((32, 64, 4), 255, dtype=np.uint8)
    rgba[0, 0, 3] = 254
    path = tmp_path / "almost.png"
    Image.fromarray(rgba, "RGBA").save(path)
    assert load_keyframe(path, "first").alpha_flattened


def test_16_bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 64 * 32).round().astype(np.uint16).reshape(32, 64)
    path = tmp_path / "deep.png"
    Image.fromarray(ramp).save(path)
    keyframe = load_keyframe(path, "first")
    assert keyframe.source_mode.startswith("I") and not keyframe.alpha_flattened
    pixels = np.asarray(keyframe.image)
    expected = np.rint(ramp.astype(np.float64) * 255 / 65535).astype(np.uint8)
    assert keyframe.image.mode == "RGB"
    for channel in range(3):
        assert np.array_equal(pixels[..., channel], expected)
    assert (pixels[..., 0] == 255).mean() < 0.01  # Pillow's convert("RGB") made 99.5 % of this ramp white


@pytest.mark.parametrize("mode", ["I;16B", "I"])
def test_other_16_bit_modes_scale_by_value(mode):
    from h3render.keyframes import _to_rgb

    values = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)
    if mode == "I":
        image = Image.fromarray(values.astype(np.int32), "I")
    else:
        image = Image.frombytes(mode, (4, 1), values.astype(">u2").tobytes())
    assert image.mode == mode
    assert np.asarray(_to_rgb(image))[0, :, 0].tolist() == [0, 1, 128, 255]


def test_32_bit_values_beyond_16_bits_are_refused_with_the_file(tmp_path):
    path = tmp_path / "wide.tif"
    Image.fromarray(np.array([[0, 70000]] * 4, dtype=np.int32), "I").save(path)
    with pytest.raises(ValueError, match=r"wide\.tif: I pixel values span 0 \.\.\. 70000, outside 0 \.\.\. 65535"):
        load_keyframe(path)
