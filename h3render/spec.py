"""MiniMax-H3's fixed geometry: the one home of the frame grid, latent rates, canvas rule and released shifts, and of
the rules a request meets before anything loads: a checkpoint's `Limits`, `parse_aspect`, `check_canvas`,
`snap_frames`.

Every other module imports these; none restates them. Torch-free and importing nothing of h3render, so every layer
(front end, job path, checkpoint, models) can use it (the layer map: tests/unit/test_layering.py). Sources: diffusers
0.42.1 `pipelines/minimax_h3` and `modular_pipelines/minimax_h3` (the numerical oracle), ../shared/DESIGN.md §1.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# -- time -------------------------------------------------------------------------------------------------------------
FPS = 24  # fixed frame rate (diffusers `MINIMAX_H3_FPS`)
FRAMES_PER_CHUNK = 17  # video VAE clip geometry: pixel frame counts are 17n + 5 ...
FRAMES_REMAINDER = 5  # ... (107, 124, 243, 362) ...
LATENTS_PER_CHUNK = 5  # ... and give 5n + 2 latent frames (243 -> 72)
LATENT_REMAINDER = 2
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # pixel frames behind latent frame k (first one, then 4 each): RoPE t clock
LATENT_TIME_UNITS = 5.0 / 3.0  # RoPE time units per pixel-frame group: one unit = one 25 ms audio latent

# -- audio ------------------------------------------------------------------------------------------------------------
SAMPLE_RATE = 32_000  # audio VAE: mono 32 kHz, stereo as a batch of 2
AUDIO_HOP = 800  # waveform samples per audio latent
AUDIO_LATENTS_PER_SECOND = SAMPLE_RATE // AUDIO_HOP  # 40
AUDIO_CHANNELS = 2  # stereo: two channel-major blocks of audio rows
AUDIO_LATENT_CHANNELS = 32

# -- space ------------------------------------------------------------------------------------------------------------
VIDEO_LATENT_CHANNELS = 24
SPATIAL_COMPRESSION = 16  # video VAE: pixels per latent along each spatial axis
PATCH = (1, 2, 2)  # DiT patch (t, h, w) over the video latent: 24 * 2 * 2 = 96 values per row
CANVAS_MULTIPLE = SPATIAL_COMPRESSION * PATCH[2]  # 32 px: one video row per 32 x 32 pixels
RELEASED_SHORT_EDGE = 768  # canvas rule: short edge 768 ...
RELEASED_MAX_PIXELS = 768 * 1344  # ... area capped at the 16:9 canvas
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0  # supported width / height

# -- sampler ----------------------------------------------------------------------------------------------------------
RELEASED_SIGMA_POINTS = 50  # linspace(1, 0, 50): 49 forwards
RELEASED_VIDEO_SHIFT = 12.0  # model_index.json `_minimax_h3.sigma_shift_scales`
RELEASED_AUDIO_SHIFT = 3.0


def is_snapped(frames: int) -> bool:
    """Whether a pixel frame count is of the form 17n + 5 (the counts the video VAE encodes without padding)."""
    return frames >= FRAMES_REMAINDER and frames % FRAMES_PER_CHUNK == FRAMES_REMAINDER


def snap_frames_up(frames: int) -> int:
    """Smallest 17n + 5 at or above `frames` (240 -> 243)."""
    return frames + (FRAMES_REMAINDER - frames) % FRAMES_PER_CHUNK if frames >= FRAMES_REMAINDER else FRAMES_REMAINDER


def latent_frames(frames: int) -> int:
    """Video latent frames for a 17n + 5 pixel frame count: 5n + 2 (124 -> 37, 243 -> 72).

    Raises:
        ValueError: `frames` is not of the form 17n + 5.
    """
    if not is_snapped(frames):
        raise ValueError(f"frames must be 17n + 5 (e.g. 124, 243, 362), got {frames}")
    return (frames - FRAMES_REMAINDER) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + LATENT_REMAINDER


def latent_first_frame(latent: int) -> int:
    """The first pixel frame behind latent frame `latent` (>= 0): 17 per 5 latents, then 1, 4, 4, 4, 4 within a
    group (0 -> 0, 1 -> 1, 2 -> 5, 5 -> 17, 7 -> 22)."""
    group, slot = divmod(latent, LATENTS_PER_CHUNK)
    return group * FRAMES_PER_CHUNK + sum(FRAMES_PER_LATENT[:slot])


def latent_of_frame(frame: int) -> int:
    """The latent frame holding pixel frame `frame` (>= 0): the inverse of `latent_first_frame` (240 -> 71)."""
    group, rest = divmod(frame, FRAMES_PER_CHUNK)
    slot = 0 if rest == 0 else 1 + (rest - 1) // FRAMES_PER_LATENT[1]
    return group * LATENTS_PER_CHUNK + slot


def audio_latents(frames: int) -> int:
    """Audio latents per channel for `frames` video frames: round(frames / 24 * 40), Python's round as the reference
    (243 -> 405)."""
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


def audio_samples(frames: int, sample_rate: int = SAMPLE_RATE, fps: int = FPS) -> int:
    """Waveform samples per channel that belong to `frames` video frames: round(frames * sample_rate / fps), half
    up, in exact integer arithmetic (243 at 32 kHz / 24 fps -> 324,000)."""
    return (2 * frames * sample_rate + fps) // (2 * fps)


def video_rows(width: int, height: int, frames: int) -> int:
    """Packed video rows: latent frames x (H / 32) x (W / 32) (1344 x 768 x 243 -> 72,576)."""
    return latent_frames(frames) * (height // CANVAS_MULTIPLE) * (width // CANVAS_MULTIPLE)


def audio_rows(frames: int) -> int:
    """Packed audio rows: 2 channels x audio latents (243 frames -> 810)."""
    return AUDIO_CHANNELS * audio_latents(frames)


# -- a checkpoint's limits --------------------------------------------------------------------------------------------
# Input bounds, checked before load (docs/manifest.md "Limits"). Sigma points: a schedule of N points holds N floats
# per modality and runs N - 1 forwards; 1,000 is 20x the released 50 and keeps a typo (1e9) from allocating GiBs.
DEFAULT_MAX_SIGMA_POINTS = 1000
# Prompt characters: a guard against runaway input (a pasted file), far above any real prompt (about 5,000 tokens of
# English at ~4 characters per token); the model's own token limit is checked by the engine after tokenizing.
DEFAULT_MAX_PROMPT_CHARS = 20_000
# The durations the released weights were trained on: diffusers 0.42.1 refuses a video outside 5–15 s
# (`MiniMaxH3ModularPipeline.min_duration` / `max_duration`, checked on the snapped frame count); h3render renders
# the wider 4–15 s of the model card and says so in the plan line.
RELEASED_TRAINED_SECONDS = (5.0, 15.0)

# Canvas x time: at most this many times the packed video rows of the checkpoint's own largest canvas (its canvas
# rule's `canvas_max_pixels`) at its longest duration. Released: 8 x 107,856 = 862,848 rows (3840 x 2176 at 10 s
# fits, at 15 s does not); tiny: 23,968 (the fast-960x544 preset at 5 s fits). A 32000 x 32000 canvas (72,000,000
# rows at 10 s) would run for hours, use tens of GB of host memory and sit in tensor ops that no signal interrupts;
# it is refused before load instead.
CANVAS_WORK_FACTOR = 8


@dataclass(frozen=True)
class Limits:
    """What a checkpoint accepts, given by the caller from the checkpoint config (h3render never guesses it).

    Released MiniMax-H3: frames 107–362 (4–15 s requested, model card and vLLM-Omni; diffusers takes 124–345),
    default canvas 16:9 → (1344, 768), 50 sigma points. The tiny test model has its own frames 22–362 and a small
    canvas.

    Attributes:
        min_frames, max_frames: inclusive range of snapped frame counts.
        default_canvas: (width, height) in px for jobs that name no canvas; multiples of 32.
        default_frames: frame count (17n + 5) for jobs that name no duration.
        default_steps: sigma points of the base sampler for jobs that name none (released: 50 → 49 forwards).
        canvas_short_edge, canvas_max_pixels: the aspect-ratio canvas rule (released: 768, 768 × 1344).
        max_sigma_points: the most sigma points a job may ask for (default 1,000 = 20× the released 50).
        max_prompt_chars: the longest prompt in characters (default 20,000); the checkpoint's token limit is
            checked by the engine once the tokenizer is loaded.
        trained_seconds: (shortest, longest) video in s the weights were trained on, narrower than the accepted
            frame range (released: 5–15 s); None when the model states none (the built-in random models). A job
            outside it renders, and its plan line says so (`training_note`).
        max_video_rows: the most packed video rows (width x height x frames, `video_rows`) a job may ask for;
            None (default) derives it from the checkpoint's own canvas rule: `CANVAS_WORK_FACTOR` x the rows of
            `canvas_max_pixels` at `max_frames` (released 862,848; tiny 23,968).

    Raises:
        ValueError: inconsistent limits.
    """

    min_frames: int
    max_frames: int
    default_canvas: tuple[int, int]
    default_frames: int
    default_steps: int
    canvas_short_edge: int = RELEASED_SHORT_EDGE
    canvas_max_pixels: int = RELEASED_MAX_PIXELS
    max_sigma_points: int = DEFAULT_MAX_SIGMA_POINTS
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    trained_seconds: tuple[float, float] | None = None
    max_video_rows: int | None = None

    def training_note(self, frames: int) -> str:
        """"outside the 5–15 s the model was trained on" for a snapped frame count outside `trained_seconds`
        (compared as frames / 24, as diffusers does), else ""."""
        if self.trained_seconds is None:
            return ""
        shortest, longest = self.trained_seconds
        if shortest <= frames / FPS <= longest:
            return ""
        return f"outside the {shortest:g}–{longest:g} s the model was trained on"

    def __post_init__(self) -> None:
        if self.max_video_rows is None:  # frozen: the derived bound is set once, here
            rows_per_frame = CANVAS_WORK_FACTOR * self.canvas_max_pixels // CANVAS_MULTIPLE ** 2
            object.__setattr__(self, "max_video_rows", rows_per_frame * latent_frames(snap_frames_up(self.max_frames)))
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"Limits: bad frame range {self.min_frames}–{self.max_frames}")
        if not self.min_frames <= self.default_frames <= self.max_frames or not is_snapped(self.default_frames):
            raise ValueError(f"Limits: default_frames {self.default_frames} must be 17n+5 within "
                             f"{self.min_frames}–{self.max_frames}")
        width, height = self.default_canvas
        check_canvas(width, height)
        if not 2 <= self.default_steps <= self.max_sigma_points:
            raise ValueError(f"Limits: default_steps {self.default_steps} must be within 2–{self.max_sigma_points} "
                             "sigma points (a schedule needs at least 2)")
        if self.max_prompt_chars < 1:
            raise ValueError("Limits: max_prompt_chars must be positive")
        if self.trained_seconds is not None and not 0 < self.trained_seconds[0] <= self.trained_seconds[1]:
            raise ValueError(f"Limits: trained_seconds {self.trained_seconds} must be (shortest, longest) > 0")
        if video_rows(width, height, self.default_frames) > self.max_video_rows:
            raise ValueError(f"Limits: the default canvas {width}x{height} at {self.default_frames} frames is more "
                             f"than max_video_rows {self.max_video_rows:,}")


# -- canvas and time rules -------------------------------------------------------------------------------------------

def parse_aspect(text: str) -> tuple[float, float]:
    """Parse "W:H" (e.g. "16:9", "2.39:1") into its two positive terms.

    Raises:
        ValueError: not of the form W:H with positive numbers.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*:\s*(\d+(?:\.\d+)?)\s*", text)
    if not match or float(match[1]) <= 0 or float(match[2]) <= 0:
        raise ValueError(f'aspect {text!r} must look like "16:9" (two positive numbers joined by ":")')
    return float(match[1]), float(match[2])


def check_canvas(width: int, height: int) -> None:
    """Check an explicit canvas: positive multiples of 32 px with an aspect ratio within 1:4 … 4:1.

    Raises:
        ValueError: naming the offending axis or ratio.
    """
    for name, value in (("width", width), ("height", height)):
        if not is_int(value) or value <= 0 or value % CANVAS_MULTIPLE:
            raise ValueError(f"{name} {value!r} must be a positive multiple of {CANVAS_MULTIPLE} px")
    if not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise ValueError(f"canvas {width}x{height} has an aspect ratio outside the supported 1:4 … 4:1")


def snap_frames(frames: int | None = None, duration: float | None = None, limits: Limits | None = None) -> int:
    """The frame count a request renders: the smallest 17n + 5 at or above the requested count.

    A duration (s) first becomes a whole number of frames at 24 fps, rounded to the nearest frame, so a duration
    quoted to two decimals maps back to its count: 10 s → 240 → 243 frames (10.125 s); 15 s → 360 → 362;
    4.46 s → 107.04 → 107 (4.458 s).

    Args:
        frames: requested frame count (int > 0), or
        duration: requested duration in s (> 0); exactly one of the two.
        limits: when given, the snapped count must lie within `limits.min_frames … limits.max_frames`.

    Raises:
        ValueError: neither or both given, a non-positive request, or a result outside the limits (the message
            states the range in frames and seconds).
    """
    if (frames is None) == (duration is None):
        raise ValueError("give exactly one of frames and duration")
    if duration is not None:
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration <= 0 \
                or not math.isfinite(duration * FPS):  # 1e308 s is finite, but its frame count is not
            raise ValueError(f"duration {duration!r} must be a positive, finite number of seconds")
        wanted = max(1, round(duration * FPS))
        asked = f"duration {duration:g} s ({wanted} frames)"
    else:
        if not is_int(frames) or frames <= 0:
            raise ValueError(f"frames {frames!r} must be a positive integer")
        wanted = frames
        asked = f"frames {frames}"
    snapped = snap_frames_up(wanted)
    if limits is not None and not limits.min_frames <= snapped <= limits.max_frames:
        raise ValueError(f"{asked} snaps to {snapped} frames, outside this checkpoint's range "
                         f"{limits.min_frames}–{limits.max_frames} frames "
                         f"({seconds_text(limits.min_frames)}–{seconds_text(limits.max_frames)} s)")
    return snapped


def seconds_text(frames: int) -> str:
    """A frame count as seconds at 24 fps, to 3 decimals, for messages (243 -> "10.125")."""
    return f"{round(frames / FPS, 3):g}"


def is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (JSON and YAML `true` would pass `isinstance(value, int)`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def canvas_for_aspect(aspect_w: float, aspect_h: float, *, short_edge: int = RELEASED_SHORT_EDGE,
                      max_pixels: int = RELEASED_MAX_PIXELS, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int]:
    """The released canvas rule (diffusers `resolve_canvas_size`): (width, height) in px for an aspect ratio.

    The short edge starts at 768, the area is then scaled down to at most 768 x 1344 keeping the ratio, and only then
    is each axis rounded to the nearest multiple of 32, so the area may end a little above the cap: 9:5 -> 1376x768,
    2:1 -> 1440x704, 16:9 -> 1344x768, 9:16 -> 768x1344, 4:3 -> 1024x768, 1:1 -> 768x768.

    Raises:
        ValueError: a non-positive term, or a ratio outside 1:4 ... 4:1.
    """
    if not (aspect_w > 0 and aspect_h > 0 and math.isfinite(aspect_w) and math.isfinite(aspect_h)):
        raise ValueError(f"aspect {aspect_w:g}:{aspect_h:g}: both terms must be positive numbers")
    ratio = aspect_w / aspect_h
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise ValueError(f"aspect {aspect_w:g}:{aspect_h:g} is outside the supported 1:4 … 4:1")
    width, height = (short_edge * ratio, float(short_edge)) if ratio >= 1 else (float(short_edge), short_edge / ratio)
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = width * scale, height * scale
    # Python's round() (half to even) as the reference does; a tie needs an axis of exactly (k + 1/2) * 32 px.
    return (max(multiple, round(width / multiple) * multiple), max(multiple, round(height / multiple) * multiple))


# =====================================================================================================================
# Release and interface facts (issue #22 item 5, "one home per fact, round two"). Kept torch-free like the rest of
# this module, so the front end (cli --help, jobs, manifest, settings) reads the same names the models check against.

# -- FastH3 students: video sparse attention (VSA-H3) ----------------------------------------------------------------
# The tile size (64 rows, 4x4x4 video boxes) is not restated here: its home is the kernel, `h3render.kernels.vsa.TILE`,
# because the Triton kernel's constexpr, the box shape and the slot arithmetic are built on it (another tile is another
# kernel), and this module cannot import the kernels without importing torch. Everything above the kernel reads it.
FASTH3_V1_VSA_SPARSITY = 0.9  # FastH3 v1 release notes (FastVideo blog "FastH3 preview"): fraction of tiles dropped
FASTH3_V2_VSA_SPARSITY = 0.8  # FastH3 V2 `fastvideo_inference.json` (vLLM-Omni `FastH3CheckpointSpec`)

# -- run settings whose values the command line offers (here so that the choices need no torch) -----------------------
# --precision: bf16 weights, or FP8 GEMMs in the DiT blocks (`h3render.checkpoint.load`); "bf16" first: the default.
PRECISIONS = ("bf16", "fp8")
# --fasth3-positions: the release's pre-shift positions or FastVideo 0.2.1's example linspace
# (`h3render.checkpoint.contract.fasth3_schedule` builds each).
POSITION_CHOICES = ("release", "fastvideo-example")


def ran_precision(precision: str, dtype: str) -> str:
    """What a run's linears compute in, as the log and the sidecar name it: "fp8" with --precision fp8, else the
    activations' dtype (`--dtype`: "bf16", or "fp32", a CPU run's default). --precision bf16 only means no FP8: a
    CPU render in fp32 printed and recorded "precision bf16" (a trial)."""
    return "fp8" if precision == "fp8" else dtype


def check_precision(precision: str) -> str:
    """`precision` if it is one of `PRECISIONS`, else ValueError naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


# -- dense attention backends ----------------------------------------------------------------------------------------
# Names, fastest first on an H200; `h3render.models.attention.REGISTRY` holds one record per name (name, available(),
# run) and checks at import that its keys are exactly these. Here so that `--attention`'s choices need no torch.
ATTENTION_BACKENDS = ("fa3", "cudnn", "sdpa")

# -- MP4 delivery ----------------------------------------------------------------------------------------------------
# libx264's speed presets, fastest first (x264.h `x264_preset_names`, x264 --fullhelp "--preset"); the CLI offers
# exactly these and `h3render.jobs.check_x264_preset` checks against them.
X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")
# x264's CRF range as the MP4s can use it: CRF 0 is lossless (x264 encoder.c: qp 0 -> b_lossless), which only the
# High 4:4:4 Predictive profile allows; our MP4s are High (players' yuv420p baseline), so x264 refuses anything
# below 1 ("high profile doesn't support lossless", PyAV 18.1 / FFmpeg 8.1; CRF 1 and 51 encode).
X264_CRF = (1, 51)
