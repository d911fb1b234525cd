"""The `ref2va` stage of scripts/bench.py: a ref2va job at one canvas with one image and one video+audio reference,
component by component, then complete MP4s through the real Engine, and the cost of a DiT partition swap.

Random weights of the release's real sizes (`--ref2va-model released`, the default; `tiny` for a CPU smoke run):

1. the image reference (a 1920 x 1080 picture) put on its encode size (`references.fit_reference_image`: released
   short edge 2048 -> 3648 x 2048, host LANCZOS), the image processor and the vision tower on it (its image pads);
2. the video VAE encode of the image (one latent frame, 7,296 DiT rows at release) and of the video reference
   (`--ref2va-video-seconds` at 24 fps, snapped down to 17n + 5 frames, at the target's canvas, which a 16:9 video
   keeps: 5 s -> 107 frames -> 32 latent frames, 32,256 rows at 1344 x 768), and the audio VAE encode of its
   soundtrack (stereo 32 kHz, fp32: 200 latents, 2 x 200 rows);
3. the text encoder (released: 50 of 64 Qwen3-VL-32B layers; `--ref2va-te 0` skips it, ≈ 50 GB) on the plain
   prompt vs the ref2va presentation's length (labels + the image's vision block + the video's 2 fps blocks, each
   estimated at the video's canvas pad count);
4. one DiT forward (`sampling.dit_model_fn`) of the t2va layout vs the ref2va layout (`ref_packing.ref2va_layout`:
   + image, video and soundtrack rows), with the device's peak memory of each;
5. complete MP4s through the Engine (random components; the Ref2VA DiT a second random DiT held as the
   `transformer_ref` partition): a t2va job, then a ref2va job with the image and a `--ref2va-video-seconds`
   32 kHz stereo audio clip (what h3render renders today; the video part is not), `--ref2va-forwards` forwards each; the warm-up record (`dit_partitions`, `partition_swaps`);
6. the partition swap itself on CUDA: `Engine.dit_of` each way, the two DiTs trading places (seconds, GB).

GPU:  python scripts/bench.py --stages ref2va --out ref2va.json
CPU:  python scripts/bench.py --stages ref2va --ref2va-model tiny --ref2va-device cpu --ref2va-canvas 224x128x22 \
          --ref2va-forwards 2 --ref2va-video-seconds 1
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench_common import parse_canvas, sync
from bench_fl2va import PROMPT_TOKENS, _free, build, timed


def add_arguments(p) -> None:
    p.add_argument("--ref2va-canvas", default="1344x768x243", help="ref2va stage: WxHxFRAMES of the target")
    p.add_argument("--ref2va-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--ref2va-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--ref2va-forwards", type=int, default=4, help="ref2va stage: DiT forwards of each e2e job")
    p.add_argument("--ref2va-reps", type=int, default=3, help="ref2va stage: timed calls per measurement (median)")
    p.add_argument("--ref2va-te", type=int, default=1, help="ref2va stage: 0 skips the text encoder (≈ 50 GB)")
    p.add_argument("--ref2va-video-seconds", type=float, default=5.0, help="ref2va stage: the video reference")
    p.add_argument("--ref2va-e2e", type=int, default=1, choices=[0, 1, 2],
                   help="ref2va stage: 0 skips the complete MP4s, 2 runs only them")


def _peak(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None


def _reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@torch.no_grad()
def run(args, bench) -> None:
    """The stage; `bench` is scripts/bench_common.py (`rec`, `random_`, `gb`)."""
    from h3render import sampling
    from h3render.checkpoint.releases import RELEASES
    from h3render.keyframes import keyframe_pixels
    from h3render.models.dit import DiT
    from h3render.models.text_encoder import TextEncoder, build_vision_tower, image_processor_from_dict
    from h3render.models.video_vae import VideoVAE
    from h3render.packing import noise_conditions, patchify_video, t2va_layout
    from h3render.ref_packing import ReferenceBlock, ref2va_layout
    from h3render.references import fit_reference_image
    from h3render.models.audio_vae import AudioVAE
    from h3render.references import AUDIO_RATE
    from h3render.spec import FPS

    device = torch.device(args.ref2va_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    release = RELEASES[args.ref2va_model]
    width, height, frames = parse_canvas(args.ref2va_canvas)
    reps = args.ref2va_reps
    row = dict(stage="ref2va", canvas=f"{width}x{height}x{frames}", model=release.name, device=device.type)
    if args.ref2va_e2e == 2:
        _e2e(args, bench, device, release, width, height, frames, row)
        return

    # 1. the image reference: host resize, processor, vision tower
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8))
    fit_s = timed(lambda: fit_reference_image(picture, release.reference_short_edge), torch.device("cpu"), 1)
    image = fit_reference_image(picture, release.reference_short_edge)
    processor = image_processor_from_dict(release.image_processor)
    processed = processor(images=[image], return_tensors="pt")
    tower = bench.random_(build(lambda: build_vision_tower(release.text_encoder["vision_config"]), device, dtype), 5)
    pixels, grid = processed["pixel_values"].to(device, dtype), processed["image_grid_thw"]
    _reset(device)
    tower_s = timed(lambda: tower(pixels, grid_thw=grid.to(device)), device, reps)
    image_pads = int(grid[0].prod()) // tower.config.spatial_merge_size ** 2
    bench.rec(**row, what="image reference: resize + vision tower", resize_s=round(fit_s, 4), ours_s=round(tower_s, 4),
              encoded_size=list(image.size), image_pads=image_pads, peak_gb=_peak(device))
    del tower, pixels
    _free(device)

    # 2. video VAE encode: the image (1 latent frame) and the video reference on its own 16:9 canvas
    vw, vh = width, height  # a video of the target's 16:9 keeps its size (its own canvas rule gives the same)
    n = int(args.ref2va_video_seconds * FPS)
    n = max(1, (n - 5) // 17) * 17 + 5  # snapped down to 17n + 5 (diffusers' reference encoder)
    vae = bench.random_(build(lambda: VideoVAE(release.video_vae, release.vae_tiling), device, torch.float32), 1)
    vae.apply_precision_(dtype)
    still = keyframe_pixels(image).to(device)
    clip = torch.randint(0, 256, (3, n, vh, vw), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    clip = clip.to(device)
    _reset(device)
    image_latent = vae.encode_condition(still)
    image_s = timed(lambda: vae.encode_condition(still), device, reps)
    video_latent = vae.encode_condition(clip)
    video_s = timed(lambda: vae.encode_condition(clip), device, max(1, reps // 2))
    bench.rec(**row, what=f"video VAE encode: image {image.size[0]}x{image.size[1]}, video {n} frames {vw}x{vh}",
              image_s=round(image_s, 4), video_s=round(video_s, 4), image_latent=list(image_latent.shape),
              video_latent=list(video_latent.shape), peak_gb=_peak(device))
    del vae, still, clip
    _free(device)
    audio_vae = bench.random_(build(lambda: AudioVAE(release.audio_vae), device, torch.float32), 2)
    wave = (0.1 * torch.randn(2, n * AUDIO_RATE // FPS, generator=torch.Generator().manual_seed(2))).to(device)
    _reset(device)
    sound_latent = audio_vae.encode(wave)  # [2, 32, Tref]
    audio_s = timed(lambda: audio_vae.encode(wave), device, reps)
    sound = sound_latent.shape[-1]  # the soundtrack's latents per channel (40 / s)
    bench.rec(**row, what=f"audio VAE encode of the soundtrack ({wave.shape[1] / AUDIO_RATE:.2f} s stereo, fp32)",
              ours_s=round(audio_s, 4), audio_latents=sound, peak_gb=_peak(device))
    del audio_vae, wave
    _free(device)

    # the presentation: "<Picture 1>: " + image block, "<Audio 1>: " "<Video 1>: " + per 2 fps block
    # "<t seconds>" + vision block (pads estimated at the video canvas' merged grid), then the prompt
    video_blocks = -(-(-(-n // 12)) // 2)  # 2 fps samples (stride 12), paired
    video_pads = (vh // 32) * (vw // 32)
    tags = [1] * 6 + [0] * (image_pads + 2) + [1] * 12
    for _ in range(video_blocks):
        tags += [1] * 6 + [0] * (video_pads + 2)
    tags = torch.tensor(tags + [1] * PROMPT_TOKENS)

    # 3. text encoder: plain prompt vs the presentation
    if args.ref2va_te:
        te = bench.random_(build(lambda: TextEncoder(release.text_config, release.text_read_layer), device, dtype), 4)
        vocab = te.config.vocab_size
        short, long = (torch.randint(0, vocab, (1, k), device=device) for k in (PROMPT_TOKENS, tags.numel()))
        _reset(device)
        t_short, t_long = timed(lambda: te(short), device, reps), timed(lambda: te(long), device, reps)
        bench.rec(**row, what=f"text encoder {PROMPT_TOKENS} vs {tags.numel()} tokens", ours_s=round(t_long, 4),
                  t2va_s=round(t_short, 4), video_blocks=video_blocks, peak_gb=_peak(device))
        del te
        _free(device)

    # 4. one DiT forward: t2va vs ref2va (image + video + soundtrack rows)
    dit = bench.random_(build(lambda: DiT(release.dit), device, dtype), 0).apply_precision_(dtype)
    if device.type == "cuda":
        from h3render.models.attention import attention, select_backend

        select_backend(args.attention)
        dit.set_attention(attention, refiner=True)
    vs, as_ = sampling.sigma_schedule(5, release.video_shift), sampling.sigma_schedule(5, release.audio_shift)
    tables = dit.modulation_tables(torch.unique(torch.cat([sampling.schedule_timesteps(vs, as_, keyframes=True),
                                                           torch.tensor([1.0])])))
    video_t, audio_t = 1 - vs[1], 1 - as_[1]
    blocks = [ReferenceBlock("image", *image_latent.shape[1:]),
              ReferenceBlock("video", *video_latent.shape[1:], audio_latents=sound)]
    g = torch.Generator("cpu").manual_seed(0)
    ref = ref2va_layout(tags, blocks, height, width, frames)
    condition = noise_conditions([image_latent.cpu(), video_latent.cpu()], g).to(device)
    reference_audio = torch.randn(2 * sound, release.dit.audio_in_channels, generator=g).to(device)
    forwards = {}
    for name, layout, cond, cond_audio in (("t2va", t2va_layout(PROMPT_TOKENS, height, width, frames), None, None),
                                           ("ref2va", ref, condition, reference_audio)):
        layout = layout.to(device)
        target = layout.target_layout() if cond is not None else layout
        text = torch.randn(layout.text_len, dit.cfg.text_dim, generator=g).to(device, dtype)
        video, audio = sampling.draw_noise(g, target)
        video, audio = patchify_video(video[0]).to(device), audio.to(device)
        fn = sampling.dit_model_fn(dit, text, layout, tables, condition_rows=cond, audio_condition_rows=cond_audio)
        _reset(device)
        forwards[name] = timed(lambda: fn(video, audio, video_t, audio_t), device, reps)
        bench.rec(**row, what=f"DiT forward, {name}", ours_s=round(forwards[name], 4), rows=layout.seq_len,
                  condition_rows=getattr(layout, "num_condition_rows", 0),
                  condition_audio_rows=getattr(layout, "num_condition_audio_rows", 0), text_rows=layout.text_len,
                  peak_gb=_peak(device))
        del layout, text, video, audio, fn
    bench.rec(**row, what="DiT forward: ref2va / t2va", ratio=round(forwards["ref2va"] / forwards["t2va"], 3))
    del dit, tables, condition, reference_audio
    _free(device)

    if args.ref2va_e2e:
        _e2e(args, bench, device, release, width, height, frames, row)


def _host_memory() -> dict:
    """This process's resident host memory now and at its peak, GB (Linux /proc; {} elsewhere): the engine with both
    DiT partitions keeps each one's AdaLN projections (≈26 GB at release) in host memory."""
    try:
        status = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "VmHWM")))
    return {k: round(int(v.split()[0]) * 1024 / 1e9, 2) for k, v in fields.items()}


def _wav(path: Path, seconds: float, rate: int = 32000) -> None:
    """A stereo 16-bit WAV of noise at the audio VAE's rate (the e2e job's audio reference)."""
    import av

    samples = (np.random.default_rng(3).normal(0, 0.1, (2, int(seconds * rate))) * 32767).astype(np.int16)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout="stereo")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)


def _e2e(args, bench, device, release, width, height, frames, row) -> None:
    """Complete MP4s (t2va, then ref2va with one image) through the Engine; the partition swap on CUDA."""
    import bench_e2e
    from h3render.job_references import read_reference
    from h3render.jobs import Job
    from h3render.parallel.groups import init_parallel
    from h3render.settings import RunSettings

    from h3render.engine import SWAP_HEADROOM, Engine

    ctx = init_parallel(device.type)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    settings = RunSettings(checkpoint=f"random-{release.name}", device=device.type, dtype=dtype, progress=False,
                           attention=args.attention)
    t0 = time.perf_counter()
    # On CUDA the loader puts each DiT's 26 GB of AdaLN projections in host memory (`checkpoint.load._adaln_home`);
    # these random ones are made on the GPU, so each crosses in the load, inside this row's seconds.
    engine = Engine(bench_e2e.random_components(release.name, device, settings.torch_dtype, "bf16"), ctx, settings)
    ref_dit = bench_e2e.random_components(release.name, device, settings.torch_dtype, "bf16", seed=1,
                                          parts=("dit",)).dit
    # released: both DiTs (≈40 GB each without AdaLN) and the text encoder do not leave room for a forward, so the
    # Ref2VA DiT starts in host memory and the engine swaps partitions as the jobs need them
    fits = device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= SWAP_HEADROOM
    engine.hold_partition("transformer_ref", ref_dit, resident=fits)
    bench.rec(**row, what="engine with both DiT partitions", seconds=round(time.perf_counter() - t0, 1),
              gb=round(torch.cuda.memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None,
              host=_host_memory())
    folder = Path(tempfile.mkdtemp(prefix="bench-ref2va-"))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)).save(folder / "r.png")
    _wav(folder / "voice.wav", args.ref2va_video_seconds)
    common = dict(prompt=bench.PROMPT, width=width, height=height, frames=frames, seed=0,
                  steps=args.ref2va_forwards + 1, mode="t2va")
    references = (read_reference("r.png", folder), read_reference("voice.wav", folder))
    jobs = [Job(id="t2va", output="t2va", **common), Job(id="ref2va", output="ref2va", references=references, **common)]
    engine.prepare(jobs)
    bench.rec(**row, what="warm-up (outside job timings)", warmup={k: v for k, v in engine.warmup.items()
                                                                  if "partition" in k or "warmup" in k
                                                                  or k == "adaln_tables_s"},
              host=_host_memory())
    for job in jobs + jobs[:1]:  # t2va, ref2va, t2va: a swap each way where the device cannot hold both
        _reset(device)
        t0 = time.perf_counter()
        side = engine.render(job, folder / f"{job.output}.mp4", folder / f"{job.output}.json")
        wall = time.perf_counter() - t0
        stages = {k: round(v["seconds"], 3) for k, v in side["timings"]["stages"].items()}
        bench.rec(**row, what=f"complete MP4, {job.task}, {args.ref2va_forwards} forwards", wall_s=round(wall, 2),
                  stages=stages, peak_gb=_peak(device), swaps=engine.warmup.get("partition_swaps"),
                  host=_host_memory())
    if device.type == "cuda":  # the engine's own swap (`dit_swap.exchange`), each way, timed alone
        from h3render.tasks.base import BASE_PARTITION

        seconds = []
        for partition in ("transformer_ref", BASE_PARTITION):
            sync(device)
            t0 = time.perf_counter()
            engine.dit_of(partition)
            sync(device)
            seconds.append(round(time.perf_counter() - t0, 2))
        bench.rec(**row, what="partition swap (Engine.dit_of: base -> Ref2VA, Ref2VA -> base)", seconds=seconds,
                  gb=bench.gb(sum(p.numel() * p.element_size() for n, p in ref_dit.named_parameters()
                                  if "adaln_proj" not in n)), dit_partitions=dict(engine.warmup["dit_partitions"]),
                  engine_swaps=engine.warmup.get("partition_swaps"), host=_host_memory())
    del engine, ref_dit
    _free(device)
