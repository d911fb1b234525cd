"""Media path: colour conversion vs libswscale, MP4 properties read back with PyAV, atomic/abort behaviour,
streaming vs simple writer, staged (pinned) chunks. CPU only, tiny clips (128x96, 39 frames)."""

from __future__ import annotations

import threading
import time

import av
import numpy as np
import pytest
import torch

from h3render.colour import MediaError, frames_to_uint8, rgb_to_i420, rgb_to_yuv420p
from h3render.media import Mp4Writer, temp_path_for
from h3render.soundtrack import prepare_audio
from h3render.spec import FPS, SAMPLE_RATE as SR
from h3render.spec import audio_samples as audio_samples_for
from h3render.staging import PinnedFrameStager, StagedChunk
from tests._mp4 import decode as decode_mp4
from tests._mp4 import write_mp4

F, H, W = 39, 96, 128


def smooth_video(frames: int = F, seed: int = 0) -> torch.Tensor:
    """[3, F, H, W] float in [0, 1]: moving colour gradients plus mild noise (compresses like real video)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames, dtype=torch.float32).view(frames, 1, 1)
    y = torch.linspace(0, 1, H).view(1, H, 1)
    x = torch.linspace(0, 1, W).view(1, 1, W)
    r = 0.5 + 0.4 * torch.sin(6.0 * x + 0.2 * t)
    gch = 0.5 + 0.4 * torch.cos(5.0 * y - 0.15 * t)
    b = 0.5 + 0.4 * torch.sin(4.0 * (x + y) + 0.1 * t)
    video = torch.stack([c.expand(frames, H, W) for c in (r, gch, b)])  # [3, F, H, W]
    return (video + 0.02 * torch.randn(3, frames, H, W, generator=g)).clamp(0, 1)


def stereo(samples: int, seed: int = 1) -> torch.Tensor:
    """[2, samples] float: 40 random tones under 4 kHz per channel (aperiodic, so a shift shows)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.arange(samples, dtype=torch.float64) / SR).view(1, 1, -1)
    freq = 50 + 3950 * torch.rand(2, 40, 1, generator=g, dtype=torch.float64)
    phase = 2 * torch.pi * torch.rand(2, 40, 1, generator=g, dtype=torch.float64)
    return (0.02 * torch.sin(2 * torch.pi * freq * t + phase).sum(1)).float()


def decode(path) -> tuple[np.ndarray, np.ndarray]:
    """Decoded yuv420p planes packed as [F, H*3//2, W] uint8 and audio [2, n] float32."""
    return decode_mp4(path, video_format=None)


def no_files(path) -> bool:
    return not path.exists() and not temp_path_for(path).exists()


def swscale_i420(rgb: np.ndarray) -> np.ndarray:
    """Reference: PyAV/libswscale rgb24 -> yuv420p, BT.709 limited range, per frame [H*3//2, W]."""
    out = []
    for frame in rgb:
        src = av.VideoFrame.from_ndarray(frame, format="rgb24")
        dst = src.reformat(format="yuv420p", src_colorspace="ITU709", dst_colorspace="ITU709",
                           src_color_range="JPEG", dst_color_range="MPEG")
        out.append(dst.to_ndarray())
    return np.stack(out)


# ------------------------------------------------------------------------- colour


def test_frames_to_uint8_rounds_clamps_and_transposes():
    video = torch.zeros(3, 2, 2, 4)
    video[0, 0, 0, 0] = 1.0
    video[1, 0, 0, 1] = 0.5 / 255  # half rounds to even -> 0
    video[1, 0, 0, 2] = 1.5 / 255  # -> 2
    video[2, 1, 1, 3] = 7.0  # clamped -> 255
    video[2, 1, 0, 0] = -3.0  # clamped -> 0
    video[0, 1, 1, 1] = 100.4 / 255  # -> 100
    out = frames_to_uint8(video)
    assert out.shape == (2, 2, 4, 3) and out.dtype == torch.uint8
    assert out[0, 0, 0].tolist() == [255, 0, 0]
    assert out[0, 0, 1, 1] == 0 and out[0, 0, 2, 1] == 2
    assert out[1, 1, 3, 2] == 255 and out[1, 0, 0, 2] == 0
    assert out[1, 1, 1, 0] == 100


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_frames_to_uint8_refuses_non_finite(bad):
    video = torch.rand(3, 2, 4, 4)
    video[1, 1, 2, 3] = bad
    with pytest.raises(MediaError, match="NaN or inf"):
        frames_to_uint8(video)


@pytest.mark.parametrize("hw", [(96, 128), (34, 18), (8, 32)])
def test_rgb_to_yuv420p_matches_swscale(hw):
    h, w = hw
    rgb = np.random.default_rng(0).integers(0, 256, (4, h, w, 3), dtype=np.uint8)
    ours = rgb_to_i420(torch.from_numpy(rgb)).numpy()
    ref = swscale_i420(rgb)
    diff = np.abs(ours.astype(np.int16) - ref)
    print(f"{h}x{w}: max |ours - swscale| = {diff.max()}, exact {np.mean(diff == 0):.4f}")
    assert ours.shape == (4, h * 3 // 2, w)
    assert diff.max() <= 1
    assert np.mean(diff == 0) > 0.9  # a wrong matrix or chroma filter is off by many codes, not 1

    y, u, v = rgb_to_yuv420p(torch.from_numpy(rgb))
    assert y.shape == (4, h, w) and u.shape == v.shape == (4, h // 2, w // 2)
    flat = ours.reshape(4, -1)
    assert np.array_equal(y.numpy().reshape(4, -1), flat[:, : h * w])
    assert np.array_equal(v.numpy().reshape(4, -1), flat[:, h * w + h * w // 4 :])


def test_rgb_to_i420_float_input_equals_uint8_input():
    video = smooth_video(3)
    a = rgb_to_i420(video)
    b = rgb_to_i420(frames_to_uint8(video))
    assert torch.equal(a, b)


def test_rgb_to_i420_known_colours():
    # BT.709 limited range: white (235,128,128), black (16,128,128), pure red (63,102,240).
    rgb = torch.zeros(1, 2, 6, 3, dtype=torch.uint8)
    rgb[:, :, 0:2] = 255
    rgb[:, :, 4:6, 0] = 255
    y, u, v = rgb_to_yuv420p(rgb)
    assert y[0, 0].tolist() == [235, 235, 16, 16, 63, 63]
    assert u[0, 0].tolist() == [128, 128, 102] and v[0, 0].tolist() == [128, 128, 240]


# ------------------------------------------------------------------------- writing


def test_clip_properties(tmp_path):
    path = tmp_path / "clip.mp4"
    want_samples = audio_samples_for(F)
    assert want_samples == 52_000
    write_mp4(path, smooth_video(), stereo(want_samples + 300))  # trimmed before encoding
    assert path.exists() and not temp_path_for(path).exists()

    head = path.read_bytes()[:64]
    assert head.index(b"moov") < len(head)  # +faststart: the index precedes the media data

    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        cc = v.codec_context
        assert cc.name == "h264" and cc.pix_fmt == "yuv420p" and cc.profile == "High"
        assert (v.width, v.height) == (W, H)
        assert v.average_rate == FPS and v.frames == F
        assert (cc.color_primaries, cc.color_trc, cc.colorspace, cc.color_range) == (1, 1, 1, 1)
        assert a.codec_context.name == "aac" and a.codec_context.profile == "LC"
        assert a.sample_rate == SR and a.channels == 2
        v_dur = float(v.duration * v.time_base)
        a_dur = float(a.duration * a.time_base)
    frames, audio = decode(path)
    print(f"decoded {frames.shape[0]} frames, {audio.shape[1]} samples (want {want_samples}); "
          f"durations video {v_dur:.4f} s audio {a_dur:.4f} s")
    assert frames.shape == (F, H * 3 // 2, W)
    assert audio.shape[0] == 2 and abs(audio.shape[1] - want_samples) <= 1024
    assert abs(v_dur - F / FPS) <= 0.032 and abs(a_dur - F / FPS) <= 0.032

    # The content survives: a wrong colour matrix or range would move Y by >10 codes.
    ref = rgb_to_i420(smooth_video()).numpy()
    err = np.abs(frames.astype(np.int16) - ref).mean()
    print(f"mean |decoded - source| = {err:.3f} codes")
    assert err < 3.0
    # ... and so does the audio, aligned: priming left in (no edit list) would lag it by 1024 samples.
    src = prepare_audio(stereo(want_samples + 300), want_samples)
    seg = src[0, 8000:40000]
    lags = np.arange(-1500, 1501)
    xcorr = [np.dot(seg, audio[0, 8000 + k : 40000 + k]) for k in lags]
    lag = int(lags[int(np.argmax(xcorr))])
    corr = np.corrcoef(seg, audio[0, 8000:40000])[0, 1]
    print(f"audio: best lag {lag} samples, correlation at lag 0 = {corr:.4f}")
    assert lag == 0 and corr > 0.9
    # The alignment is the MP4 edit list's doing: read without it, the 1024 priming samples come first.
    with av.open(str(path), options={"ignore_editlist": "1"}) as c:
        raw = np.concatenate([f.to_ndarray() for f in c.decode(audio=0)], axis=1)
    raw_lag = int(lags[int(np.argmax([np.dot(seg, raw[0, 8000 + k : 40000 + k]) for k in lags]))])
    print(f"without the edit list: {raw.shape[1]} samples, lag {raw_lag}")
    assert raw_lag == 1024


def test_streaming_equals_simple(tmp_path):
    video = smooth_video()
    audio = stereo(audio_samples_for(F))
    simple = write_mp4(tmp_path / "simple.mp4", video, audio)
    rgb = frames_to_uint8(video)
    with Mp4Writer(tmp_path / "stream.mp4", W, H, F) as writer:
        for start in range(0, F, 17):  # windows of 17 frames, like the VAE's temporal windows
            writer.write_frames(rgb[start : start + 17])
        writer.write_audio(audio)  # audio after the frames: must still interleave into a valid file
    a_frames, a_audio = decode(simple)
    b_frames, b_audio = decode(tmp_path / "stream.mp4")
    diff = np.abs(a_frames.astype(np.int16) - b_frames).max()
    print(f"streaming vs simple: max frame diff {diff}, audio diff {np.abs(a_audio - b_audio).max():.2e}")
    assert a_frames.shape == b_frames.shape and diff <= 1
    assert a_audio.shape == b_audio.shape and np.allclose(a_audio, b_audio, atol=1e-4)
    assert writer.marks["end"] > writer.marks["start"] and writer.stats["encode_s"] > 0


def test_i420_planes_path_matches_rgb_path(tmp_path):
    # Near-lossless CRF so that the comparison sees the encoder inputs, not x264's quantization noise.
    video = smooth_video()
    audio = stereo(audio_samples_for(F))
    write_mp4(tmp_path / "rgb.mp4", video, audio, crf=4)
    i420 = rgb_to_i420(video)
    y, u, v = rgb_to_yuv420p(video)
    with Mp4Writer(tmp_path / "i420.mp4", W, H, F, crf=4) as writer:
        writer.write_audio(audio)
        writer.write_frames(i420[:20])
        writer.write_frames((y[20:], u[20:], v[20:]))  # plane tuple form
    a, _ = decode(tmp_path / "rgb.mp4")
    b, _ = decode(tmp_path / "i420.mp4")
    src = i420.numpy().astype(np.int16)
    diff = np.abs(a.astype(np.int16) - b)
    print(f"i420 vs rgb path: mean {diff.mean():.3f} max {diff.max()}; vs source: "
          f"rgb {np.abs(a - src).mean():.3f}, i420 {np.abs(b - src).mean():.3f}")
    # Swapped or misplaced planes, or a second colour conversion, would cost tens of codes on average.
    assert np.abs(b - src).mean() < 1.0
    assert np.abs(b - src).mean() < 1.2 * np.abs(a - src).mean()
    assert diff.mean() < 1.0


@pytest.mark.parametrize("where", ["frames", "audio"])
def test_non_finite_input_leaves_no_file(tmp_path, where):
    path = tmp_path / "bad.mp4"
    video, audio = smooth_video(), stereo(audio_samples_for(F))
    if where == "frames":
        video[0, 30, 5, 7] = float("nan")
    else:
        audio[1, 1000] = float("inf")
    with pytest.raises(MediaError, match=r"bad\.mp4: .*NaN or inf"):
        write_mp4(path, video, audio)
    assert no_files(path)


def test_nan_chunk_mid_stream_aborts(tmp_path):
    path = tmp_path / "bad.mp4"
    video = smooth_video()
    with pytest.raises(MediaError):
        with Mp4Writer(path, W, H, F) as writer:
            writer.write_frames(frames_to_uint8(video[:, :34]))
            deadline = time.monotonic() + 10  # libavformat creates the file with the first packet
            while not temp_path_for(path).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert temp_path_for(path).exists()
            video[2, 35] = float("nan")
            writer.write_frames(frames_to_uint8(video[:, 34:]))
    assert no_files(path)


@pytest.mark.parametrize("exc", [RuntimeError("decode failed"), KeyboardInterrupt()])
def test_producer_exception_removes_temp(tmp_path, exc):
    path = tmp_path / "clip.mp4"
    rgb = frames_to_uint8(smooth_video())
    with pytest.raises(type(exc)):
        with Mp4Writer(path, W, H, F) as writer:
            writer.write_frames(rgb[:17])
            writer.write_frames(rgb[17:34])
            raise exc
    assert no_files(path)


def test_encoder_thread_error_reaches_producer(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    rgb = frames_to_uint8(smooth_video())
    calls = []
    original = Mp4Writer._encode_video

    def failing(self, kind, array):
        calls.append(array.shape[0])
        if len(calls) == 2:
            raise OSError("disk full")
        original(self, kind, array)

    monkeypatch.setattr(Mp4Writer, "_encode_video", failing)
    writer = Mp4Writer(path, W, H, F, queue_chunks=1)
    with pytest.raises(MediaError, match="disk full"):
        for start in range(0, F, 4):
            writer.write_frames(rgb[start : start + 4])
            time.sleep(0.01)
        writer.write_audio(stereo(audio_samples_for(F)))
        writer.close()
    assert no_files(path)
    assert writer._thread.is_alive() is False


def test_frame_count_is_enforced(tmp_path):
    rgb = frames_to_uint8(smooth_video())
    path = tmp_path / "short.mp4"
    writer = Mp4Writer(path, W, H, F, audio=False)
    writer.write_frames(rgb[:30])
    with pytest.raises(MediaError, match="got 30 frames, expected 39"):
        writer.close()
    assert no_files(path)

    path = tmp_path / "long.mp4"
    writer = Mp4Writer(path, W, H, F - 1, audio=False)
    with pytest.raises(MediaError, match="got 39 frames, expected 38"):
        writer.write_frames(rgb)
    assert no_files(path)


def test_bad_chunks_are_refused(tmp_path):
    rgb = frames_to_uint8(smooth_video(4))
    for bad, match in [
        (rgb.float(), "uint8"),
        (rgb[:, :, :64], "got shape"),
        (rgb.numpy()[0], "got shape"),
        ("frames", "numpy array or torch tensor"),
    ]:
        path = tmp_path / "x.mp4"
        writer = Mp4Writer(path, W, H, 4, audio=False)
        with pytest.raises(MediaError, match=match):
            writer.write_frames(bad)
        assert no_files(path)
    with pytest.raises(MediaError, match="numpy frames must be uint8"):
        write_mp4(tmp_path / "f.mp4", rgb.numpy().astype(np.float32), None)
    with pytest.raises(MediaError, match="even"):
        Mp4Writer(tmp_path / "odd.mp4", 127, 96, 4)
    with pytest.raises(MediaError, match="does not exist"):
        Mp4Writer(tmp_path / "missing" / "x.mp4", W, H, 4)


def test_existing_file_is_replaced_only_on_success(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"old")
    rgb = frames_to_uint8(smooth_video(5))
    with pytest.raises(RuntimeError):
        with Mp4Writer(path, W, H, 5, audio=False) as writer:
            writer.write_frames(rgb)
            raise RuntimeError("stop")
    assert path.read_bytes() == b"old" and not temp_path_for(path).exists()
    write_mp4(path, rgb, None)
    with av.open(str(path)) as c:
        assert c.streams.video[0].frames == 5 and len(c.streams.audio) == 0


def test_prepare_audio_trims_pads_and_refuses():
    want = audio_samples_for(107)  # 142,667: the audio VAE gives 178 latents x 800 = 142,400
    assert want == 142_667
    short = torch.full((2, 142_400), 0.25)
    out = prepare_audio(short, want)
    assert out.shape == (2, want) and out.dtype == np.float32
    assert np.all(out[:, :142_400] == 0.25) and np.all(out[:, 142_400:] == 0)
    loud = np.full((2, want + 50), 3.0, dtype=np.float64)
    assert np.all(prepare_audio(loud, want) == 1.0)
    with pytest.raises(MediaError, match="at most 800 short"):
        prepare_audio(torch.zeros(2, want - 801), want)
    with pytest.raises(MediaError, match="stereo"):
        prepare_audio(torch.zeros(1, want), want)


def test_prepare_audio_measures_the_peak_and_the_clipped_samples_before_clipping():
    """Issue #29: audio beyond full scale was clipped with no trace; the peak and the clip count are measured first,
    over the kept samples only (the trimmed tail does not count), summed over windows."""
    from h3render.soundtrack import AudioLevels

    levels = AudioLevels()
    wave = np.full((2, 1000), 0.5, dtype=np.float32)
    wave[0, 10:20] = 2.0  # +6.02 dBFS, 10 samples over
    wave[1, 30] = -1.0  # exactly full scale: what the released VAE's own clamp leaves of a clipped sample
    wave[:, 900:] = 8.0  # beyond `samples`: trimmed, not measured
    out = prepare_audio(wave, 900, levels=levels)
    assert out.max() == 1.0 and out.min() == 0.5 - 1.5  # clipped as before
    assert levels.to_dict() == {"peak_dbfs": pytest.approx(20 * np.log10(2.0)), "clipped_samples": 11,
                                "samples": 1800, "clipped_fraction": pytest.approx(11 / 1800)}
    prepare_audio(np.full((2, 200), 0.25), 200, levels=levels)  # a second window adds to it
    assert (levels.clipped, levels.samples) == (11, 2200)
    assert levels.warning("clip.mp4") == ("h3render: warning: clip.mp4: 11 of 2200 audio samples (0.5%) reached "
                                          "full scale and were clipped (peak +6.0 dBFS); the sidecar's extra.audio "
                                          "records it")
    quiet = AudioLevels()
    prepare_audio(np.zeros((2, 100)), 100, levels=quiet)
    assert quiet.warning("x") is None and quiet.to_dict()["peak_dbfs"] is None  # silence: no -inf in JSON


def test_the_writer_exposes_what_write_audio_measured(tmp_path):
    samples = audio_samples_for(F)
    loud = np.full((2, samples), 0.1, dtype=np.float32)
    loud[:, :100] = 1.5
    with Mp4Writer(tmp_path / "a.mp4", W, H, F) as writer:
        writer.write_audio(loud)
        writer.write_frames(frames_to_uint8(smooth_video()))
    assert writer.audio_levels.clipped == 200 and writer.audio_levels.samples == 2 * samples
    assert writer.audio_levels.peak == pytest.approx(1.5)


def test_back_pressure_blocks_producer(tmp_path, monkeypatch):
    gate = threading.Event()
    original = Mp4Writer._encode_video

    def gated(self, kind, array):
        gate.wait(5)
        original(self, kind, array)

    monkeypatch.setattr(Mp4Writer, "_encode_video", gated)
    rgb = frames_to_uint8(smooth_video(4))
    writer = Mp4Writer(tmp_path / "bp.mp4", W, H, 4, audio=False, queue_chunks=1)
    writer.write_frames(rgb[0:1])  # taken by the (gated) encoder thread
    time.sleep(0.05)
    writer.write_frames(rgb[1:2])  # fills the queue
    done = threading.Event()
    third = threading.Thread(target=lambda: (writer.write_frames(rgb[2:3]), done.set()))
    third.start()
    assert not done.wait(0.3)  # queue full: the producer waits
    gate.set()
    assert done.wait(5)
    third.join()
    writer.write_frames(rgb[3:4])
    writer.close()
    assert writer.stats["blocked_s"] > 0.2
    assert (tmp_path / "bp.mp4").exists()


# ------------------------------------------------------------------------- staging


def test_stager_is_a_pass_through_on_cpu():
    rgb = frames_to_uint8(smooth_video(3))
    staged = PinnedFrameStager().stage(rgb)
    assert isinstance(staged, StagedChunk)
    assert np.shares_memory(staged.array, rgb.numpy())  # no host copy
    with pytest.raises(MediaError, match="uint8"):
        PinnedFrameStager().stage(rgb.float())


class CountingChunk(StagedChunk):
    def __init__(self, array):
        self.waits = self.releases = 0
        super().__init__(array, wait=self._wait, release=self._release)

    def _wait(self):
        self.waits += 1

    def _release(self):
        self.releases += 1


def test_writer_waits_and_releases_staged_chunks(tmp_path):
    i420 = rgb_to_i420(smooth_video(6)).numpy()
    chunks = [CountingChunk(i420[:3]), CountingChunk(i420[3:])]
    with Mp4Writer(tmp_path / "s.mp4", W, H, 6, audio=False) as writer:
        for c in chunks:
            writer.write_frames(c)
    assert [(c.waits, c.releases) for c in chunks] == [(1, 1), (1, 1)]

    # A refused chunk is released too, so a stager never waits forever on it.
    bad = CountingChunk(i420[:, :10])
    writer = Mp4Writer(tmp_path / "t.mp4", W, H, 6, audio=False)
    with pytest.raises(MediaError):
        writer.write_frames(bad)
    assert bad.releases == 1


def test_a_signal_while_the_close_waits_for_the_queue_aborts_instead_of_hanging(tmp_path, monkeypatch):
    """Ctrl-C right after the decode, while `finish_async` waited to queue the close behind the frames: `abort`
    then joined an encoder thread that was never told to close, forever (a fresh-user trial, 3 of 3 runs)."""
    rgb = frames_to_uint8(smooth_video())
    writer = Mp4Writer(tmp_path / "a.mp4", W, H, F, audio=False)
    writer.write_frames(rgb)
    real_put = Mp4Writer._put

    def interrupted(self, item):
        if item is not None and not isinstance(item, tuple):  # the close marker, not a frame chunk
            raise KeyboardInterrupt
        return real_put(self, item)

    monkeypatch.setattr(Mp4Writer, "_put", interrupted)
    outcome = []

    def close():
        try:
            writer.finish_async()
        except KeyboardInterrupt:
            outcome.append("interrupted")

    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "finish_async hung after the interrupt"
    assert outcome == ["interrupted"]
    assert not writer._thread.is_alive()
    assert not writer.tmp_path.exists() and not (tmp_path / "a.mp4").exists()
