"""FP8 (e4m3) linears for `--precision fp8`: the DiT block GEMMs, the video VAE decoder's block GEMMs and the text
encoder's weights.

* `Fp8Linear`: e4m3 weight with one fp32 scale per output channel, e4m3 activations with one scale per row
  (`kernels.fp8.Fp8Rows`), one `torch._scaled_mm` that applies both scales in its epilogue and writes bf16. The DiT's
  blocks hand it `Fp8Rows` straight from the fused producers (`modulate(..., fp8=True)` -> qkv / gate / fc1,
  `swiglu(..., fp8=True)` -> fc2); a float input (the attention output -> out_proj) goes through
  `kernels.fp8.quantize_rows` first.
* `Fp8WeightLinear`: weight-only FP8 for the text encoder (it runs once per job, so accuracy comes first): the e4m3
  weight is dequantized to the activation dtype per call and the GEMM runs there, so the only error is the weight's
  own rounding (no activation quantization). Its mode "rows" (not the default) runs `Fp8Linear`'s product instead
  (activations rounded to e4m3 per row too), through the same private function `_rows_scaled_mm`.
* `quantize_dit_fp8_`, `quantize_text_encoder_fp8_`: in-place replacement of the covered linears, one at a time, so
  the peak grows by one linear's transient, not by a model. `empty_dit_fp8_` (and `quantize_text_encoder_fp8_` on
  an empty encoder) build the empty FP8 modules that `checkpoint.load` streams quantized weights into.
* `quantize_video_decoder_fp8_`: the video VAE decoder's block linears as `Fp8Linear`. q/k/v and fc1 read `Fp8Rows`
  from the fused residual add + RMSNorm + e4m3 kernel (`kernels.residual_norm_fp8`, `models.video_vae.ViTBlock`),
  fc2 from the fused SwiGLU kernel (`models.video_vae.FeedForward`: fc1 bias + value * silu(gate) + row scale +
  e4m3 in one pass), the attention output projection from `quantize_rows` (one Triton pass on CUDA). The Engine
  runs these blocks eagerly: compiled they decoded 1.4-1.9 % slower (`VideoVAE.compile_pays`).
* `precision_report`: what precision each loaded component runs in, for the sidecar.

Weight scales are per output channel, `amax(|w[n, :]|) / 448` (448 = largest finite e4m3, `kernels.fp8.E4M3_MAX`),
the row-wise layout `torch._scaled_mm` takes as `scale_b [1, N]`; the issue's speed measurements (H200, torch 2.11)
used row-wise scales too. What stays in bf16/fp32 is the issue's list: patch projections, time embedder, token
refiner, AdaLN projections, final layer and heads, and everything the release keeps in fp32.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from h3render.kernels.fp8 import Fp8Rows, quantize_rows, quantize_rows_naive

# torch._scaled_mm's e4m3 GEMMs (cuBLASLt) need compute capability 8.9 or newer: Ada (8.9), Hopper (9.0), Blackwell.
FP8_MIN_CAPABILITY = (8, 9)


def fp8_problem(dtype: str, devices=()) -> str | None:
    """Why FP8 GEMMs cannot run with these activations or on these devices, or None.

    Args:
        dtype: the activations' (block stack's) dtype, "bf16" or "fp32": the FP8 GEMMs write bf16, so bf16 only.
        devices: the `torch.device`s of the run; each CUDA one needs compute capability >= `FP8_MIN_CAPABILITY`
            (`torch.cuda.get_device_capability`); the CPU computes the same products dequantized in fp32
            (`Fp8Linear`), slowly.
    """
    if dtype != "bf16":
        return (f"--precision fp8 runs the activations in bf16 (its GEMMs write bf16), so it cannot go with --dtype "
                f"{dtype}: drop --dtype or pass --dtype bf16")
    for device in devices:
        if device.type != "cuda":
            continue
        capability = tuple(torch.cuda.get_device_capability(device))
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            return (f"--precision fp8 needs FP8 GEMMs (torch._scaled_mm): CUDA compute capability >= "
                    f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} (Ada, Hopper or newer); {device} ({name}) has "
                    f"{capability[0]}.{capability[1]}: use --precision bf16")
    return None

__all__ = [
    "DIT_BLOCK_LINEARS", "FP8", "TEXT_ENCODER_LINEARS", "Fp8Linear", "Fp8WeightLinear", "precision_report",
    "empty_dit_fp8_", "quantize_dit_fp8_", "quantize_text_encoder_fp8_", "quantize_video_decoder_fp8_",
    "quantize_weight", "VIDEO_DECODER_LINEARS",
]

FP8 = torch.float8_e4m3fn
# torch._scaled_mm (cuBLASLt FP8) needs both GEMM dimensions of the weight divisible by 16.
_SCALED_MM_MULTIPLE = 16
# Rows per weight-quantization chunk: at most ~2**26 fp32 elements (256 MB) of transient per chunk, so quantizing a
# released [28672, 5376] fc1 does not add a full fp32 copy (616 MB) to the load peak.
_CHUNK_ELEMENTS = 1 << 26

# DiT block linears that run FP8 (issue #18): attention q/k/v and output, the SwiGLU FFN, FastH3's VSA gate.
DIT_BLOCK_LINEARS = ("attn.qkv_proj", "attn.gate_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
# Those that run with fast accumulation (`Fp8Linear.fast_accum`): faster at the released shapes, fc2 slower
# (docs/performance.md §25.6, the gate §26.2).
DIT_FAST_ACCUM = ("attn.qkv_proj", "attn.gate_proj", "attn.out_proj", "mlp.fc1")
# Qwen3-VL decoder-layer linears (transformers `Qwen3VLTextAttention` / `Qwen3VLTextMLP`): about 24 B of the released
# conditioner's ≈25.7 B parameters (50 read layers x 487 M; embeddings 0.78 B and the norms stay bf16).
# Video VAE decoder block linears (`models.video_vae.ViTBlock`): q/k/v (fused `to_qkv` as the Engine runs them, or
# the checkpoint's three), the attention output and the SwiGLU in/out projections: the GEMMs that are ≈ 72 % of the
# decoder's kernel time (docs/performance.md §6.1). proj_in (K = 24, not a multiple of 16), proj_out (the last
# layer before the pixels, as the DiT's final layer), the norms, the fp32 residual stream and the encoder stay.
VIDEO_DECODER_LINEARS = ("attn.to_qkv", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj",
                         "ff.net.2")
TEXT_ENCODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 quantization of a linear's weight, on the weight's own device.

    Args:
        weight: [N, K] float (bf16 / fp32), row n = output channel n.

    Returns:
        data [N, K] float8_e4m3fn and scale [1, N] float32 with weight[n] ~= data[n].float() * scale[0, n],
        scale = max(|weight[n]|) / 448 (floored at `kernels.fp8.MIN_SCALE`, so an all-zero channel stays zero).
        Quantized in row chunks (the math of `kernels.fp8.quantize_rows_naive`, fp32, one rounding).
    """
    if weight.ndim != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    data = torch.empty(n, k, dtype=FP8, device=weight.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, step):
        d, s = quantize_rows_naive(weight[start:start + step])
        data[start:start + step] = d
        scale[start:start + step] = s
    return data, scale.t().contiguous()


# Whether CUDA GEMMs add their bias in cuBLASLt's epilogue (`_rows_scaled_mm`); False adds it in a separate pass after
# the bf16 rounding, as before the eighteenth session: a module setting so that the benchmark times both in one process.
BIAS_EPILOGUE = True


def _rows_scaled_mm(x: "torch.Tensor | Fp8Rows", weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, fast_accum: bool = False) -> torch.Tensor:
    """The one home of the w8a8 product (`Fp8Linear`, `Fp8WeightLinear` mode "rows"): e4m3 rows x e4m3 weight.

    Args:
        x: `Fp8Rows` (data [S, K] e4m3, scale [S, 1] fp32), or a float tensor [S, K] that is quantized per row here
            (`kernels.fp8.quantize_rows`).
        weight: [N, K] float8_e4m3fn; weight_scale: [1, N] float32 (`quantize_weight`); K, N multiples of 16 on
            CUDA (`torch._scaled_mm`).
        bias: [N] or None, added to the fp32 product before its one bf16 rounding: on CUDA in the GEMM's epilogue
            (cuBLASLt's bias epilogue), where a separate `out + bias` cost one more pass over the output (the video
            VAE decoder's q/k/v, out and fc2 projections: 6.9 ms of each 99 ms decode batch on an H200,
            docs/performance.md §28).
        fast_accum: on CUDA, cuBLASLt's fast accumulation (`Fp8Linear.fast_accum`); no effect off CUDA.

    Returns:
        [S, N] bf16: on CUDA one `torch._scaled_mm` (both scales in its epilogue; row-wise scaling writes bf16 only);
        off CUDA the dequantized operands' fp32 product rounded once to bf16 (what cuBLASLt computes, up to the order
        of accumulation). The caller casts to its output dtype.
    """
    if not isinstance(x, Fp8Rows):
        x = quantize_rows(x.contiguous())  # one Triton pass on CUDA (the Engine compiles no FP8 module)
    if x.data.shape[0] == 0:  # a rank's empty shard: cuBLASLt takes no M = 0 problem
        out = torch.empty(0, weight.shape[0], dtype=torch.bfloat16, device=x.data.device)
    elif x.data.device.type == "cuda":
        epilogue = bias is not None and BIAS_EPILOGUE
        out = torch._scaled_mm(x.data, weight.t(), scale_a=x.scale, scale_b=weight_scale,
                               bias=bias.to(torch.bfloat16) if epilogue else None,
                               out_dtype=torch.bfloat16, use_fast_accum=fast_accum)  # [S, N]
        if bias is not None and not epilogue:
            out = out + bias.to(out.dtype)
    else:
        # Off CUDA the same product, dequantized operands in fp32 then one bf16 rounding: CPU `_scaled_mm` takes
        # per-tensor scales only before torch 2.13 (2.11 fails an INTERNAL ASSERT in mkldnn/Linear.cpp).
        out = x.dequantize() @ (weight.float() * weight_scale.t()).t()
        if bias is not None:  # cuBLASLt's epilogue reads the bias in bf16
            out = out + bias.to(torch.bfloat16).float()
        out = out.to(torch.bfloat16)
    return out


class _Fp8Weight(nn.Module):
    """Shared storage of both FP8 linears: buffers `weight` [N, K] e4m3, `weight_scale` [1, N] fp32, `bias` [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, out_dtype: torch.dtype,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.out_dtype = out_dtype
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.empty(1, out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=out_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear):
        """Quantize `linear` on its own device; the result holds no reference to `linear`'s weight, so dropping
        the linear frees it. Output dtype = the linear's weight dtype (bf16 at release). A linear on the meta
        device (an empty module before loading) gives the empty FP8 module, buffers on meta, for a loader to stream
        already-quantized tensors into (`checkpoint.load`: the text encoder).

        Raises:
            ValueError: (Fp8Linear) a dimension is not a multiple of 16.
        """
        w = linear.weight
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, device=w.device)
        if w.is_meta:
            return module
        with torch.no_grad():
            module.weight, module.weight_scale = quantize_weight(w.detach())
            if linear.bias is not None:
                module.bias = linear.bias.detach().clone()
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: data * per-channel scale in fp32, rounded once."""
        return (self.weight.float() * self.weight_scale.t()).to(dtype)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) / .float() / .half() cast every floating buffer, float8 included, which would turn the
        # e4m3 codes into unscaled values and round the fp32 scales. Only the device follows `fn`; dtypes stay.
        device = fn(torch.empty(0, device=self.weight.device)).device
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = t.to(device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, out_dtype={self.out_dtype}")


class Fp8Linear(_Fp8Weight):
    """`y = x @ w.T (+ bias)` as one FP8 GEMM: e4m3 activations (per-row scale) x e4m3 weight (per-channel scale).

    Buffers: `weight` [N, K] float8_e4m3fn (row-major, as nn.Linear), `weight_scale` [1, N] float32, optional
    `bias` [N]. K and N must be multiples of 16 (`torch._scaled_mm`); the released DiT's are (5376, 7168, 14336,
    21504, 28672), and so are DIT_TINY's / DIT_SMALL's.

    `fast_accum` (`quantize_dit_fp8_` and `quantize_video_decoder_fp8_` set it) accumulates the e4m3 products in
    the tensor cores' own accumulator over the whole K loop instead of promoting to fp32 every few steps (cuBLASLt's
    FAST_ACCUM). 1x H200, the DiT's block GEMMs at S = 73,642: qkv, out and fc1 6.7-9.5 % faster, fc2 5 % slower;
    rel. error vs the fp32 GEMM 0.03747 -> 0.03750 (qkv, fc1), 0.03751 (out): e4m3's rounding dominates
    (docs/performance.md §25.6); a VSA student's gate (5376 -> 7168) 9.3 % faster, 0.03747 -> 0.03750 (§26.2). So
    `quantize_dit_fp8_` sets it on those four (`DIT_FAST_ACCUM`); fc2 keeps the fp32 promotion.
    `quantize_video_decoder_fp8_` sets it on all the video VAE decoder's FP8 linears: 72 latents at 1344x768
    decode in 5.035 s instead of 5.453 s, and the frames' PSNR against the bf16 decode is the same (45.08 dB at
    gains 0.3, 58.52 dB at 0.02; docs/performance.md §26.1).
    """

    fast_accum = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        for what, size in (("in_features (K)", in_features), ("out_features (N)", out_features)):
            if size % _SCALED_MM_MULTIPLE:
                raise ValueError(f"Fp8Linear: {what} = {size} is not a multiple of {_SCALED_MM_MULTIPLE}, which "
                                 f"torch._scaled_mm requires; keep this linear in bf16")
        super().__init__(in_features, out_features, bias, out_dtype, device)

    def forward(self, x: "torch.Tensor | Fp8Rows", *, with_bias: bool = True) -> torch.Tensor:
        """
        Args:
            x: `Fp8Rows` (data [S, K] e4m3, scale [S, 1] fp32) from a fused producer, or a float tensor [..., K]
                (quantized per row here with `kernels.fp8.quantize_rows`).
            with_bias: False leaves `bias` out, for a consumer that adds it in fp32 itself (the video VAE decoder's
                fc1, whose bias the fused SwiGLU kernel adds: `models.video_vae.FeedForward`).

        Returns:
            [S, N] (or [..., N]) in `out_dtype`; the GEMM writes bf16 (row-wise scaled_mm on CUDA writes bf16 only)
            and an fp32 linear's output is cast up from it. Off CUDA: the dequantized operands' fp32 product,
            rounded once to bf16 (what cuBLASLt computes, up to the order of accumulation).
        """
        lead = None
        if not isinstance(x, Fp8Rows):
            if x.shape[-1] != self.in_features:
                raise ValueError(f"Fp8Linear: input has {x.shape[-1]} features, the weight expects {self.in_features}")
            lead = x.shape[:-1]
            x = x.reshape(-1, self.in_features)
        elif x.data.ndim != 2 or x.data.shape[1] != self.in_features:
            raise ValueError(f"Fp8Linear: Fp8Rows data must be [S, {self.in_features}], got {tuple(x.data.shape)}")
        bias = self.bias if with_bias else None
        out = _rows_scaled_mm(x, self.weight, self.weight_scale, bias, self.fast_accum).to(self.out_dtype)
        return out if lead is None else out.view(*lead, self.out_features)


class Fp8WeightLinear(_Fp8Weight):
    """Weight-only FP8: `F.linear(x, dequantize(w), bias)` in x's dtype; same buffers as `Fp8Linear`, any K, N.

    Activations keep their dtype: the error is the weight rounding alone (e4m3, 3 mantissa bits, per-channel scale).
    Measured on the built-in tiny conditioner (tests/unit/test_fp8_model.py): 0.082 relative error at the read layer,
    against 0.127 with `Fp8Linear` (activations quantized per row as well; torch 2.13 CPU, first measured as 0.088 vs
    0.115); hence weight-only. The dequantized weight [N, K] exists only during the call (released: at most 25600 x
    5120, 0.5 GB fp32 + 0.26 GB bf16 transient) on the CPU. On CUDA with bf16 / fp16 activations (`kernels.fp8_weight`,
    issue 26): up to `GEMM_MAX_ROWS` rows (a t2va prompt's padded 64-256 tokens) one Triton GEMM that decodes the e4m3
    codes in registers (1 byte read per weight, the scale on the fp32 accumulator: the weight enters the dot exactly),
    otherwise one Triton pass dequantizes the weight to bf16 bit for bit as on the CPU (3 bytes per weight instead of
    11) and cuBLAS multiplies. Measured on an H200: at bf16's speed or better up to 192 rows (the figures:
    `kernels.fp8_weight.triton_impl`, docs/performance.md §32-33), against 0.20 s a prompt for the per-call torch
    dequantize before issue 26.

    Mode "rows" (issue 26 item 3; measured on an H200, docs/performance.md §22.4 and §32: replayed from a CUDA graph
    0.020 / 0.020 / 0.026 s at 64 / 128 / 256 rows, below bf16, but the read states' error against bf16 0.114-0.122
    where the weight-only product's is 0.096-0.103 on random weights; not the default) trades that accuracy for FP8
    tensor cores: the activations are rounded to e4m3 too, one scale per row (`kernels.fp8.quantize_rows`), and one
    `torch._scaled_mm` multiplies them with the weight as is, the product `Fp8Linear` computes (`_rows_scaled_mm`; the
    0.127 above) with the output in x's dtype. On CUDA it needs compute capability >= `FP8_MIN_CAPABILITY`.
    """

    # "auto" (above), "gemm" (the Triton GEMM at any row count), "dequant-fused", "dequant" (the torch expression: the
    # path before issue 26) or "rows" (w8a8, above); a class setting so that the benchmark measures each in one
    # process (scripts/bench_prepare.py `te-fp8`, bench_te_small.py).
    mode = "auto"
    # §32-33: the GEMM beat dequantize + cuBLAS at every linear of the encoder at 64-256 rows; §11: dequantize +
    # cuBLAS won at 2000.
    GEMM_MAX_ROWS = 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] float -> [..., N] in x's dtype."""
        mode = self.mode
        if mode == "rows":
            if self.in_features % _SCALED_MM_MULTIPLE or self.out_features % _SCALED_MM_MULTIPLE:
                # torch._scaled_mm takes no such K or N (the released encoder's 5120 / 1024 / 8192 / 25600 all are
                # multiples of 16; tiny test shapes may not be): this linear keeps the weight-only "auto" path.
                mode = "auto"
            else:
                lead = x.shape[:-1]
                out = _rows_scaled_mm(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias)
                return out.to(x.dtype).view(*lead, self.out_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if mode != "dequant" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            rows = x.numel() // max(x.shape[-1], 1)
            if mode == "gemm" or (mode == "auto" and rows <= self.GEMM_MAX_ROWS):
                from h3render.kernels.fp8_weight import fp8_weight_linear

                return fp8_weight_linear(x.contiguous(), self.weight, self.weight_scale, bias)
            from h3render.kernels.fp8_weight import fp8_dequantize

            return F.linear(x, fp8_dequantize(self.weight, self.weight_scale, x.dtype), bias)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)


def _replace(root: nn.Module, path: str, make) -> bool:
    """Replace the nn.Linear at `root.<path>` by `make(linear)`; False when absent (None) or already FP8."""
    owner_path, _, leaf = path.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    old = getattr(owner, leaf, None)
    if old is None or isinstance(old, _Fp8Weight):
        return False
    if not isinstance(old, nn.Linear):
        raise TypeError(f"{path}: expected an nn.Linear to quantize, found {type(old).__name__}")
    setattr(owner, leaf, make(old))
    del old  # the last reference: the bf16 weight is freed before the next linear is quantized
    return True


@torch.no_grad()
def quantize_dit_fp8_(dit: nn.Module) -> int:
    """Replace the linears of every `dit.blocks[i]` in `DIT_BLOCK_LINEARS` (qkv_proj, gate_proj when VSA is on,
    out_proj, fc1, fc2) by `Fp8Linear`, one at a time on their own device; the block's forward then feeds them
    `Fp8Rows` from its fused producers. The token refiner, patch projections, time embedder, AdaLN projections and
    final layer stay as they are. Call after the weights are loaded (and FastH3-fused) and after `enable_vsa`.

    Returns:
        The number of linears replaced now: 4 (dense) or 5 (VSA) per block; 0 when called again (idempotent).

    Raises:
        ValueError: a linear still on the meta device (load first: the FastH3 fusion must see bf16 weights), or a
            dimension not a multiple of 16.
    """
    meta = [name for name, p in dit.blocks.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"quantize_dit_fp8_: blocks.{meta[0]} is on the meta device; load the weights first")
    return _replace_block_linears(dit)


@torch.no_grad()
def empty_dit_fp8_(dit: nn.Module) -> int:
    """On an EMPTY DiT (every block parameter on the meta device): replace the same linears as `quantize_dit_fp8_`
    by empty `Fp8Linear` modules (buffers `weight` [N, K] e4m3, `weight_scale` [1, N] fp32 on meta; `out_dtype` =
    the linear's dtype), which `checkpoint.load` fills with weights quantized while they stream, so the DiT's block
    linears never exist whole in bf16. Call after `enable_vsa` (a VSA student's gates must be there to be swapped).

    Returns:
        The number of linears replaced now: 4 (dense) or 5 (VSA) per block; 0 when called again.

    Raises:
        ValueError: a block parameter that is not on meta (a loaded DiT: use `quantize_dit_fp8_`), or a dimension
            not a multiple of 16.
    """
    loaded = [name for name, p in dit.blocks.named_parameters() if not p.is_meta]
    if loaded:
        raise ValueError(f"empty_dit_fp8_: blocks.{loaded[0]} is already loaded; quantize a loaded DiT with "
                         f"quantize_dit_fp8_")
    return _replace_block_linears(dit)


def _replace_block_linears(dit: nn.Module) -> int:
    """`DIT_BLOCK_LINEARS` of every block -> `Fp8Linear.from_linear` (quantized, or empty on meta), those in
    `DIT_FAST_ACCUM` with fast accumulation; the count."""
    count = 0
    for block in dit.blocks:
        for path in DIT_BLOCK_LINEARS:
            if _replace(block, path, Fp8Linear.from_linear):
                count += 1
                block.get_submodule(path).fast_accum = path in DIT_FAST_ACCUM
    return count


@torch.no_grad()
def quantize_text_encoder_fp8_(encoder: nn.Module) -> int:
    """Replace the decoder-layer linears of a `models.text_encoder.TextEncoder` (`TEXT_ENCODER_LINEARS` of every
    `encoder.layers[i]`) by `Fp8WeightLinear`, one at a time on their own device. Embeddings, norms, rotary tables
    and the vision tower (fl2va; its own 0.6 B parameters, loaded separately) stay as they are.

    On an empty (meta-parameter) encoder this builds the empty FP8 modules that `checkpoint.load` streams quantized
    weights into, so the bf16 encoder never exists on the device.

    Returns:
        The number of linears replaced now (7 per read layer); 0 when called again (idempotent).
    """
    count = 0
    for layer in encoder.layers:
        for path in TEXT_ENCODER_LINEARS:
            count += _replace(layer, path, Fp8WeightLinear.from_linear)
    return count


@torch.no_grad()
def quantize_video_decoder_fp8_(vae: nn.Module) -> int:
    """Replace the `VIDEO_DECODER_LINEARS` of every `vae.decoder.transformer_blocks[i]` (a loaded
    `models.video_vae.VideoVAE`, block linears in bf16) by `Fp8Linear`, one at a time on their own device; the
    output dtype stays the linear's (bf16), the blocks' fp32 residual stream and norms are untouched; each GEMM runs
    with fast accumulation (`Fp8Linear.fast_accum`: measured on decoded frames). Call after
    `apply_precision_` and `fuse_qkv_` (the Engine does both); the encoder, quant convs, proj_in and proj_out stay.

    Returns:
        The number of linears replaced now: 4 per block fused (5 unfused); 0 when called again (idempotent).

    Raises:
        ValueError: a dimension not a multiple of 16 (the released 2048 / 6144 / 8192 / 16384 and the built-in
            tiny and small sizes all are).
    """
    count = 0
    for block in vae.decoder.transformer_blocks:
        for path in VIDEO_DECODER_LINEARS:
            if _replace(block, path, Fp8Linear.from_linear):
                count += 1
                # measured on decoded frames: 8 % faster, PSNR vs bf16 unchanged (`Fp8Linear.fast_accum`)
                block.get_submodule(path).fast_accum = True
    return count


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", FP8: "fp8_e4m3"}


def _dtype_summary(module: nn.Module, skip: tuple[type, ...] = ()) -> str:
    """The float dtypes of `module`'s parameters by share of elements, e.g. "bf16 (fp32: 3% of parameters)"."""
    counts: Counter = Counter()
    for sub in module.modules():
        if isinstance(sub, skip):
            continue
        for p in sub.parameters(recurse=False):
            if p.is_floating_point():
                counts[p.dtype] += p.numel()
    if not counts:
        return "none"
    total = sum(counts.values())
    (main, _), *rest = counts.most_common()
    text = _DTYPE_NAMES.get(main, str(main))
    if rest:
        text += " (" + ", ".join(f"{_DTYPE_NAMES.get(d, str(d))}: {100 * n / total:.0f}% of parameters"
                                 for d, n in rest) + ")"
    return text


def precision_report(components: Any) -> dict[str, str]:
    """What each loaded component computes in, for the sidecar (`checkpoint.Components`; parts that are None are
    left out).

    Returns:
        e.g. {"dit_blocks": "fp8_e4m3 (row-wise activations, per-channel weights; 200 linears)",
        "dit_other": "bf16 (fp32: 0% of parameters)", "text_encoder": "fp8_e4m3 weights (per-channel scales,
        dequantized to bf16; 350 linears); other: bf16", "video_vae": "bf16 (fp32: ...)" or, with
        `quantize_video_decoder_fp8_`, "fp8_e4m3 decoder blocks (row-wise activations, per-channel weights;
        144 linears, fast accumulation in 144); other: fp32 (bf16: 3% of parameters)" (no ", fast accumulation"
        off CUDA), "audio_vae": "fp32"}.
    """
    report: dict[str, str] = {}
    dit = getattr(components, "dit", None)
    if dit is not None:
        n = sum(isinstance(m, Fp8Linear) for m in dit.blocks.modules())
        report["dit_blocks"] = (f"fp8_e4m3 (row-wise activations, per-channel weights; {n} linears)" if n
                                else _dtype_summary(dit.blocks))
        # fast accumulation is cuBLASLt's: only FP8 GEMMs on CUDA run it (the CPU computes the product in fp32)
        fast = {name: m for name, m in dit.blocks.named_modules()
                if isinstance(m, Fp8Linear) and m.fast_accum and m.weight.is_cuda}
        if fast:  # the paths that run it (a t2va DiT has no gate_proj)
            paths = [p for p in DIT_FAST_ACCUM if any(name.endswith("." + p) for name in fast)]
            report["dit_blocks"] += f"; fast accumulation in {len(fast)} of them ({', '.join(paths)})"
        if getattr(dit, "vsa_sparsity", None) is not None and getattr(dit, "vsa_qk_int8", False):
            report["dit_blocks"] += "; VSA QK^T int8 (smoothed keys, per-row scales)"
        other = nn.ModuleList(m for name, m in dit.named_children() if name != "blocks")
        report["dit_other"] = _dtype_summary(other)
    te = getattr(components, "text_encoder", None)
    if te is not None:
        fp8_linears = [m for m in te.modules() if isinstance(m, Fp8WeightLinear)]
        rest = _dtype_summary(te, skip=(Fp8WeightLinear,))
        if fp8_linears and Fp8WeightLinear.mode == "rows":
            # The sidecar must not say "dequantized" when the activations are rounded to e4m3 as well.
            rest = f"fp8_e4m3 weights x row-wise fp8_e4m3 activations (per-channel scales, one scaled GEMM; " \
                   f"{len(fp8_linears)} linears); other: {rest}"
        elif fp8_linears:
            to = _DTYPE_NAMES.get(fp8_linears[0].out_dtype, str(fp8_linears[0].out_dtype))
            rest = f"fp8_e4m3 weights (per-channel scales, dequantized to {to}; {len(fp8_linears)} linears); " \
                   f"other: {rest}"
        report["text_encoder"] = rest
    vae = getattr(components, "video_vae", None)
    if vae is not None:
        n = sum(isinstance(m, Fp8Linear) for m in vae.modules())
        rest = _dtype_summary(vae)  # Fp8Linear holds buffers, no parameters: the rest of the VAE
        fast = sum(isinstance(m, Fp8Linear) and m.fast_accum and m.weight.is_cuda for m in vae.modules())
        fast_text = f", fast accumulation in {fast}" if fast else ""
        report["video_vae"] = (f"fp8_e4m3 decoder blocks (row-wise activations, per-channel weights; {n} linears"
                               f"{fast_text}); other: {rest}" if n else rest)
    audio = getattr(components, "audio_vae", None)
    if audio is not None:
        report["audio_vae"] = _dtype_summary(audio)
    return report
