"""The vae-fp8 stage of scripts/bench.py (issue 26 item 2): the video VAE decode with bf16 block linears against the
same VAE with FP8 ones (`models.fp8.quantize_video_decoder_fp8_`, what `--precision fp8` runs), in one process on
the same random weights and latents.

Per mode (`--vae-fp8-modes`: eager, then compiled where the Engine compiles on CUDA: bf16 blocks, not FP8 ones,
`VideoVAE.compile_pays`; each row names the mode that ran) and precision: one decoder batch first (the Engine's
warm-up; for compiled blocks that is the compilation), then `--vae-fp8-reps` whole decodes (one
in eager mode when compiled runs too: there it checks the eager CUDA path) of a
`--vae-fp8-latents` latent (default 72 x 48 x 84: 243 frames of 1344 x 768) timed with device synchronization,
and the peak memory of a decode. The error of the FP8 frames against the bf16 frames is measured on uint8 RGB codes
(round(255 x), what the MP4 path quantizes to before its colour conversion): PSNR over the whole video, the worst
frame's PSNR, max |difference| in codes and the share of codes that differ, for each residual-gain scale in
`--vae-fp8-gains` (the decoder blocks' `scale1` / `scale2` drawn as gain x N(0, 1) in both VAEs: 0.02 is what
`bench_common.random_` gives, a weak block contribution; 0.3 is the unit tests' stronger one; the extra scales are
measured in the last mode only. Trained gains are unknown here, so the two bracket the error).

CPU smoke run (tests/unit/test_bench_vae_fp8.py): `--vae-fp8-model tiny --vae-fp8-device cpu --vae-fp8-latents
7x4x4 --vae-fp8-reps 1 --vae-fp8-modes eager`.
"""

from __future__ import annotations

import copy
import time

import torch


def add_arguments(p) -> None:
    p.add_argument("--vae-fp8-model", default="released", choices=["released", "tiny"])
    p.add_argument("--vae-fp8-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--vae-fp8-latents", default="72x48x84", help="vae-fp8: latent frames x height x width")
    p.add_argument("--vae-fp8-reps", type=int, default=2, help="vae-fp8: timed whole decodes per variant")
    p.add_argument("--vae-fp8-modes", default="eager,compiled",
                   help="vae-fp8: eager and/or compiled (as the Engine on CUDA: the blocks where compiling pays, "
                   "bf16; CUDA only)")
    p.add_argument("--vae-fp8-gains", default="0.02,0.3", help="vae-fp8: residual-gain scales of the error rows")
    p.add_argument("--vae-fp8-batch", type=int, default=None, help="vae-fp8: items per decoder forward "
                   "(default RunSettings().vae_batch)")


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] float RGB in [0, 1] -> uint8 codes, round to nearest."""
    return video.mul(255).round_().to(torch.uint8)


def frame_errors(fp8: torch.Tensor, bf16: torch.Tensor) -> dict:
    """PSNR (dB) over the whole video and of the worst frame, max |difference| (codes), share of codes that differ,
    of two uint8 videos [3, F, H, W]; computed frame by frame so no int copy of the whole video is held."""
    sq, worst_frame_mse, max_abs, differing = 0.0, 0.0, 0, 0
    frames = fp8.shape[1]
    for f in range(frames):
        d = fp8[:, f].int() - bf16[:, f].int()
        mse = float(d.double().square().mean())
        sq += mse
        worst_frame_mse = max(worst_frame_mse, mse)
        max_abs = max(max_abs, int(d.abs().max()))
        differing += int((d != 0).sum())

    def psnr(mse: float) -> float:
        return float("inf") if mse == 0 else round(10 * torch.log10(torch.tensor(255.0**2 / mse)).item(), 2)

    return {"psnr_db": psnr(sq / frames), "worst_frame_psnr_db": psnr(worst_frame_mse), "max_abs": max_abs,
            "rmse_codes": round((sq / frames) ** 0.5, 3), "codes_differing": round(differing / fp8.numel(), 4)}


@torch.no_grad()
def set_gains_(vaes, scale: float, seed: int = 11) -> None:
    """Every decoder block's `scale1` / `scale2` := scale x N(0, 1), the same values in each VAE of `vaes`."""
    g = torch.Generator().manual_seed(seed)
    for index in range(len(vaes[0].decoder.transformer_blocks)):
        for name in ("scale1", "scale2"):
            values = scale * torch.randn(getattr(vaes[0].decoder.transformer_blocks[index], name).shape, generator=g)
            for vae in vaes:
                getattr(vae.decoder.transformer_blocks[index], name).copy_(values)


def stage_vae_fp8(args, bench) -> None:
    from h3render.models.fp8 import precision_report, quantize_video_decoder_fp8_
    from h3render.models.video_vae import VideoVAE
    from h3render.models.video_vae_config import VIDEO_VAE_TINY, VideoVAEConfig
    from h3render.settings import RunSettings

    device = torch.device(args.vae_fp8_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    cfg = VideoVAEConfig() if args.vae_fp8_model == "released" else VIDEO_VAE_TINY
    batch = args.vae_fp8_batch or RunSettings().vae_batch
    t_lat, h, w = (int(v) for v in args.vae_fp8_latents.lower().split("x"))
    modes = [m for m in args.vae_fp8_modes.split(",") if m and (cuda or m == "eager")]
    gains = [float(g) for g in args.vae_fp8_gains.split(",") if g]

    def sync():
        bench.sync(device)

    # bf16 as the Engine holds it (bf16 block linears, fused q/k/v), and its FP8 copy: the same weights
    if cuda:
        bf16 = bench.build_on_gpu(lambda: VideoVAE(cfg), torch.float32)
    else:
        bf16 = VideoVAE(cfg).eval().requires_grad_(False)
    bench.random_(bf16, 1)
    bf16.apply_precision_(torch.bfloat16).fuse_qkv_()
    fp8 = copy.deepcopy(bf16)
    t0 = time.perf_counter()
    replaced = quantize_video_decoder_fp8_(fp8)
    sync()
    quantize_s = time.perf_counter() - t0
    exact = copy.deepcopy(fp8)  # the same FP8 decoder promoting to fp32 (no `Fp8Linear.fast_accum`: before 26.1)
    for m in exact.modules():
        if hasattr(m, "fast_accum"):
            m.fast_accum = False
    models = {"bf16": bf16, "fp8-exact-accum": exact, "fp8": fp8}
    if cuda:
        from bench_vae import vae_attention

        for vae in models.values():
            vae_attention(vae, batch, "vae-fp8")  # the Engine's measured backend for the decoder's shape
    weights = {name: bench.gb(sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers())))
               for name, m in models.items()}
    bench.rec(stage="vae-fp8", what="video VAE fp8 setup", device=str(device), model=args.vae_fp8_model,
              latents=[cfg.latent_channels, t_lat, h, w], batch=batch, modes=modes, fp8_linears=replaced,
              quantize_s=round(quantize_s, 3), weights_gb=weights,
              precision_components={k: precision_report(type("C", (), {"video_vae": m})())["video_vae"]
                                    for k, m in models.items()})

    g = torch.Generator(device=device).manual_seed(2)
    z = torch.randn(cfg.latent_channels, t_lat, h, w, device=device, generator=g)
    plan = bf16.plan_decode(t_lat, h, w)
    label = f"video VAE decode {t_lat} latents {w * cfg.spatial_ratio}x{h * cfg.spatial_ratio}"

    def timed(name: str, vae, mode: str, reps: int) -> tuple[float, torch.Tensor]:
        """Warm-up batch, then `reps` whole decodes: (median seconds, last frames as uint8); records a row."""
        mode = "compiled" if mode == "compiled" and vae.compile_pays else "eager"  # as Engine._warm_vae decides
        if mode == "compiled" and not getattr(vae, "pad_batches", False):
            vae.compile_blocks_(dynamic=False)
        t0 = time.perf_counter()
        size = vae.batch_for(len(plan.items), batch)  # the size `decode` runs (compiled: the fewest padded slots)
        vae.decode_items(z, plan.items[:size], size)  # the Engine's warm-up batch (compiles in compiled mode)
        sync()
        warm_s = time.perf_counter() - t0
        runs, frames, peak = [], None, (None, None)
        for _ in range(reps):
            frames = None
            if cuda:
                bench.peak_reset()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            out = vae.decode(z, batch_size=batch)
            sync()
            runs.append(time.perf_counter() - t0)
            if cuda:
                peak = (bench.peak_gb(), bench.gb(torch.cuda.max_memory_allocated() - base))
            frames = to_uint8(out)
            del out
        runs.sort()
        seconds = runs[len(runs) // 2]
        bench.rec(stage="vae-fp8", what=f"{label} ({name}, {mode}, batch {batch})", ours_s=round(seconds, 3),
                  min_s=round(runs[0], 3), reps=len(runs), warm_s=round(warm_s, 2), peak_gb=peak[0],
                  decode_working_gb=peak[1], ms_per_frame=round(1e3 * seconds / plan.num_frames, 2),
                  frames=plan.num_frames)
        return seconds, frames

    set_gains_(list(models.values()), gains[0] if gains else 0.02)
    previous: dict = {}  # the first mode's frames: compiled vs eager, per precision (same gains)
    for mode in modes:
        frames, times = {}, {}
        # eager beside compiled is the check that the eager CUDA path runs (and a rough time): one decode
        reps = 1 if mode == "eager" and "compiled" in modes else max(1, args.vae_fp8_reps)
        for name, vae in models.items():
            try:
                times[name], frames[name] = timed(name, vae, mode, reps)
            except Exception as exc:  # keep the other variants' numbers (a compile failure, say)
                import traceback

                traceback.print_exc()
                bench.rec(stage="vae-fp8", what=f"{label} ({name}, {mode})", error=f"{type(exc).__name__}: {exc}"[:600])
        for name in sorted(n for n in frames.keys() & previous.keys() if models[n].compile_pays):
            # compiled vs eager of one precision (bf16: FP8 blocks ran eagerly in both modes)
            bench.rec(stage="vae-fp8", what=f"{label} {name} {mode} vs {modes[0]}",
                      **frame_errors(frames[name], previous[name]))
        if not previous:
            previous = dict(frames)
        if len(frames) < 2:
            continue
        for low in (n for n in ("fp8-exact-accum", "fp8") if n in frames):
            errors = frame_errors(frames[low], frames["bf16"])
            bench.rec(stage="vae-fp8", what=f"{label} {low} vs bf16 ({mode}, gains {gains[0] if gains else 0.02})",
                      ours_s=round(times[low], 3), ref_s=round(times["bf16"], 3),
                      speedup=round(times["bf16"] / times[low], 3), **errors, ok=errors["psnr_db"] >= 40)
        # the remaining gain scales, last mode only: error only, one decode each (gains are parameters: no recompile)
        for scale in gains[1:] if mode == modes[-1] else ():
            set_gains_(list(models.values()), scale)
            frames = {name: to_uint8(vae.decode(z, batch_size=batch)) for name, vae in models.items()}
            for low in ("fp8-exact-accum", "fp8"):
                errors = frame_errors(frames[low], frames["bf16"])
                bench.rec(stage="vae-fp8", what=f"{label} {low} vs bf16 ({mode}, gains {scale})", **errors,
                          ok=errors["psnr_db"] >= 40)
        set_gains_(list(models.values()), gains[0] if gains else 0.02)
        del frames
    del previous
    print_table([r for r in bench.RESULTS if r.get("stage") == "vae-fp8"])
    del models, bf16, fp8, exact
    if cuda:
        bench.peak_reset()


def print_table(rows) -> None:
    print("\n| vae-fp8 | s (median) | min s | warm s | peak GB | PSNR dB | worst frame dB | max abs "
          "| codes differing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "what" not in r or r["what"] in ("video VAE fp8 setup", "stage wall") or "backend" in r:
            continue
        if "error" in r:
            print(f"| {r['what']} | error: {r['error'][:200]} |")
            continue
        cells = [r.get(k, "") for k in ("ours_s", "min_s", "warm_s", "peak_gb", "psnr_db", "worst_frame_psnr_db",
                                        "max_abs", "codes_differing")]
        print(f"| {r['what']} | " + " | ".join("" if c is None else str(c) for c in cells) + " |")
