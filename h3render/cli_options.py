"""The click options `h3render prompt` and `h3render batch` share: the run settings (`h3render.settings`) and the
canvas / time fields of a job. Declarations only; `h3render.cli` wires them."""

from __future__ import annotations

import click

from h3render.jobs import MODES
from h3render.settings import DEVICES, DTYPES, RunSettings, crf_problem
from h3render.spec import ATTENTION_BACKENDS, POSITION_CHOICES, PRECISIONS, X264_PRESETS


def _check_crf(ctx, param, value):
    """--crf as the parser's error (a bad value is refused before anything runs), with the reason (`crf_problem`)."""
    problem = None if value is None else crf_problem(value)
    if problem:
        raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


def engine_options(f):
    """The `RunSettings` fields as options (their defaults are `RunSettings`'s), plus --mode (a job default)."""
    options = [
        click.option("--checkpoint", type=str, default=None,
                     help="Checkpoint folder (official or diffusers layout); default $H3RENDER_CHECKPOINT, else the "
                          "built-in tiny random model. A single-file DiT goes with --transformer."),
        click.option("--transformer", type=str, default=None,
                     help="Single-file DiT (.safetensors, ComfyUI style: q/k/v stacked) replacing the checkpoint's."),
        click.option("--mode", type=click.Choice(MODES), default=None, help="t2va (base) or fasth3."),
        click.option("--adapter", type=str, default=None,
                     help="FastH3 adapter fused at load time: a .safetensors file, a variant folder, or the LoRA "
                          "bundle root (with --adapter-variant); on `prompt` it implies --mode fasth3."),
        click.option("--adapter-variant", type=str, default=None,
                     help="Variant of a FastH3 LoRA bundle root (e.g. vsa-datafree, dense-datafree)."),
        click.option("--fasth3-positions", type=click.Choice(POSITION_CHOICES),
                     default=None,
                     help="FastH3 pre-shift positions: the release's [0.999, 0.749, 0.5, 0.25, 0] or FastVideo "
                          "0.2.1's example linspace(1, 0, 5) (V2: linspace(1, 0, 9)); default: the student's own."),
        click.option("--lora", "lora", multiple=True, metavar="FILE[:STRENGTH]",
                     help="A LoRA for the job(s), stacked when repeated (strength default 1; formats: docs/lora.md). "
                          "On `batch` it is the default set: a job's own `loras:` replaces it."),
        click.option("--lora-mode", type=click.Choice(("auto", "fuse", "side")), default=None,
                     help="How LoRAs apply per job: exact fuse/unfuse of the weights, or an un-fused side path; "
                          "auto: side with --precision fp8, else fuse."),
        click.option("--vsa-sparsity", type=click.FloatRange(0.0, 1.0, max_open=True), default=None,
                     help="VSA sparsity of a sparse FastH3 student (fraction of video key tiles dropped); default "
                          "the student's own: 0.8 for V2 (its contract), 0.9 for v1."),
        click.option("--device", type=click.Choice(DEVICES), default=None,
                     help="Default: cuda when available."),
        click.option("--dtype", type=click.Choice(DTYPES), default=None,
                     help="Default: bf16 on CUDA, fp32 on CPU (bf16 with --precision fp8)."),
        click.option("--precision", type=click.Choice(PRECISIONS), default=None,
                     help="fp8: FP8 GEMMs in the DiT blocks and the VAE decoder, FP8 text-encoder weights, int8 "
                          "QK^T in VSA on compute capability >= 9.0, bf16 activations (needs CUDA compute capability "
                          ">= 8.9, or the CPU); default bf16, or the manifest's defaults."),
        click.option("--gpus", type=int, default=None, help="GPUs to use (default: every visible GPU; with --device cpu: CPU processes, for testing)."),
        click.option("--crf", type=int, default=RunSettings.crf, show_default=True, callback=_check_crf,
                     help="x264 CRF, 1..51 (0, lossless, is beyond the MP4s' High profile)."),
        click.option("--x264-preset", type=click.Choice(X264_PRESETS),
                     default=RunSettings.x264_preset, show_default=True,
                     help="x264 speed preset (faster presets: bigger files at the same CRF)."),
        click.option("--attention", type=click.Choice(ATTENTION_BACKENDS), default=None,
                     help="Attention backend on CUDA (default: the first of fa3, cudnn, sdpa that is installed "
                          "and agrees with sdpa on a probe); on CPU torch SDPA always runs. The sidecar's "
                          "run.attention says what ran."),
        click.option("--save-latents", is_flag=True, hidden=True,
                     help="Also write <name>.latents.pt (final latents) beside each MP4, for comparing runs."),
        click.option("--max-gpu-memory", type=float, default=None, metavar="GB",
                     help="Device memory (GB) the run must fit: picks the memory plan (resident, phased text, fp8, "
                          "streamed blocks) and caps the allocator there; default: the GPU's own size."),
        click.option("--memory-plan", type=click.Choice(("auto", "resident", "phased", "streamed")), default=None,
                     help="Force a memory plan (default auto: the fastest that fits; the log and the sidecar's "
                          "run.memory say which ran and why)."),
        click.option("--vae-batch", type=click.IntRange(1, 256), default=RunSettings.vae_batch, show_default=True,
                     help="Video VAE work items (window x tile) per decoder forward, at most (a compiled, bf16, "
                          "decoder runs the size up to it that pads the fewest slots for the clip). A speed setting; "
                          "another value can move a few pixels by one 8-bit code value (float rounding), which the "
                          "lossy encode may spread."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def canvas_time_options(f):
    options = [
        click.option("--preset", default=None, help="Canvas/duration preset (see `h3render presets`)."),
        click.option("--aspect", default=None, help='Aspect ratio "W:H" (released canvas rule).'),
        click.option("--width", type=int, default=None, help="Canvas width in px (multiple of 32)."),
        click.option("--height", type=int, default=None, help="Canvas height in px (multiple of 32)."),
        click.option("--duration", type=float, default=None, help="Seconds; snapped up to 17n+5 frames at 24 fps."),
        click.option("--frames", type=int, default=None, help="Frame count; snapped up to 17n+5."),
        click.option("--steps", type=int, default=None, help="Sigma points (50 -> 49 forwards, released default)."),
        click.option("--seed", type=int, default=None, help="Noise seed (default 0)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f
