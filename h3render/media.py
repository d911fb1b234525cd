"""MP4 output: H.264 (libx264, yuv420p, High, BT.709 limited) + AAC-LC stereo, written with PyAV.

The writer is streaming: the caller (the GPU VAE decode) hands over chunks of frames and returns to work at
once, while a background thread converts, encodes and muxes. A bounded queue gives back-pressure. The file
is written as ``<name>.tmp.mp4`` beside the target, fsynced and renamed only when complete and valid; any
error or interrupt removes the temp file, so a path either holds a finished clip or nothing.

Frames reach the writer in one of two layouts (see :mod:`h3render.colour`):
    rgb    [n, H, W, 3] uint8  -> libswscale (rgb24 -> yuv420p, BT.709 limited) on the encoder thread
    i420   [n, H*3//2, W] uint8 (or a (Y, U, V) tuple) -> straight to libx264, no swscale pass
On a GPU, convert there with :func:`h3render.colour.rgb_to_i420` and stage through
:class:`PinnedFrameStager`: the copy is half the bytes of RGB and the encoder thread skips swscale.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
import torch

from h3render.colour import MediaError
from h3render.soundtrack import AudioLevels, prepare_audio
from h3render.spec import FPS, SAMPLE_RATE, X264_CRF, audio_samples
from h3render.staging import StagedChunk

# AVColorPrimaries / AVColorTransferCharacteristic / AVColorSpace BT709 = 1; AVColorRange MPEG (limited) = 1.
_BT709 = 1
_RANGE_MPEG = 1
# PyAV opens encoders with SLICE threading, which libx264 turns into sliced threads; frame threads give more
# frames per second per core (measured: see the report in docs/ or the writer's docstring).
_X264_THREAD_TYPE = "FRAME"

Frames = Union[np.ndarray, torch.Tensor, Sequence[np.ndarray], Sequence[torch.Tensor], "StagedChunk"]


def temp_path_for(path: Union[str, os.PathLike]) -> Path:
    """``clip.mp4`` -> ``clip.tmp.mp4`` in the same folder (same filesystem, so the final rename is atomic)."""
    p = Path(path)
    return p.with_name(p.stem + ".tmp" + p.suffix)


_CLOSE = object()


class Mp4Writer:
    """Streaming MP4 writer (context manager) with a background encoder thread.

    Video: libx264, yuv420p, profile High, BT.709 primaries/transfer/matrix, limited range, chroma sited at
    the centre (what swscale and :func:`h3render.colour.rgb_to_i420` produce), CRF ``crf`` with preset
    ``preset``, constant ``fps`` (frame i has pts i in time base 1/fps). libx264 threads: ``threads=0`` lets
    x264 choose (about 1.5 threads per core) and frame threading is forced: PyAV's default (slice threads)
    took 2.75 s against 1.79 s for 1344x768x243 at veryfast on 16 cores (H200 host, 2026-11-30).
    Audio: AAC-LC stereo at ``sample_rate``, trimmed to ``audio_samples(frames)`` before encoding; the
    encoder's 1024-sample priming is hidden by the MP4 edit list that libavformat writes, so a decoder
    returns the trimmed length (within one AAC frame). AAC runs on the same thread, interleaved after each
    video chunk (0.23-0.33 s for 10 s of stereo; it hides under the decode like the video does, and a second
    thread would have to share the muxer). Muxed with ``movflags=+faststart`` (index first).

    Args:
        path: final ``.mp4`` path; its folder must exist. An existing file there is replaced on success.
        width, height: frame size in pixels, both even (yuv420p).
        frames: exact frame count the clip must end with (checked at ``close``).
        crf: x264 constant rate factor (1..51, `spec.X264_CRF`; 18 ~ visually lossless).
        preset: x264 preset name ("ultrafast" .. "placebo").
        sample_rate, fps: released model: 32000 Hz, 24 fps.
        audio: whether an audio track is written (then ``write_audio`` must be called once per window before
            close).
        windows: frame counts of the windows the clip is rendered in, in order, summing to ``frames`` (default
            one window of ``frames``). Each window hands over its own soundtrack (``write_audio``, once per window,
            in order); window i's audio fills samples ``audio_samples(F_0 + .. + F_{i-1})`` up to
            ``audio_samples(F_0 + .. + F_i)``, so the rounding never drifts over many windows.
        audio_bitrate: AAC bit rate in bit/s.
        queue_chunks: bound of the hand-off queue, in chunks (back-pressure on the producer).
        threads: libx264 threads, 0 = auto.
        x264_params: extra libx264 settings in x264's ``key=value:key=value`` syntax (``x264-params``), e.g. for
            measuring alternatives with ``scripts/bench.py --stages media``; None adds nothing.

    Raises:
        MediaError: bad arguments, bad chunks/audio, wrong final frame count, or an encoder failure. Every
        error aborts the writer: the temp file is removed and nothing exists under ``path``.

    After ``close()``, ``stats`` holds durations in seconds (the sidecar's ``extra.writer``): ``open_s`` (open to
    rename), ``encode_s`` (encoder-thread busy time), ``audio_s`` (AAC part of it), ``finalize_s`` (flush,
    trailer, faststart rewrite, fsync, rename) and its parts ``flush_s`` (draining x264 and AAC), ``trailer_s``
    (index + faststart rewrite), ``sync_s`` (fsync + rename), ``blocked_s`` (producer waiting on back-pressure),
    ``last_frame_in_s`` (open to the last frame handed over) and ``frames_done_s`` (open to the encoder thread
    having taken in the last frame). ``marks`` holds the same instants as ``time.perf_counter`` values (``start``,
    ``last_frame_in``, ``frames_done``, ``end``), for a ``StageTimer`` interval on the caller's clock. ``audio_levels``
    (`soundtrack.AudioLevels`) holds the soundtrack's peak and clipped samples, measured by ``write_audio`` before
    it clips to full scale.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        width: int,
        height: int,
        frames: int,
        *,
        crf: int = 18,
        preset: str = "veryfast",
        sample_rate: int = SAMPLE_RATE,
        fps: int = FPS,
        audio: bool = True,
        audio_bitrate: int = 128_000,
        queue_chunks: int = 4,
        threads: int = 0,
        x264_params: str | None = None,
        windows: Sequence[int] | None = None,
    ) -> None:
        import av  # imported here so that importing h3render does not load libav

        self.path = Path(path)
        if self.path.suffix.lower() != ".mp4":
            raise MediaError(f"{self.path}: output name must end in .mp4")
        if not self.path.parent.is_dir():
            raise MediaError(f"{self.path}: output folder {self.path.parent} does not exist")
        if not os.access(self.path.parent, os.W_OK):
            raise MediaError(f"{self.path}: output folder {self.path.parent} is not writable")
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise MediaError(f"{self.path}: width and height must be positive and even, got {width}x{height}")
        if frames < 1:
            raise MediaError(f"{self.path}: frames must be >= 1, got {frames}")
        if not X264_CRF[0] <= crf <= X264_CRF[1]:  # 0 is lossless, which x264's High profile refuses
            raise MediaError(f"{self.path}: crf must be in {X264_CRF[0]}..{X264_CRF[1]} (High profile), got {crf}")
        windows = (frames,) if windows is None else tuple(int(n) for n in windows)
        if not windows or min(windows) < 1 or sum(windows) != frames:
            raise MediaError(f"{self.path}: windows {list(windows)} must be >= 1 frame each and sum to {frames}")
        self.tmp_path = temp_path_for(self.path)
        self.width, self.height, self.frames, self.fps = width, height, frames, fps
        self.sample_rate = sample_rate
        self.audio_samples = audio_samples(frames, sample_rate, fps)
        self.marks: dict[str, float] = {"start": time.perf_counter()}
        self.stats: dict[str, float] = {"encode_s": 0.0, "audio_s": 0.0, "finalize_s": 0.0, "flush_s": 0.0,
                                        "trailer_s": 0.0, "sync_s": 0.0, "blocked_s": 0.0}

        self._frames_in = 0  # frames accepted from the producer
        # Sample boundaries of the windows' soundtracks: [0, a_1, ..., audio_samples] (cumulative, see `windows`).
        ends = np.cumsum(windows)
        self._audio_bounds = [0] + [audio_samples(int(n), sample_rate, fps) for n in ends]
        self._audio_windows = 0  # soundtracks handed over (producer side)
        self._audio_ready = 0  # samples of them the encoder thread may read (encoder side, set through the queue)
        self._audio: np.ndarray | None = None
        self._has_audio = audio
        self.audio_levels = AudioLevels()  # what write_audio measured before clipping (the sidecar's extra.audio)
        self._error: BaseException | None = None
        self._state = "open"  # open -> closing (tail on the encoder thread) -> closed | aborted
        self._then: Callable[[BaseException | None], object] | None = None
        self._done: Future = Future()  # the tail's outcome (finish_async)
        self._abort_flag = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_chunks))

        try:
            self._container = av.open(str(self.tmp_path), "w", format="mp4", options={"movflags": "+faststart"})
        except Exception as exc:
            raise MediaError(f"{self.path}: cannot create {self.tmp_path.name}: {exc}") from exc
        try:
            self._setup_streams(av, crf, preset, audio_bitrate, threads, x264_params)
        except Exception as exc:
            self._discard()
            raise MediaError(f"{self.path}: cannot set up the encoders: {exc}") from exc

        self._thread = threading.Thread(target=self._run, name=f"mp4-encode:{self.path.name}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- setup

    def _setup_streams(self, av, crf: int, preset: str, audio_bitrate: int, threads: int,
                       x264_params: str | None) -> None:
        options = {"crf": str(crf), "preset": preset, "profile": "high", "chroma_sample_location": "center"}
        if x264_params:
            options["x264-params"] = x264_params
        v = self._container.add_stream("libx264", rate=Fraction(self.fps), options=options)
        v.width, v.height, v.pix_fmt = self.width, self.height, "yuv420p"
        v.time_base = Fraction(1, self.fps)
        cc = v.codec_context
        cc.color_primaries = _BT709
        cc.color_trc = _BT709
        cc.colorspace = _BT709
        cc.color_range = _RANGE_MPEG
        cc.thread_count = threads
        cc.thread_type = _X264_THREAD_TYPE
        cc.open()  # now, so a bad preset or size fails here rather than on the encoder thread
        self._video = v
        self._reformatter = av.video.reformatter.VideoReformatter()
        self._av = av
        self._pts = 0

        self._aac = None
        if self._has_audio:
            a = self._container.add_stream("aac", rate=self.sample_rate, layout="stereo")
            a.bit_rate = audio_bitrate
            a.time_base = Fraction(1, self.sample_rate)
            self._aac = a
        self._audio_pos = 0  # samples already handed to the AAC encoder

    # ---------------------------------------------------------------- producer side

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write_frames(self, chunk: Frames) -> None:
        """Queue a chunk of frames for encoding; returns once queued (blocks while the queue is full).

        Args:
            chunk: uint8 RGB ``[n, H, W, 3]``, uint8 I420 ``[n, H*3//2, W]``, a ``(Y, U, V)`` tuple of uint8
                planes ``[n, H, W]``, ``[n, H/2, W/2]`` x2, or a :class:`StagedChunk`; numpy or CPU torch.
                The writer reads the array later on its thread: do not modify it after this call.
        Raises:
            MediaError: wrong layout/dtype/size, a CUDA tensor, more frames than ``frames``, or an earlier
                encoder failure (the writer is then aborted).
        """
        staged = chunk if isinstance(chunk, StagedChunk) else None
        queued = False
        try:
            self._check_usable()
            kind, array = self._classify(staged.array if staged else chunk)
            n = array.shape[0]
            if self._frames_in + n > self.frames:
                raise MediaError(f"{self.path}: got {self._frames_in + n} frames, expected {self.frames}")
            self._frames_in += n
            self._put((kind, array, staged))
            queued = True
            if self._frames_in == self.frames:
                self._mark("last_frame_in")
        except BaseException:
            if staged is not None and not queued:
                staged.release()
            self.abort()
            raise

    def write_audio(self, waveform: Union[np.ndarray, torch.Tensor]) -> None:
        """Hand over the next window's soundtrack (once per window, in order, any time before ``close``; with one
        window, the whole soundtrack).

        Args:
            waveform: float ``[2, samples]`` (left, right) at ``sample_rate``, nominally in [-1, 1] (the
                released audio VAE clamps to it; values beyond are clipped, and counted in ``audio_levels``).
                Longer than the window's share of
                ``audio_samples(frames)`` (see ``windows``) is trimmed; up to 800 samples (one audio latent)
                short is zero-padded.
        Raises:
            MediaError: not ``[2, samples]``, NaN/inf, too short, more calls than windows, or no audio track.
        """
        try:
            self._check_usable()
            if not self._has_audio:
                raise MediaError(f"{self.path}: writer was opened with audio=False")
            window = self._audio_windows
            if window == len(self._audio_bounds) - 1:
                raise MediaError(f"{self.path}: write_audio called {window + 1} times for {window} window(s)")
            start, end = self._audio_bounds[window], self._audio_bounds[window + 1]
            block = prepare_audio(waveform, end - start, name=str(self.path), levels=self.audio_levels)
            if self._audio is None:
                self._audio = np.zeros((2, self.audio_samples), dtype=np.float32)
            self._audio[:, start:end] = block  # the encoder thread reads it only once told through the queue
            self._audio_windows = window + 1
            self._put(("audio", end, None))
        except BaseException:
            self.abort()
            raise

    def close(self) -> None:
        """Finish encoding, write the trailer, fsync and rename the temp file onto ``path``; waits for all of it.

        Raises:
            MediaError: frame count short of ``frames``, audio missing, or an encoder failure (aborted).
        """
        if self._state == "closed":
            return
        self.finish_async().result()

    def finish_async(self, then: Callable[[BaseException | None], object] | None = None) -> Future:
        """Start the writer's tail on its own thread and return at once: encoder flush, trailer, fsync, rename onto
        ``path``, then the one completion callback ``then(error)``. The GPU is free meanwhile, so the next job's
        prompt encode and denoise run beside the tail (0.13-0.5 s at 1344x768x243 on an H200 host).

        ``then`` runs on the writer's thread exactly once, whatever happens after this call: ``then(None)`` once the
        MP4 is in place (the job writes its sidecar there), or ``then(error)`` when the tail failed (the temp file
        is already removed; the job closes its progress there).

        Returns:
            A Future of ``then(None)``'s result (None without ``then``). It raises MediaError for an encoder failure
            (nothing exists under ``path``), or what ``then(None)`` raised (the MP4 is in place by then).
        Raises:
            MediaError: frame count short of ``frames`` or audio missing, found before the tail starts (aborted).
        """
        try:
            self._check_usable()
            if self._frames_in != self.frames:
                raise MediaError(f"{self.path}: got {self._frames_in} frames, expected {self.frames}")
            if self._has_audio and self._audio_windows != len(self._audio_bounds) - 1:
                raise MediaError(f"{self.path}: audio was written for {self._audio_windows} of "
                                 f"{len(self._audio_bounds) - 1} window(s) (call write_audio before close)")
            self._then, self._state = then, "closing"
            try:
                self._put(_CLOSE)
            except BaseException:
                # The close never reached the encoder (Ctrl-C while the queue was full): abort as an open writer.
                # As "closing", `abort` waited for a tail that was never asked for, forever (a second signal is
                # ignored during the cleanup), and left the temp file, the job's lock and a "running" report.
                self._state = "open"
                raise
        except BaseException:
            self.abort()
            raise
        return self._done

    def abort(self) -> None:
        """Stop encoding and delete the temp file; nothing is left under ``path``'s temp or final name
        by this writer. Safe to call more than once and after errors."""
        if self._state == "closing":
            self._join()  # the tail ends on its own (its Future says how); the files are its business now
            return
        if self._state != "open":
            return
        self._state = "aborted"
        self._abort_flag.set()
        self._drain_queue()  # unblocks a thread waiting on a full queue and frees staged buffers
        try:
            self._queue.put_nowait(_CLOSE)
        except queue.Full:
            pass
        self._join()
        self._drain_queue()
        self._discard()

    # ---------------------------------------------------------------- internals (producer thread)

    def _check_usable(self) -> None:
        if self._state != "open":
            raise MediaError(f"{self.path}: writer is {self._state}")
        if self._error is not None:
            raise MediaError(f"{self.path}: encoding failed: {self._error!r}") from self._error

    def _classify(self, chunk) -> tuple[str, np.ndarray]:
        if isinstance(chunk, (tuple, list)):
            if len(chunk) != 3:
                raise MediaError(f"{self.path}: a plane tuple must be (Y, U, V), got {len(chunk)} items")
            y, u, v = (self._to_numpy(p) for p in chunk)
            n = y.shape[0] if y.ndim == 3 else -1
            luma, chroma = (n, self.height, self.width), (n, self.height // 2, self.width // 2)
            if y.shape != luma or u.shape != chroma or v.shape != chroma:
                raise MediaError(
                    f"{self.path}: planes must be Y [n, {self.height}, {self.width}] and U, V "
                    f"[n, {self.height // 2}, {self.width // 2}], got {[y.shape, u.shape, v.shape]}")
            flat = np.concatenate([y.reshape(n, -1), u.reshape(n, -1), v.reshape(n, -1)], axis=1)
            return "i420", flat.reshape(n, self.height * 3 // 2, self.width)
        array = self._to_numpy(chunk)
        if array.ndim == 4 and array.shape[1:] == (self.height, self.width, 3):
            return "rgb", array
        if array.ndim == 3 and array.shape[1:] == (self.height * 3 // 2, self.width):
            return "i420", array
        raise MediaError(
            f"{self.path}: frames must be uint8 [n, {self.height}, {self.width}, 3] RGB or "
            f"[n, {self.height * 3 // 2}, {self.width}] I420, got shape {tuple(array.shape)}")

    def _to_numpy(self, x) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise MediaError(
                    f"{self.path}: frames are on {x.device}; stage them with PinnedFrameStager (or .cpu())")
            x = x.detach().numpy()
        if not isinstance(x, np.ndarray):
            raise MediaError(
                f"{self.path}: frames must be a numpy array or torch tensor, got {type(x).__name__}")
        if x.dtype != np.uint8:
            raise MediaError(
                f"{self.path}: frames must be uint8, got {x.dtype} (convert float video with frames_to_uint8)")
        return x

    @property
    def frames_encoded(self) -> int:
        """Frames the encoder thread has passed to x264 so far (progress display; read from any thread)."""
        return self._pts

    def _mark(self, name: str) -> None:
        """Record instant ``name``: ``marks[name]`` (perf_counter) and ``stats[name + "_s"]`` (seconds since open)."""
        self.marks[name] = time.perf_counter()
        self.stats[name + "_s"] = self.marks[name] - self.marks["start"]

    def _put(self, item) -> None:
        t0 = time.perf_counter()
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    raise MediaError(f"{self.path}: encoder thread stopped") from self._error
        self.stats["blocked_s"] += time.perf_counter() - t0

    def _join(self) -> None:
        while self._thread.is_alive():
            self._thread.join(timeout=0.1)

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple) and item[2] is not None:
                item[2].release()

    def _discard(self) -> None:
        try:
            self._container.close()
        except Exception:
            pass  # the file is being thrown away; a trailer error changes nothing
        try:
            self.tmp_path.unlink()
        except FileNotFoundError:
            pass

    # ---------------------------------------------------------------- encoder thread

    def _run(self) -> None:
        item = None
        try:
            while True:
                item = self._queue.get()
                if item is _CLOSE:
                    if not self._abort_flag.is_set():
                        self._finish()
                        self._tail()
                    return
                self._consume(item)
        except BaseException as exc:  # handed to the producer at its next call
            self._error = exc
        # Failed (or finishing failed): keep consuming until the producer's close/abort, so that a producer
        # blocked on put() wakes up and staged buffers go back to the stager.
        while item is not _CLOSE:
            item = self._queue.get()
            if item is not _CLOSE and item[2] is not None:
                item[2].release()
        if self._state == "closing":  # the tail was asked for but encoding failed: nothing under ``path``
            self._state = "aborted"
            self._discard()
            self._fail(MediaError(f"{self.path}: encoding failed: {self._error!r}"))

    def _consume(self, item) -> None:
        kind, array, staged = item
        if self._abort_flag.is_set():
            if staged is not None:
                staged.release()
            return
        t0 = time.perf_counter()
        try:
            if staged is not None:
                staged.wait()
            if kind == "audio":
                self._audio_ready = array  # the sample the soundtrack is now written up to
            else:
                self._encode_video(kind, array)
                if self._pts == self.frames:
                    self._mark("frames_done")
        finally:
            if staged is not None:
                staged.release()
        self._encode_audio_until(audio_samples(self._pts, self.sample_rate, self.fps))
        self.stats["encode_s"] += time.perf_counter() - t0

    def _encode_video(self, kind: str, array: np.ndarray) -> None:
        av = self._av
        for i in range(array.shape[0]):
            if self._abort_flag.is_set():
                return
            if kind == "rgb":
                rgb = av.VideoFrame.from_numpy_buffer(np.ascontiguousarray(array[i]), format="rgb24")
                frame = self._reformatter.reformat(
                    rgb, format="yuv420p", src_colorspace="ITU709", dst_colorspace="ITU709",
                    src_color_range="JPEG", dst_color_range="MPEG")
            else:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array[i]), format="yuv420p")
                frame.colorspace, frame.color_range = _BT709, _RANGE_MPEG
            frame.pts = self._pts
            frame.time_base = Fraction(1, self.fps)
            self._pts += 1
            self._container.mux(self._video.encode(frame))

    def _encode_audio_until(self, end: int) -> None:
        """Feed the AAC encoder the soundtrack up to sample ``end`` (interleaves audio with video)."""
        if self._audio is None or self._aac is None:
            return
        end = min(end, self._audio_ready)
        if end <= self._audio_pos:
            return
        t0 = time.perf_counter()
        block = np.ascontiguousarray(self._audio[:, self._audio_pos:end])  # [2, n] float32 planar
        frame = self._av.AudioFrame.from_ndarray(block, format="fltp", layout="stereo")
        frame.sample_rate = self.sample_rate
        frame.pts = self._audio_pos
        frame.time_base = Fraction(1, self.sample_rate)
        self._audio_pos = end
        self._container.mux(self._aac.encode(frame))
        self.stats["audio_s"] += time.perf_counter() - t0

    def _tail(self) -> None:
        """After the last packet (encoder thread): fsync + rename, then the caller's ``then``; resolves the Future."""
        try:
            t0 = time.perf_counter()
            _fsync_file(self.tmp_path)
            os.replace(self.tmp_path, self.path)
            _fsync_dir(self.path.parent)
            self.stats["sync_s"] = time.perf_counter() - t0
            self.stats["finalize_s"] += self.stats["sync_s"]
            self._mark("end")
            self.stats["open_s"] = self.stats.pop("end_s")
        except BaseException as exc:
            self._state = "aborted"
            self._discard()
            self._fail(MediaError(f"{self.path}: could not finish the file: {exc!r}"))
            return
        self._state = "closed"
        try:
            result = self._then(None) if self._then is not None else None
        except BaseException as exc:
            self._done.set_exception(exc)
            return
        self._done.set_result(result)

    def _fail(self, error: BaseException) -> None:
        """The tail failed: tell the completion callback (its own failure cannot hide `error`), then the Future."""
        if self._then is not None:
            try:
                self._then(error)
            except BaseException:
                pass  # the callback's cleanup failed; `error` is what the job reports
        self._done.set_exception(error)

    def _finish(self) -> None:
        t0 = time.perf_counter()
        self._container.mux(self._video.encode(None))
        if self._aac is not None:
            self._encode_audio_until(self._audio.shape[1])
            self._container.mux(self._aac.encode(None))
        t1 = time.perf_counter()
        self._container.close()  # trailer; +faststart rewrites the file with the index first
        t2 = time.perf_counter()
        self.stats["flush_s"], self.stats["trailer_s"] = t1 - t0, t2 - t1
        self.stats["finalize_s"] += t2 - t0
        self.stats["encode_s"] += t2 - t0


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not open folders; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
