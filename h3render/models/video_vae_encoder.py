"""The video VAE's encoder: a causal 3D CNN (fp32 at release), parameter names equal to diffusers 0.42.1
`AutoencoderKLMiniMaxH3.encoder`. Split from h3render/models/video_vae.py, which builds it as `VideoVAE.encoder`."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from h3render.models.video_vae_config import VideoVAEConfig


class CausalConv3d(nn.Conv3d):
    """Conv3d with symmetric spatial padding (`padding_mode`, reflect at release) and causal temporal padding.

    Temporal padding prepends `temporal_padding` zero frames and appends none, so frame t only sees frames <= t.
    """

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride=1, spatial_padding: int = 0,
                 temporal_padding: int = 0, padding_mode: str = "reflect") -> None:
        super().__init__(in_ch, out_ch, kernel_size, stride=stride, padding=0)
        self.spatial_padding = spatial_padding
        self.temporal_padding = temporal_padding
        self.spatial_padding_mode = padding_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C, T, H, W] -> [B, C_out, T', H', W']."""
        p = self.spatial_padding
        if p:
            x = F.pad(x, (p, p, p, p, 0, 0), mode=self.spatial_padding_mode)
        if self.temporal_padding:
            x = F.pad(x, (0, 0, 0, 0, self.temporal_padding, 0))
        return F.conv3d(x, self.weight, self.bias, self.stride)


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm over each frame separately (`use_t_isolated_gn` in the original config): stats never mix frames."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = x.transpose(1, 2).reshape(b * t, c, h, w)  # [B*T, C, H, W]
        y = F.group_norm(y, self.num_groups, self.weight, self.bias, self.eps)
        return y.reshape(b, t, c, h, w).transpose(1, 2)


class ResnetBlock3d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, groups: int, eps: float, padding_mode: str) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(groups, in_ch, eps=eps)
        self.conv1 = CausalConv3d(in_ch, out_ch, 3, spatial_padding=1, temporal_padding=2, padding_mode=padding_mode)
        self.norm2 = FrameGroupNorm(groups, out_ch, eps=eps)
        self.conv2 = CausalConv3d(out_ch, out_ch, 3, spatial_padding=1, temporal_padding=2, padding_mode=padding_mode)
        self.conv_shortcut = CausalConv3d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return skip + h


class Downsample3d(nn.Module):
    """Strided 3x3x3 conv; a spatial stride of 2 first pads bottom/right by 1 so the output is ceil(size / 2)."""

    def __init__(self, channels: int, temporal_stride: int, spatial_stride: int, padding_mode: str) -> None:
        super().__init__()
        self.spatial_stride = spatial_stride
        self.padding_mode = padding_mode
        self.conv = CausalConv3d(channels, channels, 3, stride=(temporal_stride, spatial_stride, spatial_stride),
                                 temporal_padding=2, padding_mode=padding_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spatial_stride == 2:
            x = F.pad(x, (0, 1, 0, 1, 0, 0), mode=self.padding_mode)
        return self.conv(x)


class DownBlock3d(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, layers: int, t_factor: int, s_factor: int, groups: int, eps: float,
                 padding_mode: str) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock3d(in_ch if i == 0 else out_ch, out_ch, groups, eps, padding_mode) for i in range(layers)
        )
        self.downsamplers = None
        if t_factor * s_factor > 1:
            self.downsamplers = nn.ModuleList([Downsample3d(out_ch, t_factor, s_factor, padding_mode)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x


class Encoder3d(nn.Module):
    """Causal 3D CNN: [B, 3, T, H, W] -> moments [B, 2*latent_channels, T', H/16, W/16] (mean then logvar)."""

    def __init__(self, cfg: VideoVAEConfig) -> None:
        super().__init__()
        ch = cfg.block_out_channels
        mode = cfg.spatial_padding_mode
        self.conv_in = CausalConv3d(cfg.in_channels, ch[0], 3, spatial_padding=1, temporal_padding=2,
                                    padding_mode=mode)
        ins = (ch[0],) + tuple(ch[:-1])
        self.down_blocks = nn.ModuleList(
            DownBlock3d(ins[i], ch[i], cfg.layers_per_block, cfg.temporal_downsample_factors[i],
                        cfg.spatial_downsample_factors[i], cfg.norm_num_groups, cfg.norm_eps, mode)
            for i in range(len(ch))
        )
        self.norm_out = FrameGroupNorm(cfg.norm_num_groups, ch[-1], eps=cfg.norm_eps)
        self.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, 3, spatial_padding=1, temporal_padding=2,
                                     padding_mode=mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))
