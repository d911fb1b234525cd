"""MiniMax-H3 video VAE: causal 3D-CNN encoder and non-causal ViT decoder, with the released tiled decode.

Parameter names equal diffusers 0.42.1 `AutoencoderKLMiniMaxH3` state-dict keys, so both the official `video_vae/`
and diffusers `vae/` folders load with `load_state_dict(strict=True)` after the loader's name mapping.

Conventions (released; diffusers `MiniMaxH3VideoDecodeStep` / `encode_vae_condition`):
* latents handed to `decode*` are normalized: the VAE sees `latent * latents_std + latents_mean`;
* pixels are RGB in [0, 1]; the network itself works in ImageNet-normalized space (mean 0.485/0.456/0.406,
  std 0.229/0.224/0.225), and decode clamps to [0, 1] after blending;
* `17n + 5` frames <-> `5n + 2` latent frames; 16x spatial compression, 24 latent channels.

Decode is split into independent work items (temporal window x spatial tile, see `vae_tiling.py`) that run through the
ViT decoder in batches and are blended exactly like the reference.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3render.kernels.fp8 import Fp8Rows
from h3render.kernels.qk_norm_rope import qk_norm_rope
from h3render.kernels.residual_norm_fp8 import residual_norm_fp8
from h3render.kernels.swiglu import swiglu
from h3render.kernels.utils import use_triton_for
from h3render.models.fp8 import Fp8Linear
from h3render.models.vae_blend import assemble_frames, stitch_tiles, stitch_window
from h3render.models.vae_tiling import (RELEASED_TILING, DecodeItem, DecodePlan, TilingConfig, even_batch, plan_decode,
                                        split_axis)
from h3render.models.video_vae_config import VideoVAEConfig
from h3render.models.video_vae_encoder import Encoder3d

# ImageNet statistics: the video VAE's pixel convention (diffusers `MiniMaxH3ModularPipeline.pixel_mean/pixel_std`).
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)


# The encoder (causal 3D CNN) lives in h3render/models/video_vae_encoder.py.


# ---------------------------------------------------------------------------------------------------------------
# Decoder: non-causal ViT
# ---------------------------------------------------------------------------------------------------------------


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention. q, k, v, out: [B, heads, S, head_dim], any float dtype.

    The one place the decoder calls attention; `VideoVAE.set_attention` swaps in a kernel with this signature.
    """
    return F.scaled_dot_product_attention(q, k, v)


def rope_angles(frames: int, height: int, width: int, extra: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE angles of a (frames, height, width) token grid followed by `extra` tokens at position 0.

    Each axis is length-normalized to [-1, 1) at cell centres and scaled by 2*pi (released decoder); the t, h, w
    angles are concatenated and then duplicated (rotate-half layout).

    Returns: [S, 2 * 3 * len(inv_freq)] float32, S = frames*height*width + extra.
    """
    device = inv_freq.device
    axes = [2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0 for n in (frames, height, width)]
    pos = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)  # [T*h*w, 3]
    pos = torch.cat([pos, pos.new_zeros(extra, 3)])  # [S, 3]
    angles = 2.0 * math.pi * pos[:, :, None] * inv_freq  # [S, 3, F]
    return angles.flatten(1).repeat(1, 2)  # [S, 6F]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R = cos.shape[-1] channels of x [..., D]; cos/sin broadcast to x[..., :R]."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return torch.cat([rot * cos + rotated * sin, keep], dim=-1)


def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, *,
                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's per-head RMSNorm (no weight) of q and k, then rotate-half RoPE on their first R channels.

    Args:
        q, k: [B, S, H, D] bf16/fp16/fp32, any strides over B, S, H, unit stride over D (the qkv projection's
            output viewed per head; released: H = 32, D = 64, S = N latent tokens + 5).
        cos, sin: [S, R] float32 (`rope_angles`; released R = 48), one table for the B items.
        eps: RMSNorm epsilon.
        use_triton: None = the fused kernel on CUDA tensors, the torch code below otherwise; True/False force one.

    Returns:
        (q, k): contiguous [B, S, H, D] in q's dtype.
    """
    if use_triton_for(q, use_triton):
        # One kernel (`kernels.qk_norm_rope`, a Triton op that the compiled blocks launch whole) for Inductor's ~5
        # kernels on the torch code: 5.7 ms of a ~100 ms decode batch on an H200 (docs/performance.md §27 profile).
        # Its fp32 math rounds once, closer to the fp32 truth than the bf16 steps below.
        q, k, _ = qk_norm_rope(q, k, None, None, None, cos, sin, eps, use_triton=True)
        return q, k
    dtype, dim = q.dtype, q.shape[-1]
    q = F.rms_norm(q.float(), (dim,), eps=eps).to(dtype)
    k = F.rms_norm(k.float(), (dim,), eps=eps).to(dtype)
    cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [S, 1, R]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class ViTAttention(nn.Module):
    """Self-attention with per-head RMS-normed q/k (in fp32) and 3-axis RoPE."""

    # Where q/k norm + RoPE runs (`norm_rope_qk`): None = the fused Triton kernel on CUDA, torch elsewhere (CPU
    # results stay those of the torch code); a class setting, so tests and benchmarks can force either.
    use_triton: bool | None = None

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        # ModuleList index 0 keeps the checkpoint name `to_out.0.*`.
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.attention_fn: Callable = sdpa_attention

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the block hands its linears (bf16 at release). An FP8 linear (`models.fp8.Fp8Linear`, stored
        e4m3) takes and writes its `out_dtype`."""
        out = self.to_out[0]
        return getattr(out, "out_dtype", out.weight.dtype)

    def fuse_qkv_(self) -> None:
        """Replace to_q / to_k / to_v by one `to_qkv` projection `[3 * inner, dim]`: one GEMM that reads x once and
        fills the GPU better than three (same products; load weights before fusing, state dicts keep the
        checkpoint names only until then)."""
        if hasattr(self, "to_qkv"):
            return
        parts = (self.to_q, self.to_k, self.to_v)
        fused = nn.Linear(parts[0].in_features, 3 * parts[0].out_features, device=parts[0].weight.device,
                          dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([m.weight for m in parts]))
            fused.bias.copy_(torch.cat([m.bias for m in parts]))
        self.to_qkv = fused.requires_grad_(parts[0].weight.requires_grad)
        del self.to_q, self.to_k, self.to_v

    def forward(self, x: "torch.Tensor | Fp8Rows", cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, S, dim] in the linears' dtype, or (FP8 q/k/v linears) its `Fp8Rows` [B*S, dim] from the block's
        fused norm1 (`ViTBlock.forward`); cos/sin: [S, R] float32. Returns [B, S, dim] in to_out's output dtype."""
        b, s = (x.data.shape[0] // cos.shape[0], cos.shape[0]) if isinstance(x, Fp8Rows) else x.shape[:2]
        shape = (b, s, self.heads, self.head_dim)
        if hasattr(self, "to_qkv"):
            q, k, v = self.to_qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)  # [B, S, H, D] views
        else:
            q, k, v = self.to_q(x).view(shape), self.to_k(x).view(shape), self.to_v(x).view(shape)  # [B, S, H, D]
        # Norm and rotate into the contiguous [B, S, H, D] layout; only the attention call sees [B, H, S, D] views.
        q, k = norm_rope_qk(q, k, cos, sin, self.eps, use_triton=self.use_triton)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, H, S, D]
        return self.to_out[0](out.transpose(1, 2).reshape(b, s, -1))


class SwiGLUIn(nn.Module):
    """Fused value/gate projection: first half is the value, second half the gate (diffusers `SwiGLU`)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, dim] -> value * silu(gate): [B, S, inner], in the projection's dtype."""
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.silu(gate)


class FeedForward(nn.Module):
    """SwiGLU FFN: fc1 `net[0].proj` [2 * inner, dim] (value rows, then gate rows), fc2 `net[2]` [dim, inner]."""

    # Whether FP8 linears take the fused SwiGLU kernel below; a class setting so that the benchmark measures the
    # unfused form beside it in one process (scripts/bench_e2e.py's session12 variant).
    fused_fp8 = True

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Indices 0 and 2 keep the checkpoint names `ff.net.0.proj.*` / `ff.net.2.*` (index 1 was a dropout).
        self.net = nn.ModuleList([SwiGLUIn(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: "torch.Tensor | Fp8Rows") -> torch.Tensor:
        """x: [B, S, dim] in the linears' dtype -> [B, S, dim] in fc2's output dtype; or (FP8 linears) `Fp8Rows`
        [B*S, dim] from the block's fused norm2 (`ViTBlock.forward`) -> [B*S, dim]."""
        fc1, fc2 = self.net[0].proj, self.net[2]
        if not (self.fused_fp8 and isinstance(fc1, Fp8Linear) and isinstance(fc2, Fp8Linear)):
            return fc2(self.net[0](x))
        # FP8 (`models.fp8.quantize_video_decoder_fp8_`): fc1's GEMM without its bias, then one kernel adds the bias
        # in fp32, takes value * silu(gate) and writes fc2's e4m3 rows and scales (docs/performance.md §23).
        flat = isinstance(x, Fp8Rows)
        h = fc1(x if flat else x.reshape(-1, x.shape[-1]), with_bias=False)  # [B*S, 2 * inner] bf16
        rows = swiglu(h, fp8=True, value_first=True, bias=fc1.bias)  # Fp8Rows: [B*S, inner] e4m3, [B*S, 1] fp32
        out = fc2(rows)  # [B*S, dim]
        return out if flat else out.view(*x.shape[:-1], -1)  # [B, S, dim]


def _eps(norm: nn.RMSNorm) -> float:
    """The epsilon `nn.RMSNorm` applies (its `eps`, or float32's machine epsilon when None)."""
    return torch.finfo(torch.float32).eps if norm.eps is None else norm.eps


class ViTBlock(nn.Module):
    """Pre-norm block with learned residual gains; residual stream and norms fp32, linears in any dtype.

    FP8 blocks (`models.fp8.quantize_video_decoder_fp8_`; `fuses_norm_fp8`) fuse each residual add with the RMSNorm,
    bf16 rounding and e4m3 row quantization that follow it (`kernels.residual_norm_fp8`): `x + attn * scale1` ->
    norm2 -> fc1 here, and `x + ff * scale2` -> the next block's norm1 -> its q/k/v, whose rows this block hands on
    (`ViTDecoder3d.forward`). Same values as the unfused form, up to the rounding ties `kernels.residual_norm_fp8`
    describes (bit-equal on the CPU, where both run the torch reference).
    """

    # Whether FP8 blocks take the fused residual + norm + e4m3 kernel; a class setting so that a benchmark measures
    # the unfused form beside it in one process (as `FeedForward.fused_fp8`).
    fused_norm_fp8 = True

    def __init__(self, dim: int, heads: int, head_dim: int, ffn_mult: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=eps)
        self.attn = ViTAttention(dim, heads, head_dim, eps)
        self.scale1 = nn.Parameter(torch.zeros(dim))
        self.norm2 = nn.RMSNorm(dim, eps=eps)
        self.ff = FeedForward(dim, ffn_mult)
        self.scale2 = nn.Parameter(torch.zeros(dim))

    @property
    def fuses_norm_fp8(self) -> bool:
        """Whether forward runs the fused residual + norm + e4m3 kernels: `fused_norm_fp8` is on, q/k/v and fc1 are
        `Fp8Linear`s with bf16 outputs (the kernel rounds the normed rows to bf16, as the block does for them) and
        the norm weights and gains are the release's fp32 (`VideoVAE.apply_precision_`)."""
        attn = self.attn
        qkv = (attn.to_qkv,) if hasattr(attn, "to_qkv") else (attn.to_q, attn.to_k, attn.to_v)
        fp32 = (self.norm1.weight, self.norm2.weight, self.scale1, self.scale2)
        return (self.fused_norm_fp8 and attn.dtype == torch.bfloat16
                and all(p is not None and p.dtype == torch.float32 for p in fp32)
                and all(isinstance(m, Fp8Linear) for m in (*qkv, self.ff.net[0].proj)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Fp8Rows | None = None,
                next_weight: torch.Tensor | None = None, next_eps: float | None = None
                ) -> "torch.Tensor | tuple[torch.Tensor, Fp8Rows]":
        """
        Args:
            x: [B, S, dim] float32 residual stream; cos, sin: [S, R] float32 RoPE tables.
            rows: (`fuses_norm_fp8` blocks only) `Fp8Rows` [B*S, dim] of norm1(x) rounded to bf16, handed on by the
                previous block; None: computed here.
            next_weight, next_eps: (`fuses_norm_fp8` blocks only) the next block's norm1 weight [dim] fp32 and
                epsilon: the rows of its input are returned too, written by this block's last residual add.

        Returns:
            x [B, S, dim] float32; with next_weight, (x, `Fp8Rows` [B*S, dim] e4m3 + [B*S, 1] fp32 scales).
        """
        if not self.fuses_norm_fp8:
            if rows is not None or next_weight is not None:
                raise ValueError("ViTBlock: rows / next_weight are for FP8 blocks with the fused norm (fuses_norm_fp8)")
            dtype = self.attn.dtype
            x = x + self.attn(self.norm1(x).to(dtype), cos, sin) * self.scale1
            return x + self.ff(self.norm2(x).to(dtype)) * self.scale2
        # One pass per residual add instead of Inductor's two or three over the fp32 residual (docs/performance.md
        # §27 profile): add, RMSNorm, bf16 rounding and the next FP8 linear's e4m3 rows in one kernel.
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [B*S, dim]
        if rows is None:  # the first block: norm1 of the decoder's input, no residual add before it
            rows = residual_norm_fp8(x, None, None, self.norm1.weight, _eps(self.norm1))[1]
        attn = self.attn(rows, cos, sin).view(x.shape)  # [B*S, dim] bf16
        x, rows = residual_norm_fp8(x, attn, self.scale1, self.norm2.weight, _eps(self.norm2))
        ff = self.ff(rows)  # [B*S, dim] bf16
        if next_weight is None:  # the last block: its output feeds norm_out (a LayerNorm, unfused)
            return (x + ff * self.scale2).view(shape)
        x, rows = residual_norm_fp8(x, ff, self.scale2, next_weight, next_eps)
        return x.view(shape), rows


class ViTDecoder3d(nn.Module):
    """Latent [B, C, T, h, w] -> pixels [B, 3, T*pt, h*p, w*p] (ImageNet-normalized).

    Every latent voxel is one token; `num_register_tokens` learned tokens and one all-zero token (all at position
    0) join the attention and are dropped before the patch projection.
    """

    def __init__(self, cfg: VideoVAEConfig) -> None:
        super().__init__()
        dim = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim
        rope_dim = int(cfg.decoder_attention_head_dim * cfg.decoder_rope_dim_ratio)
        if rope_dim % 6:
            raise ValueError(f"video VAE config: RoPE width {rope_dim} must be divisible by 6 (3 axes x cos/sin)")
        self.patch, self.patch_t, self.out_channels = cfg.spatial_ratio, cfg.temporal_ratio, cfg.out_channels
        self.num_register_tokens = cfg.decoder_num_register_tokens
        # Released: theta 100, 8 frequencies per axis over 48 of 64 head channels.
        exponents = torch.arange(0, 1, 6 / rope_dim, dtype=torch.float32)
        self.register_buffer("inv_freq", 1.0 / cfg.decoder_rope_theta**exponents, persistent=False)
        self.proj_in = nn.Linear(cfg.latent_channels, dim)
        self.register_tokens = nn.Parameter(torch.zeros(1, cfg.decoder_num_register_tokens, dim))
        self.transformer_blocks = nn.ModuleList(
            ViTBlock(dim, cfg.decoder_num_attention_heads, cfg.decoder_attention_head_dim, cfg.decoder_ffn_mult,
                     cfg.decoder_norm_eps)
            for _ in range(cfg.decoder_num_layers)
        )
        self.norm_out = nn.LayerNorm(dim, eps=cfg.decoder_norm_eps)
        self.proj_out = nn.Linear(dim, cfg.out_channels * self.patch_t * self.patch**2)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = z.shape
        n = t * h * w
        x = self.proj_in(z.permute(0, 2, 3, 4, 1).reshape(b, n, c).to(self.proj_in.weight.dtype)).float()  # [B, N, dim]
        registers = self.register_tokens.float().expand(b, -1, -1)
        x = torch.cat([x, registers, x.new_zeros(b, 1, x.shape[-1])], dim=1)  # [B, N + R + 1, dim] fp32 residual
        angles = rope_angles(t, h, w, self.num_register_tokens + 1, self.inv_freq)
        cos, sin = angles.cos(), angles.sin()
        blocks = self.transformer_blocks
        rows = None  # FP8 blocks with the fused norm: the next block's q/k/v input, written by the block before it
        for i, block in enumerate(blocks):
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            if after is not None and block.fuses_norm_fp8 and after.fuses_norm_fp8:
                x, rows = block(x, cos, sin, rows, after.norm1.weight, _eps(after.norm1))
            else:  # the last block (norm_out follows) and every unfused one
                x, rows = block(x, cos, sin, rows), None
        x = self.norm_out(x[:, :n]).to(self.proj_out.weight.dtype)
        x = self.proj_out(x).float()  # [B, N, 3*pt*p*p]
        p, pt = self.patch, self.patch_t
        x = x.view(b, t, h, w, self.out_channels, pt, p, p)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # [B, 3, t, pt, h, p, w, p]
        return x.reshape(b, self.out_channels, t * pt, h * p, w * p)


# ---------------------------------------------------------------------------------------------------------------
# The VAE
# ---------------------------------------------------------------------------------------------------------------


# Compiled decoder shapes (tile shape x batch size) a process may hold before Dynamo falls back to eager: 8 batch
# sizes for each of 8 tile shapes (a canvas side under 256 px is a tile shape of its own).
COMPILED_SHAPES = 64


class VideoVAE(nn.Module):
    """MiniMax-H3 video VAE with the released windowed + tiled decode, batched.

    Args:
        config: architecture (`VideoVAEConfig`).
        tiling: spatial tiles for encode and decode (released: 256 px, >= 64 px overlap).
    """

    def __init__(self, config: VideoVAEConfig = VideoVAEConfig(), tiling: TilingConfig = RELEASED_TILING) -> None:
        super().__init__()
        self.config = config
        self.tiling = tiling
        c = config.latent_channels
        self.encoder = Encoder3d(config)
        self.quant_conv = nn.Conv3d(2 * c, 2 * c, 1)
        self.post_quant_conv = nn.Conv3d(c, c, 1)
        self.decoder = ViTDecoder3d(config)
        self.register_buffer("latents_mean", torch.tensor(config.latents_mean).view(c, 1, 1, 1), persistent=False)
        self.register_buffer("latents_std", torch.tensor(config.latents_std).view(c, 1, 1, 1), persistent=False)
        self.register_buffer("pixel_mean", torch.tensor(PIXEL_MEAN).view(3, 1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(PIXEL_STD).view(3, 1, 1, 1), persistent=False)

    # -- precision, kernels -------------------------------------------------------------------------------------

    def apply_precision_(self, dtype: torch.dtype) -> "VideoVAE":
        """Cast the decoder's matmul weights (block linears, proj_out) to `dtype`; keep the rest fp32.

        Released precision split (diffusers `_keep_in_fp32_modules`): encoder, quant convs, norms and the residual
        gains scale1/scale2 stay fp32, and the decoder residual stream is fp32; block linears may run in bf16/fp16.
        proj_in and the register tokens also stay fp32 (negligible cost, first-layer precision).
        """
        self.float()
        for block in self.decoder.transformer_blocks:
            attn = block.attn
            projections = (attn.to_qkv,) if hasattr(attn, "to_qkv") else (attn.to_q, attn.to_k, attn.to_v)
            for lin in (*projections, attn.to_out[0], block.ff.net[0].proj, block.ff.net[2]):
                lin.to(dtype)
        self.decoder.proj_out.to(dtype)
        return self

    def compile_blocks_(self, **compile_kwargs) -> "VideoVAE":
        """`torch.compile` every decoder block in place (fuses the fp32 norms, RoPE and residual element-wise work).

        Opt-in GPU fast path, for bf16 blocks (`compile_pays`). Measured (1x H200, release size, bf16 block linears,
        72 latent frames at 1344x768): eager 11.0 s, compiled 7.2 s (diffusers all-bf16: 15.2 s) when first built;
        8.47 s against 7.14 s with today's kernels (docs/performance.md §35.3); the first window pays 5-9 s of
        compilation with Inductor's cache cold.
        bf16 results differ from eager by rounding only (rel. 2e-3). Peak memory 14-19 GB, weights included.
        """
        import torch._dynamo

        for block in self.decoder.transformer_blocks:
            block.compile(**compile_kwargs)
        # Compiled blocks specialize on the batch size: pad short batches so a decode never recompiles mid-job.
        self.pad_batches = True
        # Every block shares one Dynamo cache with an entry per (tile shape, batch size) (`batch_for`: up to
        # `vae_batch` sizes a shape); past the limit (8) Dynamo runs the blocks eagerly, silently.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES)
        return self

    @property
    def compile_pays(self) -> bool:
        """Whether `compile_blocks_` makes the decode faster: not when every block runs the fused FP8 kernels
        (`ViTBlock.fuses_norm_fp8`: `--precision fp8`), which leave Inductor nothing to fuse. Measured (1x H200,
        random weights, median of 3, one machine start): FP8 blocks eager 4.679 s against compiled 4.767 s for 72
        latents at 1344x768, 1.256 against 1.274 s for 37 at 960x544, without the compile's 1.7-2.1 s in every new
        process's prepare (5-9 s with Inductor's cache cold); bf16 blocks eager 8.47 s against compiled 7.14 s
        (docs/performance.md §35.3)."""
        return not all(block.fuses_norm_fp8 for block in self.decoder.transformer_blocks)

    def fuse_qkv_(self) -> "VideoVAE":
        """Fuse every decoder block's q/k/v projections into one GEMM (`ViTAttention.fuse_qkv_`); after loading."""
        for block in self.decoder.transformer_blocks:
            block.attn.fuse_qkv_()
        return self

    def batch_for(self, num_items: int, batch_size: int) -> int:
        """Items per forward for a decode of `num_items` at most `batch_size` at a time: compiled blocks pad a short
        batch, so they get `vae_tiling.even_batch`'s size (the fewest padded slots); eager ones run `batch_size`."""
        return even_batch(num_items, batch_size) if getattr(self, "pad_batches", False) else batch_size

    def attention_shape(self, plan: DecodePlan, batch_size: int) -> tuple[int, int, int, int]:
        """`[B, S, H, D]` of the decoder's attention for one batch of `plan`'s items (tokens: latent voxels of a
        tile, the register tokens and the zero token)."""
        it = plan.items[0]
        tokens = ((it.latent_t[1] - it.latent_t[0]) * (it.latent_y[1] - it.latent_y[0])
                  * (it.latent_x[1] - it.latent_x[0]) + self.decoder.num_register_tokens + 1)
        return (batch_size, tokens, self.config.decoder_num_attention_heads, self.config.decoder_attention_head_dim)

    def set_attention(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Use `fn(q, k, v) -> out` (all [B, heads, S, head_dim]) for every decoder attention."""
        for block in self.decoder.transformer_blocks:
            block.attn.attention_fn = fn

    # -- decode ------------------------------------------------------------------------------------------------

    def plan_decode(self, latent_frames: int, latent_h: int, latent_w: int) -> DecodePlan:
        """Work items (temporal window x spatial tile) and pixel regions for a [C, T, h, w] latent.

        Raises:
            ValueError: too few latent frames for one window, or a tile/overlap pair that cannot tile.
        """
        return plan_decode(latent_frames, latent_h, latent_w, geometry=self.config.geometry,
                           spatial_ratio=self.config.spatial_ratio, tiling=self.tiling)

    def _check_latent(self, latent: torch.Tensor) -> None:
        c = self.config.latent_channels
        if latent.ndim != 4 or latent.shape[0] != c:
            raise ValueError(f"video latent must be [{c}, T, h, w], got {tuple(latent.shape)}")

    @torch.no_grad()
    def decode_items(
        self, latent: torch.Tensor, items: Sequence[DecodeItem], batch_size: int = 8
    ) -> list[torch.Tensor]:
        """Decode work items through the ViT decoder, `batch_size` at a time.

        Args:
            latent: [24, T, h, w] normalized video latent (any float dtype), on the decoder's device.
            items: items of `plan_decode(T, h, w)`, any order and any subset (all share one tile shape).
            batch_size: items per decoder forward.

        Returns:
            One [3, frames_per_item, tile_h_px, tile_w_px] float32 tensor per item, in `items` order: the window's
            clip frames then its tail frames, ImageNet-normalized (not yet blended, not clamped).
        """
        self._check_latent(latent)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        last = latent.shape[1] - 1
        head, tail = self.config.geometry.kept_frames()
        outputs: list[torch.Tensor] = []
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            clips = []
            for it in batch:
                # Window latents past the end repeat the last latent frame (the reference's padding).
                t_index = torch.arange(*it.latent_t, device=latent.device).clamp_(max=last)
                clip = latent[:, t_index, it.latent_y[0] : it.latent_y[1], it.latent_x[0] : it.latent_x[1]]
                clips.append(clip.float() * self.latents_std + self.latents_mean)
            real = len(clips)
            if getattr(self, "pad_batches", False):
                clips += clips[-1:] * (batch_size - real)
            z = self.post_quant_conv(torch.stack(clips))  # [B, 24, window_latents, th, tw]
            pixels = self.decoder(z)  # [B, 3, window_latents * 4, th*16, tw*16]
            outputs.extend(torch.cat([pixels[:real, :, head], pixels[:real, :, tail]], dim=2).unbind(0))
        return outputs

    def to_rgb(self, frames: torch.Tensor) -> torch.Tensor:
        """Blended decoder output [3, n, H, W] (ImageNet-normalized) -> RGB in [0, 1], float32.

        Apply only after blending: the reference blends unclamped values, and clamping does not commute with it.
        """
        return (frames * self.pixel_std + self.pixel_mean).clamp_(0, 1)

    _to_rgb = to_rgb  # name used by h3render/parallel/vae.py

    def blend(self, plan: DecodePlan, item_outputs: Sequence[torch.Tensor] | dict[int, torch.Tensor]) -> torch.Tensor:
        """Blend item outputs into the video. `item_outputs[i]` belongs to `plan.items[i]` (list or dict by index).

        Returns: [3, plan.num_frames, H, W] float32 RGB in [0, 1].
        """
        outputs = item_outputs if isinstance(item_outputs, dict) else dict(enumerate(item_outputs))
        if len(outputs) != len(plan.items):
            raise ValueError(f"blend: got {len(outputs)} item outputs, the plan has {len(plan.items)} items")
        windows = (stitch_window(plan, outputs, w) for w in range(plan.num_windows))
        parts = [self.to_rgb(frames) for _, frames in assemble_frames(plan, windows)]
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def decode_stream(self, latent: torch.Tensor, *, batch_size: int = 8) -> Iterator[tuple[int, torch.Tensor]]:
        """Decode and yield `(first_frame, frames [3, n, H, W] float32 in [0, 1])` in order, as soon as final.

        Items run in plan order (window-major) in batches that may span windows; only the raw tiles of windows not
        yet stitched are held, so peak memory is bounded by `batch_size + tiles_per_window` tiles plus one window.
        """
        self._check_latent(latent)
        plan = self.plan_decode(*latent.shape[1:])
        yield from ((first, self.to_rgb(frames)) for first, frames in
                    assemble_frames(plan, self._stitched_windows(latent, plan, batch_size)))

    def _stitched_windows(self, latent: torch.Tensor, plan: DecodePlan, batch_size: int) -> Iterator[torch.Tensor]:
        pending: dict[int, torch.Tensor] = {}
        next_window = 0
        per_window = plan.tiles_per_window
        batch_size = self.batch_for(len(plan.items), batch_size)
        for start in range(0, len(plan.items), batch_size):
            batch = plan.items[start : start + batch_size]
            for item, out in zip(batch, self.decode_items(latent, batch, batch_size)):
                pending[item.index] = out
            while next_window < plan.num_windows and (next_window + 1) * per_window <= start + len(batch):
                yield stitch_window(plan, pending, next_window)
                for item in plan.window_items(next_window):
                    del pending[item.index]
                next_window += 1

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, *, batch_size: int = 8) -> torch.Tensor:
        """Released decode of a normalized latent [24, T, h, w] -> video [3, F, 16h, 16w] float32 RGB in [0, 1].

        F = 17n + 5 for T = 5n + 2 (other T: the frame count diffusers returns). Equal to plan + decode_items +
        blend; runs window by window so raw tiles of finished windows are freed.
        """
        self._check_latent(latent)
        plan = self.plan_decode(*latent.shape[1:])
        video = torch.empty(3, plan.num_frames, plan.height, plan.width, device=latent.device)
        for first, frames in self.decode_stream(latent, batch_size=batch_size):
            video[:, first : first + frames.shape[1]] = frames
        return video

    # -- encode ------------------------------------------------------------------------------------------------

    def _encode_clip(self, x: torch.Tensor) -> torch.Tensor:
        """x: [1, 3, t, H, W] ImageNet-normalized -> moments [1, 48, t', H/16, W/16], spatially tiled."""
        r = self.config.spatial_ratio
        rows = split_axis(x.shape[-2], self.tiling.tile_height, self.tiling.overlap_height, r, name="tile height")
        cols = split_axis(x.shape[-1], self.tiling.tile_width, self.tiling.overlap_width, r, name="tile width")
        grid = [[self.quant_conv(self.encoder(x[..., y : y + rows.size, xx : xx + cols.size]))
                 for xx in cols.starts] for y in rows.starts]
        return stitch_tiles(grid, [o // r for o in rows.overlaps], [o // r for o in cols.overlaps])

    @torch.no_grad()
    def encode_moments(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior of a clip: video [3, F, H, W] RGB in [0, 1] (H, W multiples of 16) -> (mean, logvar).

        F = 1 encodes one image to 1 latent frame. Otherwise frames are padded to whole 17-frame clips by
        repeating the last frame, each clip is encoded (5 latents), and the last `token_drop` (3) latents are
        dropped: 17n + 5 frames -> 5n + 2 latents. Returns un-normalized [24, T, h, w] float32 each; logvar is
        clamped to [-30, 20] as in the reference posterior.
        """
        if video.ndim != 4 or video.shape[0] != self.config.in_channels:
            raise ValueError(f"video must be [3, F, H, W], got {tuple(video.shape)}")
        x = ((video.float() - self.pixel_mean) / self.pixel_std)[None]  # [1, 3, F, H, W]
        clip = self.config.clip_length
        if x.shape[2] == 1:
            moments = self._encode_clip(x)
        else:
            pad = (-x.shape[2]) % clip
            if pad:
                x = torch.cat([x, x[:, :, -1:].expand(-1, -1, pad, -1, -1)], dim=2)
            moments = torch.cat([self._encode_clip(x[:, :, i : i + clip]) for i in range(0, x.shape[2], clip)], dim=2)
            if self.config.token_drop:
                moments = moments[:, :, : -self.config.token_drop]
        mean, logvar = moments[0].chunk(2, dim=0)
        return mean, logvar.clamp(-30.0, 20.0)

    @torch.no_grad()
    def encode_condition(self, video: torch.Tensor, *, seed: int = 42) -> torch.Tensor:
        """The released keyframe/reference encode: normalized latent [24, T, h, w] float32 on the input's device.

        Recipe (diffusers `encode_vae_condition`): the posterior is *sampled* with a fresh CPU generator seeded with
        `seed` (released `keyframe_encode_seed` 42), the sample is rounded through float16, then normalized with
        latents_mean/std. `video` is `[3, F, H, W]` uint8 pixels (divided by 255 here in float32, as the reference
        does) or float32 already divided by 255; F = 1 for a keyframe (one latent frame, tiled spatial encoder only).
        """
        if video.dtype == torch.uint8:
            video = video.to(torch.float32).div(255.0)
        mean, logvar = self.encode_moments(video)
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn((1, *mean.shape), generator=generator, dtype=mean.dtype)[0].to(mean.device)
        sample = (mean + torch.exp(0.5 * logvar) * noise).half().float()
        return (sample - self.latents_mean) / self.latents_std
