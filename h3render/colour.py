"""Frame conversion on the decode device: float RGB -> uint8 RGB -> BT.709 limited-range yuv420p.

Everything here is plain torch, so it runs where the frames are (the GPU after the VAE decode, the CPU in
tests) and hands the host only 1.5 bytes per pixel (I420) instead of 12 (float RGB) or 3 (uint8 RGB).

Layouts used below:
    video   [3, F, H, W] float in [0, 1]   (the video VAE's output after denormalisation, diffusers' layout)
    rgb     [F, H, W, 3] uint8             (channel-last, what PyAV's ``rgb24`` frames hold)
    i420    [F, H*3//2, W] uint8           (per frame: Y [H, W], then U [H/2, W/2], then V [H/2, W/2], flat;
                                            what ``av.VideoFrame.from_ndarray(..., format="yuv420p")`` reads)
"""

from __future__ import annotations

import torch

__all__ = [
    "MediaError",
    "frames_to_uint8",
    "rgb_to_i420",
    "rgb_to_yuv420p",
    "split_i420",
]

# ITU-R BT.709-6 item 3.2 luma weights; limited ("MPEG"/TV) range puts 8-bit Y' in [16, 235] and Cb/Cr in
# [16, 240] around 128 (ITU-R BT.709-6 item 4.6, scaled by 2^(8-8)).
_KR, _KB = 0.2126, 0.0722
_KG = 1.0 - _KR - _KB
_Y_SCALE, _C_SCALE = 219.0 / 255.0, 224.0 / 255.0


class MediaError(ValueError):
    """Frames, audio or an output file the media path refuses: non-finite values, wrong shape or dtype,
    wrong frame count, or an encoder/muxer failure. Raising it always leaves no file under the final name."""


def _yuv_matrix(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """BT.709 limited-range RGB [0, 255] -> Y'CbCr matrix [3, 3] (rows Y, U, V) and offsets [3], float32."""
    y = (_KR, _KG, _KB)
    cb = tuple((float(b) - w) / (2.0 * (1.0 - _KB)) for b, w in zip((0, 0, 1), y))
    cr = tuple((float(r) - w) / (2.0 * (1.0 - _KR)) for r, w in zip((1, 0, 0), y))
    rows = [[_Y_SCALE * v for v in y], [_C_SCALE * v for v in cb], [_C_SCALE * v for v in cr]]
    matrix = torch.tensor(rows, dtype=torch.float64).to(device=device, dtype=torch.float32)
    offset = torch.tensor([16.0, 128.0, 128.0], dtype=torch.float32, device=device)
    return matrix, offset


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Quantize decoded video to channel-last 8-bit RGB on the tensor's own device.

    Args:
        video: ``[3, F, H, W]`` floating point, nominally in [0, 1]; values outside are clamped.
    Returns:
        ``[F, H, W, 3]`` uint8, contiguous, on ``video.device``: ``round(clamp(x, 0, 1) * 255)`` with
        round-half-to-even (what diffusers' ``numpy_to_pil`` does with numpy's ``round``).
    Raises:
        MediaError: wrong rank/channel count, integer input, or any NaN/inf value (never a black frame).
    """
    if video.ndim != 4 or video.shape[0] != 3:
        raise MediaError(f"video: expected [3, F, H, W] float RGB, got shape {tuple(video.shape)}")
    if not video.is_floating_point():
        raise MediaError(f"video: expected floating point in [0, 1], got {video.dtype}")
    if not bool(torch.isfinite(video).all()):
        raise MediaError("video: frames contain NaN or inf (the decode diverged); refusing to write them")
    # Quantize while still channel-first, then permute the 1-byte result: the transpose moves 4x less memory.
    q = video.float().clamp(0.0, 1.0).mul(255.0).round().to(torch.uint8)  # [3, F, H, W]
    return q.permute(1, 2, 3, 0).contiguous()  # [F, H, W, 3]


def _as_rgb_uint8(video: torch.Tensor) -> torch.Tensor:
    if video.dtype == torch.uint8:
        if video.ndim != 4 or video.shape[-1] != 3:
            raise MediaError(f"rgb: expected uint8 [F, H, W, 3], got shape {tuple(video.shape)}")
        return video
    return frames_to_uint8(video)


def rgb_to_i420(video: torch.Tensor) -> torch.Tensor:
    """RGB -> BT.709 limited-range yuv420p, packed I420, on the tensor's own device.

    Matches libswscale's rgb24 -> yuv420p conversion with PyAV's default BILINEAR scaler (what
    ``VideoFrame.reformat(format="yuv420p", dst_colorspace="ITU709", dst_color_range="MPEG")`` does) within
    +-1 code value: luma per pixel; chroma from the mean of each horizontal pixel pair (swscale's ``*ToUV_half``
    input path), then a vertical ``[1, 3, 3, 1] / 8`` bilinear 2:1 filter over rows ``2i-1 .. 2i+2`` with the
    edge rows repeated. Both put the chroma sample at the centre of its 2x2 block (``AVCHROMA_LOC_CENTER``).

    Args:
        video: uint8 ``[F, H, W, 3]`` RGB, or float ``[3, F, H, W]`` in [0, 1] (quantized first with
            :func:`frames_to_uint8`, so both inputs give the same planes). H and W must be even.
    Returns:
        uint8 ``[F, H*3//2, W]``: per frame Y ``[H, W]`` then U and V ``[H/2, W/2]`` each, flat.
    Raises:
        MediaError: bad shape/dtype, odd H or W, non-finite float input.
    """
    rgb = _as_rgb_uint8(video)
    f, h, w, _ = rgb.shape
    if h % 2 or w % 2:
        raise MediaError(f"rgb: yuv420p needs even height and width, got {h}x{w} (HxW)")
    matrix, offset = _yuv_matrix(rgb.device)
    x = rgb.float()  # [F, H, W, 3] in [0, 255]

    y = torch.matmul(x, matrix[0]).add_(offset[0])  # [F, H, W]

    pairs = (x[:, :, 0::2] + x[:, :, 1::2]) * 0.5  # [F, H, W/2, 3]
    padded = torch.cat([pairs[:, :1], pairs, pairs[:, -1:]], dim=1)  # [F, H+2, W/2, 3]; row r+1 is row r
    # Output row i covers source rows 2i-1, 2i, 2i+1, 2i+2 = padded rows 2i .. 2i+3.
    rows = (padded[:, 0:h:2] + padded[:, 3 : h + 3 : 2]).add_(
        (padded[:, 1 : h + 1 : 2] + padded[:, 2 : h + 2 : 2]).mul_(3.0)
    ).mul_(0.125)  # [F, H/2, W/2, 3]
    uv = torch.matmul(rows, matrix[1:].T).add_(offset[1:])  # [F, H/2, W/2, 2]

    out = torch.empty((f, h * w * 3 // 2), dtype=torch.uint8, device=rgb.device)
    c = h * w // 4
    out[:, : h * w] = y.round_().clamp_(0, 255).reshape(f, h * w).to(torch.uint8)
    uv = uv.round_().clamp_(0, 255).to(torch.uint8)
    out[:, h * w : h * w + c] = uv[..., 0].reshape(f, c)
    out[:, h * w + c :] = uv[..., 1].reshape(f, c)
    return out.view(f, h * 3 // 2, w)


def split_i420(i420: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the three planes of a packed I420 tensor ``[F, H*3//2, W]``:
    Y ``[F, H, W]``, U ``[F, H/2, W/2]``, V ``[F, H/2, W/2]`` (no copy)."""
    f = i420.shape[0]
    flat = i420.reshape(f, height * width * 3 // 2)
    c = height * width // 4
    y = flat[:, : height * width].view(f, height, width)
    u = flat[:, height * width : height * width + c].view(f, height // 2, width // 2)
    v = flat[:, height * width + c :].view(f, height // 2, width // 2)
    return y, u, v


def rgb_to_yuv420p(video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RGB -> BT.709 limited-range yuv420p planes ``(Y [F, H, W], U [F, H/2, W/2], V [F, H/2, W/2])`` uint8.

    The planes are views of one packed I420 buffer (see :func:`rgb_to_i420` for the input layouts, the
    rounding and the chroma filter); pass that buffer on with ``rgb_to_i420`` when handing frames to the writer.
    """
    i420 = rgb_to_i420(video)
    h = i420.shape[1] * 2 // 3
    return split_i420(i420, h, i420.shape[2])
