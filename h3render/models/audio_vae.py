"""MiniMax-H3 audio VAE: DAC-style encoder, causal-attention latent projection, BigVGAN decoder; mono 32 kHz.

Parameter and buffer names equal diffusers 0.42.1 `AutoencoderKLMiniMaxH3Audio` state-dict keys (weight-normed
convolutions as `weight_g` / `weight_v`, Kaiser resampling `filter` buffers, the `zero_k_bias` buffer), so a
diffusers or official `audio_vae/` folder loads with `load_state_dict(strict=True)`.

Stereo is a batch of 2 through the mono model. Hop 800 samples at 32 kHz = 40 latents/s (released config:
`encoder_rates` (2, 4, 4, 5, 5), `decoder_rates` (5, 5, 2, 2, 2, 2, 2), `sampling_rate` 32000). Keep it in fp32: the
DAC/BigVGAN stack decodes roughly 20 dB quieter in bf16 (diffusers `_keep_in_fp32_modules` note).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import h3render.kernels.alias_free as alias_free
from h3render.models.audio_vae_config import AudioVAEConfig


def _eager_inference() -> bool:
    """True for eager no-grad calls: the in-place / cached fast forms run. With grad enabled (autograd needs the
    intermediates) or while torch.compile traces (Inductor fuses the functional form itself) the reference forms
    run; both give the same values bit for bit."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class _Derived(nn.Module):
    """A module that keeps tensors derived from its own parameters or buffers between no-grad calls.

    Inference re-derives the same small tensors on every call otherwise (weight norm, exp'd Snake parameters,
    expanded filters): ~4 extra kernels per convolution or activation, ~900 per released decode. An entry is rebuilt
    when one of its sources is replaced, changed in place (its version counter moves, as `load_state_dict`'s `copy_`
    does) or moved (its storage address changes, as `.to(device)` does); outside eager no-grad calls nothing is
    cached. The cached tensor is computed by the same ops as the uncached one (bitwise equal). A CUDA graph captured
    over a decode reads the cached tensors by address: capture again after changing weights (`ShapeGraphs.reset`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._derived_cache: dict[str, tuple] = {}

    def derived(self, name: str, sources: tuple[torch.Tensor, ...], compute, extra=None):
        if not _eager_inference() or any(t.is_inference() for t in sources):  # inference tensors keep no version
            return compute()
        state = tuple((t._version, t.data_ptr(), t.device) for t in sources)
        entry = self._derived_cache.get(name)
        if (entry is None or entry[2] != extra or len(entry[0]) != len(sources)
                or any(a is not b for a, b in zip(entry[0], sources)) or entry[1] != state):
            entry = (sources, state, extra, compute())
            self._derived_cache[name] = entry
        return entry[3]


class WNConv1d(_Derived):
    """Weight-normalized Conv1d / ConvTranspose1d, stored as `weight_g` [out, 1, 1] and `weight_v` (dim 0).

    The effective weight `g * v / ||v||` (norm over all but dim 0) is what torch's `weight_norm` hook computes each
    call; the state-dict names match checkpoints written with that hook. Under no_grad it is computed once and
    kept until `weight_v` / `weight_g` change (`_Derived`).
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 dilation: int = 1, bias: bool = True, transposed: bool = False) -> None:
        super().__init__()
        shape = (in_ch, out_ch, kernel_size) if transposed else (out_ch, in_ch, kernel_size)
        self.weight_g = nn.Parameter(torch.ones(shape[0], 1, 1))
        self.weight_v = nn.Parameter(torch.randn(shape) / math.sqrt(in_ch * kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_ch)) if bias else None
        self.stride, self.padding, self.dilation, self.transposed = stride, padding, dilation, transposed

    def _weight(self) -> torch.Tensor:
        v = self.weight_v
        return v * (self.weight_g / v.norm(dim=(1, 2), keepdim=True))

    def weight(self) -> torch.Tensor:
        return self.derived("weight", (self.weight_v, self.weight_g), self._weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_ch, L] -> [B, out_ch, L']."""
        if self.transposed:
            return F.conv_transpose1d(x, self.weight(), self.bias, self.stride, self.padding)
        return F.conv1d(x, self.weight(), self.bias, self.stride, self.padding, self.dilation)


def kaiser_sinc_filter(cutoff: float, half_width: float, kernel_size: int) -> torch.Tensor:
    """Kaiser-windowed sinc low-pass [1, 1, kernel_size], normalized to sum 1 (alias-free-torch's design).

    Only the initial value of a stored buffer: checkpoints carry the filter itself.
    """
    half = kernel_size // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(kernel_size, beta=beta, periodic=False)
    t = torch.arange(-half, half) + 0.5 if kernel_size % 2 == 0 else torch.arange(kernel_size) - half
    taps = 2 * cutoff * window * torch.sinc(2 * cutoff * t)
    return (taps / taps.sum()).view(1, 1, kernel_size)


class Snake(nn.Module):
    """DAC activation x + sin^2(alpha x) / (alpha + 1e-9), alpha [1, C, 1]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class SnakeBeta(_Derived):
    """BigVGAN activation x + sin^2(e^alpha x) / (e^beta + 1e-9); alpha, beta [C] in log space."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def _coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        return alpha, (beta + 1e-9).reciprocal()  # each [1, C, 1]

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, C, L] -> [B, C, L]; `out` (no-grad only) receives the result, e.g. a view into a padded buffer."""
        alpha, inv_beta = self.derived("coefficients", (self.alpha, self.beta), self._coefficients)
        if not _eager_inference():
            return x + inv_beta * torch.sin(alpha * x).pow(2)
        # Same ops in the same order, in place: one buffer instead of five (bitwise equal to the line above).
        y = torch.mul(x, alpha, out=out)
        return y.sin_().square_().mul_(inv_beta).add_(x)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class UpSample1d(_Derived):
    """Anti-aliased x`ratio` upsampler: replicate-pad, depthwise transposed Kaiser-sinc conv, crop."""

    def __init__(self, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        self.ratio = ratio
        self.pad = kernel_size // ratio - 1
        self.crop_left = self.pad * ratio + (kernel_size - ratio) // 2
        self.crop_right = self.pad * ratio + (kernel_size - ratio + 1) // 2
        self.register_buffer("filter", kaiser_sinc_filter(0.5 / ratio, 0.6 / ratio, kernel_size))
        # ratio * conv(x, f) == conv(x, ratio * f) bit for bit when ratio is a power of two (every product and
        # partial sum is scaled exactly): the gain then rides in the filter, saving a pass over the output.
        self._gain_in_filter = _power_of_two(ratio)

    def _depthwise_filter(self, channels: int) -> torch.Tensor:
        f = self.ratio * self.filter if self._gain_in_filter else self.filter
        return f.expand(channels, -1, -1).contiguous()  # [C, 1, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = x.shape[1]
        weight = self.derived("filter", (self.filter,), lambda: self._depthwise_filter(c), extra=c)
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = F.conv_transpose1d(x, weight, stride=self.ratio, groups=c)
        if not self._gain_in_filter:
            x = self.ratio * x
        return x[..., self.crop_left : -self.crop_right]  # [B, C, L * ratio]


class LowPassFilter1d(_Derived):
    """Depthwise Kaiser-sinc low-pass with stride (the anti-aliased downsampler)."""

    def __init__(self, cutoff: float, half_width: float, stride: int, kernel_size: int) -> None:
        super().__init__()
        self.pad_left = kernel_size // 2 - int(kernel_size % 2 == 0)
        self.pad_right = kernel_size // 2
        self.stride = stride
        self.register_buffer("filter", kaiser_sinc_filter(cutoff, half_width, kernel_size))

    def filter_padded(self, x: torch.Tensor) -> torch.Tensor:
        """x already replicate-padded by (pad_left, pad_right): [B, C, L + pads] -> [B, C, L / stride]."""
        c = x.shape[1]
        weight = self.derived("filter", (self.filter,), lambda: self.filter.expand(c, -1, -1).contiguous(), extra=c)
        return F.conv1d(x, weight, stride=self.stride, groups=c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.filter_padded(F.pad(x, (self.pad_left, self.pad_right), mode="replicate"))


class DownSample1d(nn.Module):
    def __init__(self, ratio: int = 2, kernel_size: int = 12) -> None:
        super().__init__()
        self.lowpass = LowPassFilter1d(0.5 / ratio, 0.6 / ratio, ratio, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class AliasFreeActivation(nn.Module):
    """Upsample x2 -> SnakeBeta -> downsample x2 (BigVGAN `Activation1d`).

    `fused`: None (default) runs the two-kernel Triton path of `kernels.alias_free` for eager no-grad calls on CUDA;
    True also on other devices (CPU tensors need TRITON_INTERPRET=1: tests); False never. The torch forms below stay
    the reference (used with grad, under torch.compile, and on CPU).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample1d()
        self.downsample = DownSample1d()
        self.fused: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C, L] -> [B, C, L]."""
        if _eager_inference() and (x.is_cuda if self.fused is None else self.fused):
            alpha, inv_beta = self.act.derived("coefficients", (self.act.alpha, self.act.beta),
                                               self.act._coefficients)  # each [1, C, 1]
            return alias_free.alias_free_activation(x.float(), self.upsample.filter.view(-1), alpha.view(-1),
                                                    inv_beta.view(-1), self.downsample.lowpass.filter.view(-1),
                                                    use_triton=True)
        u = self.upsample(x)  # [B, C, 2L]
        if not _eager_inference():
            return self.downsample(self.act(u))
        # Inference: SnakeBeta writes straight into the low-pass filter's replicate-padded input, so the padding
        # costs two edge copies instead of a pass over the whole upsampled signal (same values, bitwise).
        lowpass = self.downsample.lowpass
        b, c, n = u.shape
        left, right = lowpass.pad_left, lowpass.pad_right
        padded = u.new_empty(b, c, left + n + right)
        body = self.act(u, out=padded[..., left : left + n])
        padded[..., :left] = body[..., :1]
        padded[..., left + n :] = body[..., -1:]
        return lowpass.filter_padded(padded)  # [B, C, L]


# ---------------------------------------------------------------------------------------------------------------
# Encoder (DAC) and latent projection
# ---------------------------------------------------------------------------------------------------------------


class ResidualUnit(nn.Module):
    """Snake -> dilated conv k7 -> Snake -> conv k1, plus identity (same length: padding 3 * dilation)."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake(dim),
            WNConv1d(dim, dim, 7, dilation=dilation, padding=3 * dilation),
            Snake(dim),
            WNConv1d(dim, dim, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class EncoderBlock(nn.Module):
    """Residual units at dilations 1, 3, 9, then a strided conv doubling channels: [B, dim/2, L] -> [B, dim, L/s]."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        half = dim // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1), ResidualUnit(half, 3), ResidualUnit(half, 9), Snake(half),
            WNConv1d(half, dim, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    """Waveform [B, 1, samples] -> [B, latent_dim, samples / hop]."""

    def __init__(self, d_model: int, strides: tuple[int, ...], d_latent: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [WNConv1d(1, d_model, 7, padding=3)]
        for stride in strides:
            d_model *= 2
            layers.append(EncoderBlock(d_model, stride))
        layers += [Snake(d_model), WNConv1d(d_model, d_latent, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class CausalAttention(nn.Module):
    """Causal self-attention narrowing `in_dim` to `out_dim`: heads are mean-pooled, head dim avg-pooled to out_dim.

    One bias-less qkv linear; q and v biases are parameters, the k bias a zero buffer (as stored in the checkpoint).
    """

    def __init__(self, in_dim: int, out_dim: int, num_heads: int) -> None:
        super().__init__()
        self.out_dim, self.num_heads, self.head_dim = out_dim, num_heads, in_dim // num_heads
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, in_dim] -> [B, L, out_dim]."""
        b, s, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, self.zero_k_bias, self.v_bias]))
        q, k, v = qkv.view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # each [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, L, D]
        out = F.adaptive_avg_pool1d(out.mean(dim=1), self.out_dim)  # [B, L, out_dim]
        return self.proj(out)


class GeGluMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttnProjection(nn.Module):
    """`pre_block`: latent_dim -> latent_channels by a linear skip plus causal attention, then a GeGLU MLP."""

    def __init__(self, in_dim: int, out_dim: int, num_heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, num_heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGluMlp(out_dim, out_dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, in_dim] -> [B, L, out_dim]."""
        x = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# ---------------------------------------------------------------------------------------------------------------
# Decoder (BigVGAN)
# ---------------------------------------------------------------------------------------------------------------


class AMPBlock(nn.Module):
    """BigVGAN AMPBlock1: per dilation, act -> dilated conv -> act -> conv, added to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            WNConv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            WNConv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        # Interleaved (act before convs1[i], act before convs2[i]) in the checkpoint's order.
        self.activations = nn.ModuleList(AliasFreeActivation(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv1, conv2) in enumerate(zip(self.convs1, self.convs2)):
            y = conv1(self.activations[2 * i](x))
            x = x + conv2(self.activations[2 * i + 1](y))
        return x


class BigVGANDecoder(nn.Module):
    """[B, latent_dim, L] -> waveform [B, 1, L * hop] in [-1, 1]."""

    def __init__(self, cfg: AudioVAEConfig) -> None:
        super().__init__()
        ch = cfg.decoder_dim
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.conv_pre = WNConv1d(cfg.latent_dim, ch, 7, padding=3)
        # `ups.<i>.0`: each upsampler sits in a one-element list in the checkpoint.
        self.ups = nn.ModuleList(
            nn.ModuleList([WNConv1d(ch // 2**i, ch // 2 ** (i + 1), k, stride=r, padding=(k - r) // 2,
                                    transposed=True)])
            for i, (r, k) in enumerate(zip(cfg.decoder_rates, cfg.decoder_kernel_sizes))
        )
        self.resblocks = nn.ModuleList(
            AMPBlock(ch // 2 ** (i + 1), k, tuple(d))
            for i in range(len(cfg.decoder_rates))
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes)
        )
        out_ch = ch // 2 ** len(cfg.decoder_rates)
        self.activation_post = AliasFreeActivation(out_ch)
        self.conv_post = WNConv1d(out_ch, 1, 7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up[0](x)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            total = blocks[0](x)  # not sum(...): that starts with a full-size `0 + block(x)` pass
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.num_kernels
        x = self.conv_post(self.activation_post(x))
        return x.clamp(-1.0, 1.0)


class AudioVAE(nn.Module):
    """MiniMax-H3 audio VAE (mono; stereo as a batch of 2). Run in fp32."""

    def __init__(self, config: AudioVAEConfig = AudioVAEConfig()) -> None:
        super().__init__()
        self.config = config
        c = config.latent_channels
        self.encoder = Encoder(config.encoder_dim, config.encoder_rates, config.latent_dim)
        self.pre_block = AttnProjection(config.latent_dim, c, config.num_attention_heads)
        self.mean_proj = nn.Conv1d(c, c, 1)
        self.logs_proj = nn.Conv1d(c, c, 1)
        self.dec_in_proj = nn.Conv1d(c, config.latent_dim, 1)
        self.decoder = BigVGANDecoder(config)
        mean = torch.zeros(c) if config.latents_mean is None else torch.tensor(config.latents_mean)
        std = torch.ones(c) if config.latents_std is None else torch.tensor(config.latents_std)
        self.register_buffer("latents_mean", mean.view(c, 1), persistent=False)
        self.register_buffer("latents_std", std.view(c, 1), persistent=False)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    def set_fused_activations(self, fused: bool | None) -> "AudioVAE":
        """Choose the decoder's anti-aliased activation path: None = Triton kernels on CUDA (default), True = always
        (CPU needs TRITON_INTERPRET=1), False = torch only. See `AliasFreeActivation`."""
        for module in self.decoder.modules():
            if isinstance(module, AliasFreeActivation):
                module.fused = fused
        return self

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
        """Normalized latent [C, 32, Ta] (C = 2 for stereo) -> waveform [C, Ta * 800] float32 in [-1, 1] at 32 kHz.

        Applies the pipeline's de-normalization `latent * latents_std + latents_mean` first (diffusers
        `MiniMaxH3AudioDecodeStep`). `num_samples`, if given, trims the end (the renderer keeps
        round(frames * 32000 / 24) samples).

        Raises:
            ValueError: latent not [C, latent_channels, Ta], or num_samples beyond the decoded length.
        """
        c = self.config.latent_channels
        if latent.ndim != 3 or latent.shape[1] != c:
            raise ValueError(f"audio latent must be [channels, {c}, Ta], got {tuple(latent.shape)}")
        z = latent.float() * self.latents_std + self.latents_mean
        wave = self.decoder(self.dec_in_proj(z))[:, 0]  # [C, Ta * hop]
        if num_samples is not None:
            if num_samples > wave.shape[-1]:
                raise ValueError(f"num_samples {num_samples} exceeds the {wave.shape[-1]} decoded samples")
            wave = wave[:, :num_samples]
        return wave

    @torch.no_grad()
    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """Waveform [C, samples] float in [-1, 1] at 32 kHz -> normalized latent [C, 32, ceil(samples / 800)].

        The released recipe takes the posterior mean (`mean_proj`; `logs_proj` is never used) and normalizes it
        with latents_mean/std. Samples are zero-padded on the right to a whole hop.

        Raises:
            ValueError: waveform not 2-D.
        """
        if waveform.ndim != 2:
            raise ValueError(f"waveform must be [channels, samples], got {tuple(waveform.shape)}")
        pad = (-waveform.shape[-1]) % self.hop_length
        x = F.pad(waveform.float(), (0, pad))[:, None]  # [C, 1, samples]
        h = self.encoder(x)  # [C, latent_dim, Ta]
        h = self.pre_block(h.transpose(1, 2)).transpose(1, 2)  # [C, 32, Ta]
        return (self.mean_proj(h) - self.latents_mean) / self.latents_std
