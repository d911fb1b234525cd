"""The `fl2va` stage of scripts/bench.py: what fl2va adds to a t2va job, component by component, at one canvas.

Random weights of the release's real sizes (`--fl2va-model released`, the default; `tiny` for a CPU smoke run), built
one component at a time on `--fl2va-device` and freed before the next:

1. the keyframe image processor (host) and the Qwen3-VL vision tower (released: 27 blocks, DeepStack 8/16/24,
   `checkpoint.releases.QWEN3VL_RELEASED`) on 2 keyframes at the canvas (1344x768 -> 1008 image pads each);
2. the video VAE encode of 2 keyframes (`VideoVAE.encode_condition`: tiled, fp32 encoder);
3. the text encoder (released: 50 of 64 Qwen3-VL-32B layers) on the plain prompt vs the fl2va presentation's
   length (the prompt + 2 x (label + vision block)); `--fl2va-te 0` skips it (≈ 50 GB of weights);
4. one DiT forward (`sampling.dit_model_fn`, the production adaptor) of the t2va layout vs the fl2va layout
   (+2 keyframes: +2,016 condition rows at 1344x768, and the presentation's longer text).

The last row sums the extras for a job of `--fl2va-forwards` DiT forwards (49 = the released 50 sigma points) and
states them as a fraction of those forwards' t2va DiT time (the bulk of a job; issue 17's target: <= 3 %).

GPU:  python scripts/bench.py --stages fl2va --out fl2va.json
CPU:  python scripts/bench.py --stages fl2va --fl2va-model tiny --fl2va-device cpu --fl2va-canvas 224x128x39
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from PIL import Image

from bench_common import parse_canvas, sync

PROMPT_TOKENS = 256  # the t2va prompt length the other stages use (bench.dit_inputs)


def timed(fn, device: torch.device, reps: int, warm: int = 1) -> float:
    """Median wall seconds of `reps` calls after `warm` untimed ones, synchronizing the device around each."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(factory, device: torch.device, dtype: torch.dtype):
    """Construct a module directly on `device` in `dtype` (no host copy of real-size weights)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return factory().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _keyframes(width: int, height: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(2)]


@torch.no_grad()
def run(args, bench) -> None:
    """The stage; `bench` is scripts/bench_common.py (`rec`, `random_`, `gb`)."""
    from h3render import sampling
    from h3render.checkpoint.releases import RELEASES
    from h3render.keyframes import keyframe_pixels
    from h3render.models.dit import DiT
    from h3render.models.text_encoder import TEXT_TAG, VIDEO_TAG, TextEncoder, build_vision_tower, \
        image_processor_from_dict
    from h3render.models.video_vae import VideoVAE
    from h3render.packing import fl2va_layout, noise_keyframes, patchify_video, t2va_layout

    device = torch.device(args.fl2va_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    release = RELEASES[args.fl2va_model]
    width, height, frames = parse_canvas(args.fl2va_canvas)
    reps = args.fl2va_reps
    row = dict(stage="fl2va", canvas=f"{width}x{height}x{frames}", model=release.name, device=device.type)
    images = _keyframes(width, height)
    extra: dict[str, float] = {}

    # 1. image processor + vision tower
    processor = image_processor_from_dict(release.image_processor)
    processor_s = timed(lambda: processor(images=images, return_tensors="pt"), device, reps)
    processed = processor(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"]
    tower = bench.random_(build(lambda: build_vision_tower(release.text_encoder["vision_config"]), device, dtype), 5)
    pixels = processed["pixel_values"].to(device, dtype)
    tower_s = timed(lambda: tower(pixels, grid_thw=grid.to(device)), device, reps)
    merge = tower.config.spatial_merge_size
    pads = [int(g.prod()) // merge ** 2 for g in grid]
    bench.rec(**row, what="vision tower, 2 keyframes (+ host image processor)", ours_s=round(tower_s, 4),
              processor_s=round(processor_s, 4), image_pads=pads, blocks=tower.config.depth,
              gb=bench.gb(sum(p.numel() * p.element_size() for p in tower.parameters())))
    extra["vision"] = tower_s + processor_s
    del tower, pixels
    _free(device)

    # 2. video VAE encode of the keyframes
    vae = bench.random_(build(lambda: VideoVAE(release.video_vae, release.vae_tiling), device, torch.float32), 1)
    vae.apply_precision_(dtype)  # the encoder stays fp32 (the release's precision policy)
    clips = [keyframe_pixels(im).to(device) for im in images]
    latents = [vae.encode_condition(c) for c in clips]
    vae_s = timed(lambda: [vae.encode_condition(c) for c in clips], device, reps)
    bench.rec(**row, what="video VAE encode, 2 keyframes (tiled, fp32)", ours_s=round(vae_s, 4),
              latent=list(latents[0].shape))
    extra["vae_encode"] = vae_s
    del vae
    _free(device)

    # The fl2va presentation: per keyframe "<Picture i>: " (≈ 6 tokens) + vision start, pads, vision end; the prompt.
    label = 6
    tags = []
    for n in pads:
        tags += [TEXT_TAG] * label + [VIDEO_TAG] * (n + 2)
    tags = torch.tensor(tags + [TEXT_TAG] * PROMPT_TOKENS)
    fl2va_tokens = tags.numel()

    # 3. text encoder: the longer sequence
    if args.fl2va_te:
        te = bench.random_(build(lambda: TextEncoder(release.text_config, release.text_read_layer), device, dtype), 4)
        vocab = te.config.vocab_size
        ids_t2va = torch.randint(0, vocab, (1, PROMPT_TOKENS), device=device)
        ids_fl2va = torch.randint(0, vocab, (1, fl2va_tokens), device=device)
        te_t2va = timed(lambda: te(ids_t2va), device, reps)
        te_fl2va = timed(lambda: te(ids_fl2va), device, reps)
        bench.rec(**row, what=f"text encoder {PROMPT_TOKENS} vs {fl2va_tokens} tokens", ours_s=round(te_fl2va, 4),
                  t2va_s=round(te_t2va, 4), extra_s=round(te_fl2va - te_t2va, 4))
        extra["text_encoder"] = te_fl2va - te_t2va
        del te
        _free(device)

    # 4. one DiT forward: t2va (plain prompt) vs fl2va (presentation + 2 keyframes' condition rows)
    dit = bench.random_(build(lambda: DiT(release.dit), device, dtype), 0).apply_precision_(dtype)
    if device.type == "cuda":
        from h3render.models.attention import attention, select_backend

        select_backend(args.attention)
        dit.set_attention(attention, refiner=True)
    vs, as_ = sampling.sigma_schedule(5, release.video_shift), sampling.sigma_schedule(5, release.audio_shift)
    tables = dit.modulation_tables(sampling.schedule_timesteps(vs, as_, keyframes=True))
    video_t, audio_t = 1 - vs[1], 1 - as_[1]
    g = torch.Generator("cpu").manual_seed(0)
    fl2va = fl2va_layout(tags, height, width, frames, ("first", "last"))
    condition = noise_keyframes([z.cpu() for z in latents], g).to(device)
    forwards = {}
    for name, layout, text_len, cond in (("t2va", t2va_layout(PROMPT_TOKENS, height, width, frames), PROMPT_TOKENS,
                                          None), ("fl2va", fl2va, fl2va_tokens, condition)):
        layout = layout.to(device)
        text = torch.randn(text_len, dit.cfg.text_dim, generator=g).to(device, dtype)
        video, audio = sampling.draw_noise(g, layout)
        video, audio = patchify_video(video[0]).to(device), audio.to(device)
        fn = sampling.dit_model_fn(dit, text, layout, tables, condition_rows=cond)
        forwards[name] = timed(lambda: fn(video, audio, video_t, audio_t), device, reps)
        bench.rec(**row, what=f"DiT forward, {name}", ours_s=round(forwards[name], 4), rows=layout.seq_len,
                  condition_rows=getattr(layout, "num_condition_rows", 0), text_rows=text_len)
        del layout, text, video, audio, fn
    extra["dit"] = args.fl2va_forwards * (forwards["fl2va"] - forwards["t2va"])
    t2va_dit = args.fl2va_forwards * forwards["t2va"]
    total = sum(extra.values())
    bench.rec(**row, what=f"fl2va extra over t2va, {args.fl2va_forwards} forwards", ours_s=round(total, 3),
              parts={k: round(v, 4) for k, v in extra.items()}, t2va_dit_s=round(t2va_dit, 2),
              fraction_of_t2va_dit=round(total / t2va_dit, 4))
    del dit, tables
    _free(device)
