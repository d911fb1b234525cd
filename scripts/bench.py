"""Build, check and time h3render at the released shapes on the GPU machine, beside diffusers 0.42.1.

No checkpoint needed: real-size components get random bf16 weights created directly on the GPU (no fp32 host copy).
Every comparison runs ours and the reference on the SAME weights and inputs in the same process, and checks
||ours - ref|| / ||ref|| <= 1e-2 (bf16), so a fast wrong kernel cannot pass. Prints one JSON line per measurement
and a table at the end; `--out FILE` also writes them all as JSON.

Stages (`--stages`, comma-separated):
  ceil      bf16 matmul and device copy ceilings
  attn      attention backends at S = 73,642 (one layer, 56 heads x 128)
  kernels   Triton kernels vs their torch references at the released shapes
  dit       DiT forward: ours vs diffusers at --ref-blocks blocks (same weights; scaled to 50), then ours at 50
            blocks alone (tables, AdaLN weights dropped), 1344x768x243 and 960x544x124
  vae       video VAE decode of 72 (and 32) latent frames: ours vs diffusers, same weights
  audio     audio VAE decode (fp32), 2 x 405 latents: eager, CUDA graph (the Engine's path), cudnn TF32 off, and
            torch.compile (--audio-compile-modes) with and without a graph; each vs our eager and vs diffusers;
            medians of --audio-reps calls timed with CUDA events
  te        text encoder, 50 of 64 Qwen3-VL-32B layers, 256- and 2,000-token prompts
  ulysses   DiT forward at 1344x768x243 sharded over the torchrun ranks, per head-chunk count (--ulysses-chunks)
  vsa       FastH3 video sparse attention at 1344x768x243 (300 text + 810 audio rows), s = --vsa-sparsity: dense
            attention vs the VSA layer (coarse + fine + gate) per fine backend, the coarse stage and each Triton
            launch variant alone, rel. error vs the torch reference on 4 heads; then a 50-block DiT forward dense
            vs VSA (random gates)
  prof      top device kernels of an 8-block DiT forward (sharded under torchrun) and a compiled VAE decode batch
  compare   1 GPU vs N GPUs: latents and frames saved by `e2e --save-latents` runs on this machine
  e2e       complete MP4 of --e2e-canvases clips (default a 10.125 s 1344x768) with --forwards DiT forwards (4 = FastH3
            length; --e2e-vsa: then again with VSA at --vsa-sparsity, random gates), all
            components resident, for each of --precision (bf16,fp8: one engine after the other), --e2e-attention
            to pick dense / vsa; scripts/bench_e2e.py; run under torchrun for several GPUs. --e2e-content
            noise,moving renders each job once per picture: noise (what random weights decode, the default), moving
            (the real decode, each chunk then painted with a moving scene so x264 runs at a footage's rate;
            scripts/bench_content.py); with a painted kind each row also has the decode alone (decode_alone_s) and
            vae_video minus it
  fp8-gemm, fp8-quant, fp8-dit
            issue 18 (scripts/bench_fp8.py): the DiT's block GEMMs bf16 vs FP8, the fused FP8 producers, a DiT
            forward and the 4-forward FastH3 chain bf16 vs FP8 (errors, memory); `--fp8-model tiny --fp8-device cpu
            --fp8-canvas 160x128x22` is the CPU smoke run
  tables    AdaLN tables of the released DiT: built (projections on the GPU / in host memory), the copy to host, then
            through the on-disk cache, first and second run (scripts/bench_prepare.py; issue 26)
  prepare   Engine.prepare of a first and a second run per --precision (bf16,fp8: one engine at a time) against
            one AdaLN table cache folder, and the load before it (scripts/bench_prepare.py; issue 26); `--e2e-model
            tiny --e2e-device cpu --e2e-canvases 160x128x22 --prepare-steps 3` is the CPU smoke run
  te-fp8    FP8 text encoder, eager and unpadded: per-call dequantize vs the Triton weight-only GEMM vs dequantize +
            cuBLAS vs w8a8 (mode "rows") (scripts/bench_prepare.py; issue 26)
  te-small  the FP8 text encoder as a t2va encode runs it (padded, replayed from a CUDA graph): bf16 vs FP8 "auto",
            "dequant-fused" and "rows", and the weight-only GEMM's launch settings per linear shape at --te-small-rows
            rows (scripts/bench_te_small.py; issue 26 item 3)
  vae-fp8   video VAE decode, bf16 vs FP8 decoder block linears (`--precision fp8`), eager and compiled, at
            --vae-fp8-latents (72x48x84: 243 frames of 1344x768): time, peak memory, PSNR / max abs of the FP8 frames
            vs the bf16 frames in uint8 (scripts/bench_vae_fp8.py; issue 26); `--vae-fp8-model tiny --vae-fp8-device
            cpu --vae-fp8-latents 7x4x4 --vae-fp8-modes eager --vae-fp8-reps 1` is the CPU smoke run
  fp8-memory
            resident memory per component and load peak, per --precision (scripts/bench_e2e.py)
  fl2va     fl2va's extra cost over t2va at --fl2va-canvas (scripts/bench_fl2va.py): vision tower + processor for 2
            keyframes, their VAE encode, the text encoder's longer presentation, one DiT forward with the +2,016
            condition rows vs without, summed for --fl2va-forwards forwards; `--fl2va-model tiny --fl2va-device
            cpu --fl2va-canvas 224x128x39` is the CPU smoke run
  memplans  issue 27 (scripts/bench_memplans.py): the memory plans (resident / phased text / streamed blocks, bf16 /
            fp8) on one GPU capped by set_per_process_memory_fraction, the allocator's peak, the wall against the
            uncapped resident run of the same call; the text phase of a --memplan-queue-job queue; `--memplan-model
            tiny --memplan-device cpu --memplan-canvas 128x64x22 --forwards 1` is the CPU smoke run; each run
            renders once per --e2e-content kind
  ref2va    a ref2va job at --ref2va-canvas with one image and one --ref2va-video-seconds video+audio reference
            (scripts/bench_ref2va.py): image resize + vision tower, VAE encode of both references, the text
            encoder's presentation, one DiT forward with the extra rows vs t2va (peak memory), complete MP4s
            (t2va, ref2va with the image, t2va) with both DiT partitions, and the partition swap (device <-> host);
            `--ref2va-model tiny --ref2va-device cpu --ref2va-canvas 224x128x22 --ref2va-forwards 2
            --ref2va-video-seconds 1` is the CPU smoke run
  longclip  a clip longer than one pass (issue #24, scripts/bench_longclip.py): --longclip-duration s (30) at
            --longclip-canvas (1344x768) as windowed continuation on a FastH3 VSA student (--vsa-sparsity, random
            gates, the release's 4 forwards) in --longclip-precision (fp8): time and peak memory per window, the
            overlap's overhead, the complete MP4; `--longclip-model tiny --longclip-device cpu --longclip-canvas
            160x128 --longclip-duration 1.8 --longclip-window 39 --longclip-overlap 5` is the CPU smoke run
  lora      issue 25 (scripts/bench_lora.py): per-forward overhead of 1/2/4 un-fused LoRAs of rank 32/128 at
            --lora-canvas in bf16 and fp8, fuse/unfuse time, a 4-job queue alternating LoRA sets vs no LoRAs;
            `--lora-model tiny --lora-device cpu --lora-canvas 160x128x22 --lora-text 6` is the CPU smoke run
  peers     issue 26 (scripts/bench_peers.py): FastVideo-kernel 0.3.5's VSA fine kernels (Triton; ThunderKittens when its
            sm_90 extension loads) against ours on the same kept sets at 1344x768x243, and FlashAttention-3 bf16 / FP8
            at the video VAE decoder's attention shape, each with its error; a peer that does not load gets a row
  vsa-tune  issue 26 (scripts/bench_vsa_tune.py): the TMA fine kernel at --vsa-tune-canvases over stages x register
            caps (--vsa-tune-maxnreg) x program order, int8 and bf16 QK^T, each with its error, registers, spills and
            shared memory; first the coarse stage's rows: the kept-set selection (torch, Triton radix and
            interpolation searches) and the coarse softmax @ v in fp32 and TF32
  batch     queue throughput on 1 GPU: --batch-jobs jobs of --forwards DiT forwards at --batch-canvas through
            `run_batch` with one resident Engine (each job's MP4 tail beside the next job's start). Warm-up
            (prepare, and one untimed job of the queue's shape for Triton JIT / first-call costs) is outside the
            timings. `--batch-model tiny` runs it on the built-in tiny model (also on CPU: `--batch-device cpu`), a
            smoke test of the stage.

Usage (device): python scripts/bench.py --stages ceil,attn,kernels,dit,vae,audio,te
                torchrun --nproc-per-node 2 scripts/bench.py --stages e2e
                python scripts/bench.py --stages batch --batch-canvas 960x544x124 --out batch.json
Usage (CPU smoke): python scripts/bench.py --stages batch --batch-model tiny --batch-device cpu \
                       --batch-canvas 128x64x22
                   python scripts/bench.py --stages e2e --e2e-model tiny --e2e-device cpu --e2e-canvases 160x128x22 \
                       --forwards 1 --e2e-content noise,moving
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import _bootstrap  # noqa: F401  (h3render from this checkout when it is not installed; scripts/ is sys.path[0])
import bench_common
from bench_common import RESULTS, rec
from bench_dit import stage_attn, stage_ceil, stage_dit, stage_kernels, stage_prof, stage_ulysses, stage_vsa
from bench_engine import stage_batch, stage_compare
from bench_media import stage_media
from bench_vae import stage_audio, stage_te, stage_vae

from h3render.spec import FASTH3_V1_VSA_SPARSITY  # noqa: E402


# The stages held in scripts/bench_e2e.py, bench_fp8.py and bench_fl2va.py take the shared helpers' module
# (bench_common: rec, gb, rel_err, random_, dit_flops, dit_inputs, PROMPT) as their `bench` argument.


def stage_e2e(args) -> None:
    """Complete MP4s through the real Engine, per --precision (scripts/bench_e2e.py)."""
    import bench_e2e

    bench_e2e.stage_e2e(args, bench_common)


def stage_fp8_gemm(args) -> None:
    import bench_fp8

    bench_fp8.stage_gemm(args, bench_common)


def stage_fp8_quant(args) -> None:
    import bench_fp8

    bench_fp8.stage_quant(args, bench_common)


def stage_fp8_dit(args) -> None:
    import bench_fp8

    bench_fp8.stage_dit(args, bench_common)


def stage_fp8_memory(args) -> None:
    import bench_e2e

    bench_e2e.stage_memory(args, bench_common)


def stage_memplans(args) -> None:
    """The memory plans capped on one GPU (scripts/bench_memplans.py, issue #27)."""
    import bench_memplans

    bench_memplans.stage_memplans(args, bench_common)


def stage_longclip(args) -> None:
    """A clip longer than one pass as windowed continuation (scripts/bench_longclip.py)."""
    import bench_longclip

    bench_longclip.run(args, bench_common)


def stage_lora(args) -> None:
    """Per-job LoRAs: side-path overhead, fuse/unfuse, an alternating 4-job queue (scripts/bench_lora.py)."""
    import bench_lora

    bench_lora.stage_lora(args, bench_common)


def stage_fl2va(args) -> None:
    """fl2va's extra cost over t2va (scripts/bench_fl2va.py)."""
    import bench_fl2va

    bench_fl2va.run(args, bench_common)


def stage_tables(args) -> None:
    """AdaLN tables: built vs read back from the on-disk cache (scripts/bench_prepare.py)."""
    import bench_prepare

    bench_prepare.stage_tables(args, bench_common)


def stage_prepare(args) -> None:
    """A first and a second run's Engine.prepare per --precision, one table cache (scripts/bench_prepare.py)."""
    import bench_prepare

    bench_prepare.stage_prepare(args, bench_common)


def stage_vae_fp8(args) -> None:
    """Video VAE decode, bf16 vs FP8 decoder block linears (scripts/bench_vae_fp8.py)."""
    import bench_vae_fp8

    bench_vae_fp8.stage_vae_fp8(args, bench_common)


def stage_te_fp8(args) -> None:
    """FP8 text encoder, eager: per-call dequantize vs the Triton weight-only GEMM (scripts/bench_prepare.py)."""
    import bench_prepare

    bench_prepare.stage_te_fp8(args, bench_common)


def stage_te_small(args) -> None:
    """The FP8 text encoder at a prompt's row counts, replayed from graphs; the weight-only GEMM's sweep
    (scripts/bench_te_small.py)."""
    import bench_te_small

    bench_te_small.run(args, bench_common)


def stage_peers(args) -> None:
    """Peers' VSA and attention kernels beside ours (scripts/bench_peers.py)."""
    import bench_peers

    bench_peers.run(args, bench_common)


def stage_vsa_tune(args) -> None:
    """The VSA TMA fine kernel's launch settings and register caps (scripts/bench_vsa_tune.py)."""
    import bench_vsa_tune

    bench_vsa_tune.run(args, bench_common)


def stage_ref2va(args) -> None:
    """A ref2va job with an image and a video+audio reference (scripts/bench_ref2va.py)."""
    import bench_ref2va

    bench_ref2va.run(args, bench_common)


# Every stage by function name, as `--stages` names them ("fp8-gemm" -> stage_fp8_gemm).
STAGES = {f.__name__: f for f in (
    stage_ceil, stage_attn, stage_kernels, stage_dit, stage_vae, stage_audio, stage_te, stage_ulysses, stage_vsa,
    stage_prof, stage_compare, stage_e2e, stage_fp8_gemm, stage_fp8_quant, stage_fp8_dit, stage_fp8_memory,
    stage_fl2va, stage_ref2va, stage_batch, stage_media, stage_tables, stage_prepare, stage_te_fp8, stage_vae_fp8,
    stage_memplans, stage_longclip, stage_lora, stage_peers, stage_vsa_tune, stage_te_small)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="ceil,attn,kernels,dit,vae,audio,te")
    p.add_argument("--ref-blocks", type=int, default=8)
    p.add_argument("--attention", default=None)
    p.add_argument("--vae-batches", default="8", help="comma-separated decode batch sizes to time")
    p.add_argument("--forwards", type=int, default=4)
    p.add_argument("--e2e-reps", type=int, default=1)
    p.add_argument("--e2e-canvases", default="1344x768x243", help="e2e: comma-separated WxHxFRAMES")
    p.add_argument("--e2e-vsa", action="store_true", help="e2e: also render with VSA (random gates) after dense")
    p.add_argument("--save-latents", action="store_true", help="e2e: also write the final latents beside the MP4")
    p.add_argument("--ulysses-chunks", default="1,2,4", help="head chunks per rank to time in the ulysses stage")
    p.add_argument("--batch-canvas", default="1344x768x243", help="WxHxFRAMES of every queued job (batch stage)")
    p.add_argument("--batch-jobs", type=int, default=4)
    p.add_argument("--batch-model", default="released", choices=["released", "tiny", "small"],
                   help="released: random real-size components on the GPU; tiny/small: the built-in random models")
    p.add_argument("--batch-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--batch-warmup", type=int, default=1, help="untimed jobs rendered before the two queues")
    p.add_argument("--batch-out", default="/tmp/h3render-bench-batch")
    p.add_argument("--audio-latents", type=int, default=405, help="audio stage: latents per channel (405 = 10.125 s)")
    p.add_argument("--audio-reps", type=int, default=25, help="audio stage: timed calls per variant (median)")
    p.add_argument("--audio-compile-modes", default="none",
                   help="audio stage: comma-separated torch.compile modes to try after eager and CUDA graph, e.g. "
                        "max-autotune-no-cudagraphs (its autotuning can take minutes); 'none' skips")
    p.add_argument("--media-kinds", default="moving,noise", help="media stage: content kinds (moving, noise)")
    p.add_argument("--media-decode-s", default="4.08,7.07",
                   help="media stage: simulated decode seconds for the whole clip (2-GPU split 4.08, 1 GPU 7.07)")
    p.add_argument("--media-frames", type=int, default=243)
    p.add_argument("--media-audio", choices=("first", "last"), default="first",
                   help="media stage: hand the soundtrack to the writer before the first frame (what the Engine "
                        "does) or after the last (what it did before: AAC then runs inside the close)")
    p.add_argument("--media-grain", type=float, default=0.01, help="media stage: grain std of 'moving' content")
    p.add_argument("--media-x264-params", default="default",
                   help="media stage: ';'-separated x264-params variants to compare ('default' = the writer's)")
    p.add_argument("--media-dir", default="/tmp/h3render-media", help="media stage: where the MP4s are written")
    p.add_argument("--prof-dit", default="bf16-dense", choices=("bf16-dense", "fp8-vsa", "none"),
                   help="prof stage: the 8-block DiT's precision and attention (fp8-vsa skips the VAE profile, none "
                        "the DiT's)")
    p.add_argument("--prof-canvas", default="1344x768x243", help="prof stage: the DiT forward's WxHxFRAMES")
    p.add_argument("--prof-vae", default="bf16", choices=("bf16", "fp8"),
                   help="prof stage: the video VAE decoder's block linears")
    p.add_argument("--vsa-layer-only", action="store_true", help="vsa stage: one layer only, no DiT forward")
    p.add_argument("--vsa-fines", default="triton,flex", help="vsa stage: fine backends of the whole-layer rows")
    p.add_argument("--vsa-sparsity", type=float, default=FASTH3_V1_VSA_SPARSITY,
                   help="vsa stage: sparsity (default FastH3 v1's; h3render.spec FASTH3_V*_VSA_SPARSITY)")
    p.add_argument("--vsa-tune-maxnreg", default="168", help="vsa-tune stage: register caps besides none")
    p.add_argument("--vsa-tune-stages", default="2,3", help="vsa-tune stage: pipeline stages to time (\"\": the coarse rows only)")
    p.add_argument("--vsa-tune-canvases", default="1344x768x243,960x544x124", help="vsa-tune stage: WxHxFRAMES")
    p.add_argument("--fl2va-canvas", default="1344x768x243", help="fl2va stage: WxHxFRAMES")
    p.add_argument("--fl2va-model", default="released", choices=["released", "tiny", "small"])
    p.add_argument("--fl2va-device", default=None, choices=["cuda", "cpu"], help="default: cuda when available")
    p.add_argument("--fl2va-forwards", type=int, default=49, help="fl2va stage: DiT forwards of the job (49 = base)")
    p.add_argument("--fl2va-reps", type=int, default=3, help="fl2va stage: timed calls per measurement (median)")
    p.add_argument("--fl2va-te", type=int, default=1, help="fl2va stage: 0 skips the text encoder (≈ 50 GB)")
    p.add_argument("--out", default=None)
    import bench_e2e  # scripts/ is sys.path[0] when run as a script
    import bench_fp8
    import bench_longclip
    import bench_lora
    import bench_memplans
    import bench_prepare
    import bench_vae_fp8

    bench_fp8.add_arguments(p)
    bench_lora.add_arguments(p)
    bench_prepare.add_arguments(p)
    bench_vae_fp8.add_arguments(p)
    bench_e2e.add_arguments(p)
    bench_memplans.add_arguments(p)
    import bench_ref2va

    bench_ref2va.add_arguments(p)
    bench_longclip.add_arguments(p)
    import bench_te_small

    bench_te_small.add_arguments(p)
    args = p.parse_args()
    args.vae_batches = [int(x) for x in args.vae_batches.split(",")]
    args.ulysses_chunks = [int(x) for x in args.ulysses_chunks.split(",")]
    args.audio_compile_modes = args.audio_compile_modes.split(",")
    args.media_decode_s = [float(x) for x in args.media_decode_s.split(",")]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.cuda.is_available()
    rec(stage="env", gpu=torch.cuda.get_device_name(0) if cuda else None, torch=torch.__version__,
        gpus=torch.cuda.device_count() if cuda else 0, cpus=os.cpu_count())
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        try:
            STAGES[f"stage_{name.replace('-', '_')}"](args)
        except Exception as exc:  # keep the other stages' numbers
            import traceback

            traceback.print_exc()
            rec(stage=name, error=f"{type(exc).__name__}: {exc}"[:400])
        rec(stage=name, what="stage wall", seconds=round(time.perf_counter() - t0, 1))
        if cuda:
            torch.cuda.empty_cache()
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    if int(os.environ.get("RANK", "0")) == 0:
        print_table()


def print_table() -> None:
    print("\n| stage | what | ours (s) | ref (s) | speedup | TFLOP/s | rel err | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in RESULTS:
        what = r.get("what") or r.get("kernel") or r.get("backend")
        if what is None or what == "stage wall":
            continue
        err = r.get("rel_err", r.get("rel_err_video"))
        err = f"{err:.1e}" if isinstance(err, float) else (err or "")
        ours = r.get("ours_s", r.get("wall_s", r.get("triton_ms", r.get("seconds", ""))))
        print(f"| {r['stage']} | {what} | {ours} | {r.get('ref_s', r.get('naive_ms', ''))} | "
              f"{r.get('speedup', '')} | {r.get('tflops', r.get('TFLOPs', ''))} | {err} | "
              f"{r.get('peak_gb', r.get('peak_gb_ours', r.get('gb', '')))} |")


if __name__ == "__main__":
    main()
