"""The MiniMax-H3 diffusion transformer (DiT) over one packed sequence, in pure torch.

One stream of blocks runs full self-attention over the rows `[text | audio | video]` of a single request (see
`h3render.packing`). Modality enters only through the input projections, the per-row AdaLN modality tag and the two
output heads. Parameter names are the NATIVE ones of the official `MiniMaxAI/MiniMax-H3` shards
(`blocks.{i}.attn.qkv_proj`, `final_layer.video_out`, ...), so that layout loads without renaming:

* `attn.qkv_proj.weight` rows are interleaved per head, `[head0: q k v, head1: q k v, ...]`, i.e. the output of the
  projection reshapes to `[S, heads, 3, head_dim]`.
* `mlp.fc1.weight` is gate-first: rows `[gate; value]`, the SwiGLU output is `value * silu(gate)`.
* `rope.inv_freq` is not a parameter here; it is recomputed from the config.

AdaLN modulation depends only on (timestep, modality), so it is computed ahead of the denoising loop into
`ModulationTables` (`DiT.modulation_tables`) and `DiT.forward` reads the tables only. After the tables of a schedule
are built, `DiT.drop_adaln_weights_()` frees the AdaLN projections (about 13 B of the 33 B released parameters).

The element-wise ops (`qk_norm_rope`, `modulate`, `gated_residual`, `swiglu`) are the `h3render.kernels` functions:
fused Triton on CUDA, their plain-torch references elsewhere. The swap point for attention backends and sequence
parallelism is the `attention` attribute of every `Attention` module (`DiT.set_attention`). `DiT.enable_vsa`
switches the blocks (not the token refiner) to FastH3's video sparse attention and adds its gate projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from h3render import kernels
from h3render.kernels.vsa import TILE, empty_tiles, vsa_prep
from h3render.models.attention import SparseAttention, check_vsa_settings, gate_projection, sdpa_attention
from h3render.models.dit_config import DiTConfig
from h3render.models.dit_embed import rope_tables, timestep_sinusoid
from h3render.models.fp8 import Fp8Linear, Fp8Rows
from h3render.packing import PackedLayout

# Modality tags of the packed sequence (released model): 0 video, 1 text, 2 audio. Block AdaLN tables hold one row per
# (timestep, modality), addressed as `timestep_index * NUM_MODALITIES + tag`.
NUM_MODALITIES = 3

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (qkv [S, H, 3, D], q_weight [D], k_weight [D], rope (cos, sin) [S, R] or None, eps) -> [S, H, D]
QKVAttentionFn = Callable[..., torch.Tensor]


# ---------------------------------------------------------------------------------------------------------------------
# Attention and the element-wise ops of a block.


# The element-wise work of a block lives in `h3render.kernels`: each function there runs its Triton kernel on CUDA
# tensors and its plain-torch reference (fp32 math, one rounding) elsewhere, so CPU parity tests exercise the reference
# and the GPU the fused kernel (kernel-vs-reference tests: tests/unit/test_kernels.py).
qk_norm_rope = kernels.qk_norm_rope  # (q, k, v [S, H, D], q_weight, k_weight [D], cos, sin [S, R] | None, eps)
modulate = kernels.modulate  # (x [S, C], norm_weight [C], shift, scale [R, C], row_index [S], eps) -> [S, C]
gated_residual = kernels.gated_residual  # (x, y [S, C], gate [R, C], row_index [S]) -> x + gate[row] * y
swiglu = kernels.swiglu  # (h [S, 2F] gate-first) -> value * silu(gate) [S, F]


# ---------------------------------------------------------------------------------------------------------------------
# Modules (native parameter names).


class Attention(nn.Module):
    """Self-attention over one sequence with per-head QK RMSNorm and optional partial RoPE; no biases.

    `attention` is the one swap point for attention backends and sequence parallelism (Ulysses): a callable
    `(q, k, v) -> out`, all `[B, S, H, D]` with B = 1. Default `sdpa_attention`.
    """

    # With a `SparseAttention` whose fine stage is the Triton kernel, `qk_norm_rope` writes v straight into the
    # kernel's tile order (`v_slot`), instead of packed rows the kernel then gathers into it: one pass over v fewer,
    # 0.64 ms of a ~105 ms layer at 1344x768x243 on an H200. A class setting, so a benchmark can time both.
    vsa_v_tiles = True
    # On that path `kernels.vsa.vsa_prep` (one Triton pass on CUDA) writes q, k, v and the three fp32 tile means VSA's
    # coarse stage needs (`vsa_attention(pooled=)`), so no pool re-reads q, k, v: ≈3.2 GB a layer at 1344x768x243,
    # 3 x 0.30 ms on an H200 (docs/performance.md §27.1). Measured (§29.7): the prep 3.03 -> 2.51 ms a layer at
    # 1344x768x243 (0.94 -> 0.74 at 960x544x124), each step of a render ~0.01 s shorter.
    vsa_fused_prep = True

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.qk_norm_eps = qk_norm_eps
        self.qkv_proj = nn.Linear(hidden_size, 3 * heads * head_dim, bias=False)  # rows per head: q, k, v
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.out_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)
        self.attention: AttentionFn = sdpa_attention
        # Replaces norm + RoPE + attention as one step when set (sequence parallelism lays q/k/v out for its
        # all-to-alls while normalizing them): fn(qkv [S, H, 3, D], q_weight, k_weight, rope, eps) -> [S, H, D].
        self.qkv_attention: QKVAttentionFn | None = None
        self.gate_proj: nn.Linear | None = None  # `DiT.enable_vsa`: FastVideo's `to_gate_compress` (no bias)

    def forward(self, x: "torch.Tensor | Fp8Rows", rope: tuple[torch.Tensor, torch.Tensor] | None,
                sparse=None) -> torch.Tensor:
        """x: `[S, hidden]` -> `[S, hidden]`; rope: `(cos, sin)` `[S, R]` or None; `sparse`: `SparseAttention`.
        x is `Fp8Rows` when the projections are `Fp8Linear` (`models.fp8.quantize_dit_fp8_`): qkv and gate read the
        same quantized rows, and `out_proj` quantizes the attention output itself."""
        s = x.data.shape[0] if isinstance(x, Fp8Rows) else x.shape[0]
        qkv = self.qkv_proj(x).view(s, self.heads, 3, self.head_dim)  # interleaved per head
        if self.qkv_attention is not None:
            extra = {} if sparse is None else dict(sparse=sparse, gate=self._gate(x, s))
            out = self.qkv_attention(qkv, self.q_norm.weight, self.k_norm.weight, rope, self.qk_norm_eps, **extra)
            return self.out_proj(out.reshape(s, self.heads * self.head_dim))
        q, k, v = qkv.unbind(2)  # each [S, H, D]
        cos, sin = rope if rope is not None else (None, None)
        v_tiles = sparse is not None and self.vsa_v_tiles and sparse.triton_fine(v)
        # With v_tiles v goes into the fine kernel's tile buffer [padded_len >= S, H, D] in place of a [S, H, D]
        # copy, which the kernel's own tile copy of v then no longer joins: the peak does not grow.
        pooled, norm_args = None, (self.q_norm.weight, self.k_norm.weight, cos, sin, self.qk_norm_eps)
        # The means: 3 x [H, n, D] fp32, 0.10 GB at 1344x768x243, alive through the VSA call (the pools' k̄ alone
        # was before): 0.07 GB more at the layer's peak, under 1 % of memplan's calibrated activations there.
        if v_tiles and self.vsa_fused_prep:
            q, k, v, *pooled = vsa_prep(q, k, v, *norm_args, sparse.plan)
        else:
            buffers = (q.new_empty(q.shape), k.new_empty(k.shape),
                       empty_tiles(sparse.plan, self.heads, self.head_dim, v.dtype, v.device)) if v_tiles else None
            q, k, v = qk_norm_rope(q, k, v, *norm_args, out=buffers, v_slot=sparse.plan.slot if v_tiles else None)
        # The projection output is dead once normalized: freed here, not when the call returns, it leaves attention
        # 4 hidden-widths per row more room (3.2 GB at 1344x768x243; the streamed plan's peak, memplan.py).
        del qkv
        if sparse is None:
            out = self.attention(q[None], k[None], v[None])[0]
        else:  # the gate only now: alive through qk_norm_rope it was one [S, H, D] more at that moment, the VSA
            # layer's peak with int8 QKᵀ, which the v tile buffer's padded_len - S pad rows would otherwise raise
            out = sparse(q, k, v, self._gate(x, s), v_tiles=v_tiles, pooled=pooled)
        return self.out_proj(out.reshape(s, self.heads * self.head_dim))

    def _gate(self, x: "torch.Tensor | Fp8Rows", s: int) -> torch.Tensor:
        """VSA's gate `[S, H, D]` from the attention input, the rows qkv reads (FastVideo `to_gate_compress`)."""
        return self.gate_proj(x).view(s, self.heads, self.head_dim)


class MLP(nn.Module):
    """SwiGLU feed-forward, no biases; `fc1` is gate-first `[gate; value]`."""

    def __init__(self, hidden_size: int, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, 2 * ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[S, hidden]` (or `Fp8Rows` for an `Fp8Linear` fc1) -> `[S, hidden]`; an `Fp8Linear` fc2 gets its input
        as `Fp8Rows` straight from the SwiGLU kernel."""
        return self.fc2(swiglu(self.fc1(x), fp8=isinstance(self.fc2, Fp8Linear)))


class RefinerBlock(nn.Module):
    """Plain pre-norm block on the text rows: no AdaLN, no RoPE."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim, cfg.qk_norm_eps)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[Nt, hidden]` -> `[Nt, hidden]`."""
        x = x + self.attn(self.norm1(x), None)
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    """Refines the projected text rows before they are packed (released: 2 blocks + a final RMSNorm)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(cfg) for _ in range(cfg.num_refiner_layers))
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[Nt, hidden]` -> `[Nt, hidden]`."""
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


class AdaLNProj(nn.Module):
    """`linear(silu(temb))` -> one modulation table. Only used to build `ModulationTables` ahead of the loop.

    With `silu=False` (FastH3 Trim, `DiTConfig.adaln_rank`) the input is already the shared basis
    `adaln_basis(silu(temb))` [K, r] and the projection is linear alone (FastVideo 0.2.1
    `MiniMaxH3AdaLayerNormModulation(apply_silu=False)`).
    """

    def __init__(self, time_embed_dim: int, out_features: int, silu: bool = True):
        super().__init__()
        self.linear = nn.Linear(time_embed_dim, out_features, bias=True)
        self.silu = silu

    @classmethod
    def of(cls, cfg: DiTConfig, out_features: int) -> "AdaLNProj":
        """The projection a config asks for: from temb [time_embed_dim] (release) or the rank-r basis (Trim)."""
        return cls(cfg.adaln_rank or cfg.time_embed_dim, out_features, silu=cfg.adaln_rank is None)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        # SiLU runs at temb's precision (fp32) and only its result is cast to the projection dtype: every block reads
        # the same temb, so an early bf16 rounding would bias all blocks alike at every step.
        return self.linear((F.silu(temb) if self.silu else temb).to(self.linear.weight.dtype))


class Block(RefinerBlock):
    """One DiT block: the refiner block's layers, AdaLN-modulated per row (with RoPE), gated residuals."""

    def __init__(self, cfg: DiTConfig):
        super().__init__(cfg)
        # 6 vectors x 3 modalities per timestep (released: 18 x 5376 outputs).
        self.adaln_proj: AdaLNProj | None = AdaLNProj.of(cfg, 6 * NUM_MODALITIES * cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        rows: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        sparse=None,
    ) -> torch.Tensor:
        """
        Args:
            x: `[S, hidden]` packed hidden states.
            table: `[K*3, 6, hidden]` (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp).
            rows: `[S]` int64, `timestep_index * 3 + tag`.
            rope: `(cos, sin)` `[S, R]` float32; sparse: this layout's `SparseAttention` (VSA) or None (dense).
        Returns:
            `[S, hidden]`.
        """
        # FP8 linears (`models.fp8.quantize_dit_fp8_`) read e4m3 rows that modulate writes in the same pass.
        h = modulate(x, self.norm1.weight, table[:, 0], table[:, 1], rows, self.norm1.eps,
                     fp8=isinstance(self.attn.qkv_proj, Fp8Linear))
        x = gated_residual(x, self.attn(h, rope, sparse), table[:, 2], rows)
        h = modulate(x, self.norm2.weight, table[:, 3], table[:, 4], rows, self.norm2.eps,
                     fp8=isinstance(self.mlp.fc1, Fp8Linear))
        return gated_residual(x, self.mlp(h), table[:, 5], rows)


class TimeEmbedder(nn.Module):
    """Timestep MLP `proj_out(silu(proj_in(sinusoid)))` (fp32 in the release)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.proj_in = nn.Linear(cfg.freq_dim, cfg.time_embed_hidden_dim, bias=True)
        self.proj_out = nn.Linear(cfg.time_embed_hidden_dim, cfg.time_embed_dim, bias=True)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        """`[K, freq_dim]` -> `[K, time_embed_dim]`."""
        return self.proj_out(F.silu(self.proj_in(emb)))


class FinalLayer(nn.Module):
    """Final RMSNorm modulated per timestep (shift then scale; no modality), then one head per modality (fp32)."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.final_norm_eps)
        self.adaln_proj: AdaLNProj | None = AdaLNProj.of(cfg, 2 * cfg.hidden_size)
        self.video_out = nn.Linear(cfg.hidden_size, cfg.video_patch_dim, bias=True)
        self.audio_out = nn.Linear(cfg.hidden_size, cfg.audio_in_channels, bias=True)


@dataclass(frozen=True, eq=False)
class ModulationTables:
    """AdaLN modulation of every block for a set of timesteps, computed ahead of the denoising loop.

    Attributes:
        timesteps: `[K]` float32, the timesteps (t = 1 - sigma) the tables were built for, in the given order.
        blocks: one `[K*3, 6, hidden]` tensor per block, model dtype; row `k*3 + tag` (tag 0 video, 1 text, 2 audio),
            slots (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp).
        final: `[K, 2, hidden]`, (shift, scale) of the final norm.
    """

    timesteps: torch.Tensor
    blocks: tuple[torch.Tensor, ...]
    final: torch.Tensor

    def index_of(self, t: float | torch.Tensor) -> int:
        """Index of timestep `t` in `timesteps` (exact float32 match).

        Raises:
            ValueError: when `t` is not one of the tabulated timesteps.
        """
        t = torch.as_tensor(t, dtype=torch.float32).to(self.timesteps.device)
        hits = (self.timesteps == t).nonzero()
        if hits.numel() == 0:
            raise ValueError(f"timestep {float(t)} is not in the modulation tables ({self.timesteps.numel()} entries)")
        return int(hits[0, 0])

    def to(self, device: torch.device | str) -> "ModulationTables":
        return ModulationTables(
            self.timesteps.to(device), tuple(b.to(device) for b in self.blocks), self.final.to(device)
        )


class DiT(nn.Module):
    """MiniMax-H3 transformer over one packed sequence (native checkpoint names).

    Precision policy of the release (`apply_precision_`): `video_patch_proj`, `audio_patch_proj`, `time_embedder`,
    `final_layer.video_out`, `final_layer.audio_out` stay float32; everything else runs in the model dtype (bf16 on
    GPU), including `condition_proj`, the norms and the AdaLN projections.
    """

    # Released checkpoint: these are float32 on disk and stay float32 (diffusers' `_keep_in_fp32_modules`).
    FP32_MODULES = (
        "video_patch_proj",
        "audio_patch_proj",
        "time_embedder",
        "final_layer.video_out",
        "final_layer.audio_out",
    )

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.video_patch_proj = nn.Linear(cfg.video_patch_dim, h, bias=True)
        self.audio_patch_proj = nn.Linear(cfg.audio_in_channels, h, bias=True)
        self.condition_proj = nn.Linear(cfg.text_dim, h, bias=True)
        self.time_embedder = TimeEmbedder(cfg)
        self.token_refiner = TokenRefiner(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)
        # FastH3 Trim: the time embedding's shared rank-r basis every AdaLN projection reads (no bias).
        self.adaln_basis = nn.Linear(cfg.time_embed_dim, cfg.adaln_rank, bias=False) if cfg.adaln_rank else None
        self.vsa_sparsity: float | None = None  # set by enable_vsa
        # VSA's QKᵀ from int8 codes (`kernels.vsa.quant`); the Engine sets it: fp8 on sm_90+ (`vsa_qk_int8_pays`)
        self.vsa_qk_int8 = False

    # -- setup ------------------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The model (block stack) dtype."""
        return self.condition_proj.weight.dtype

    def apply_precision_(self, dtype: torch.dtype) -> "DiT":
        """Cast in place to the release's split: `FP32_MODULES` float32, all else `dtype`; a Trim DiT's factorized
        AdaLN (`adaln_basis`, every `adaln_proj`) float16, as FastVideo 0.2.1 pins it ("BF16 is ~1.7x worse
        there"; fp32 on a float32 run). Returns self."""
        self.to(dtype)
        for name in self.FP32_MODULES:
            self.get_submodule(name).float()
        if self.adaln_basis is not None:
            adaln = torch.float32 if dtype == torch.float32 else torch.float16
            for module in [self.adaln_basis, self.final_layer.adaln_proj] + [b.adaln_proj for b in self.blocks]:
                if module is not None:
                    module.to(adaln)
        return self

    def set_attention(self, fn: AttentionFn, refiner: bool = False) -> None:
        """Use `fn(q, k, v)` (`[B, S, H, D]` each) in every block's attention; also in the token refiner when
        `refiner` (the refiner sees only the text rows, so a sequence-parallel wrapper must not touch it)."""
        for block in self.blocks:
            block.attn.attention = fn
        if refiner:
            for block in self.token_refiner.blocks:
                block.attn.attention = fn

    def set_qkv_attention(self, fn: "QKVAttentionFn | None") -> None:
        """Use `fn` for QK norm + RoPE + attention in every block (not the token refiner); None restores the
        default (`qk_norm_rope` then `attention`). See `Attention.qkv_attention`."""
        for block in self.blocks:
            block.attn.qkv_attention = fn

    def enable_vsa(self, sparsity: float, tile: int = TILE) -> None:
        """Blocks (not the token refiner) run VSA-H3 at `sparsity` (release values: `spec.FASTH3_V1_VSA_SPARSITY`,
        `FASTH3_V2_VSA_SPARSITY`; `kernels.vsa.TILE`-row tiles only) and
        gain zero gates `blocks.{i}.attn.gate_proj.weight` `[heads * head_dim, hidden]` to load a student's into.
        ValueError on a sparsity outside [0, 1) or another tile (`models.attention.check_vsa_settings`)."""
        if any(isinstance(block.attn.qkv_proj, Fp8Linear) and block.attn.gate_proj is None for block in self.blocks):
            raise ValueError("DiT.enable_vsa after quantize_dit_fp8_: the gates would miss FP8; enable VSA first")
        self.vsa_sparsity = check_vsa_settings(sparsity, tile)
        for attn in (block.attn for block in self.blocks if block.attn.gate_proj is None):
            attn.gate_proj = gate_projection(attn.qkv_proj.weight, attn.heads * attn.head_dim)

    def drop_adaln_weights_(self) -> None:
        """Delete `blocks.*.adaln_proj` and `final_layer.adaln_proj` (the forward reads `ModulationTables` only).
        Afterwards `modulation_tables` raises RuntimeError."""
        for block in self.blocks:
            block.adaln_proj = None
        self.final_layer.adaln_proj = None

    @property
    def has_adaln_weights(self) -> bool:
        return self.final_layer.adaln_proj is not None and all(b.adaln_proj is not None for b in self.blocks)

    # -- step-independent precomputation ----------------------------------------------------------------------------

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[S, 6 * rope_freq_dim]` float32 from layout positions `[S, 3]` float64; once per layout."""
        return rope_tables(positions, self.cfg.rope_freq_dim, self.cfg.rope_theta)

    @torch.no_grad()
    def modulation_tables(self, timesteps: torch.Tensor, device: torch.device | str | None = None) -> ModulationTables:
        """AdaLN tables for timesteps `[K]` (t = 1 - sigma, unscaled in [0, 1]); see `ModulationTables`.

        Args:
            device: where the tables are built and kept (default: where the time embedder is). An AdaLN projection
                held elsewhere (host memory, to keep the ≈13 B AdaLN parameters of the release off the GPU) visits
                `device` for its own block only and goes back, so peak memory grows by one block's projection
                (≈0.5 GB at release).

        Raises:
            RuntimeError: after `drop_adaln_weights_()`.
        """
        if not self.has_adaln_weights:
            raise RuntimeError("DiT.modulation_tables: the AdaLN weights were dropped; build the tables before that")
        te = self.time_embedder.proj_in.weight
        device = te.device if device is None else torch.device(device)
        timesteps = torch.as_tensor(timesteps, dtype=torch.float32).reshape(-1).to(device)
        k, h = timesteps.numel(), self.cfg.hidden_size
        temb = self.time_embedder(timestep_sinusoid(timesteps, self.cfg.freq_dim).to(te.dtype))
        if self.adaln_basis is not None:  # FastH3 Trim: [K, time_embed_dim] -> the shared basis [K, r]
            basis = self.adaln_basis.to(device)
            temb = basis(F.silu(temb).to(basis.weight.dtype))

        def run(proj: nn.Module, rows: int) -> torch.Tensor:
            linear = proj.linear
            if linear.weight.device == device:
                return proj(temb).view(rows, -1, h)
            # A device copy for this block only, `AdaLNProj.forward`'s arithmetic; the module stays where it is.
            # (Moving it there and back copied every projection back to host memory as well: 24.6 s for the 26 GB of
            # the release on an H200 host, docs/performance.md §11.)
            weight = linear.weight.to(device)
            bias = None if linear.bias is None else linear.bias.to(device)
            return F.linear(F.silu(temb).to(weight.dtype), weight, bias).view(rows, -1, h)

        blocks = tuple(run(b.adaln_proj, k * NUM_MODALITIES) for b in self.blocks)
        final = run(self.final_layer.adaln_proj, k)
        return ModulationTables(timesteps, blocks, final)

    def offload_adaln_(self, device: torch.device | str = "cpu") -> None:
        """Move every AdaLN projection (blocks + final layer) to `device` (host memory): the forward reads the tables
        only, and `modulation_tables(timesteps, device=...)` brings each projection back for its own block."""
        for proj in [b.adaln_proj for b in self.blocks] + [self.final_layer.adaln_proj]:
            if proj is not None:
                proj.to(device)

    # -- forward ----------------------------------------------------------------------------------------------------

    def forward(
        self,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        text: torch.Tensor,
        layout: PackedLayout,
        tables: ModulationTables,
        timestep_index: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        window: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity of every video and audio row (data-ward: x0 = x + sigma * v).

        With `window=(start, end)` only packed rows `start..end-1` are embedded, run through the blocks and sent
        through the heads (rows at or past `seq_len` are zero padding): the row-sharded half of sequence
        parallelism. Attention must then be a wrapper that sees the other rows (`h3render.parallel.ulysses`); the
        token refiner still runs on all text rows (it attends among them only).

        Args:
            video_rows: `[Nv, in_channels * prod(patch)]` (96 released), in `layout.video_index` order.
            audio_rows: `[Na, audio_in_channels]` (32), channel-major, in `layout.audio_index` order.
            text: `[Nt, text_dim]` text-encoder states, in `layout.text_index` order.
            layout: the packed layout (index tensors on the model's device).
            tables: from `modulation_tables`; `timestep_index` addresses its `timesteps`.
            timestep_index: `[S]` int64, per packed row, index into `tables.timesteps`.
            rope: `(cos, sin)` from `rope_tables(layout.positions)`; computed here when None.
            window: `(start, end)` packed-row window, `end` may exceed `seq_len` by padding; None = all rows.
        Returns:
            `(video_velocity [Nv, 96], audio_velocity [Na, 32])`, dtype of the output heads (float32 in the release);
            with a window, only the video/audio rows inside it, in order.
        Raises:
            ValueError: on row counts or widths that do not match the layout/config, or a bad window.
        """
        cfg = self.cfg
        s = layout.seq_len
        _check_rows("video_rows", video_rows, layout.video_index.numel(), cfg.video_patch_dim)
        _check_rows("audio_rows", audio_rows, layout.audio_index.numel(), cfg.audio_in_channels)
        _check_rows("text", text, layout.text_index.numel(), cfg.text_dim)
        if timestep_index.shape != (s,):
            raise ValueError(f"timestep_index must be [{s}], got {list(timestep_index.shape)}")
        if len(tables.blocks) != len(self.blocks):
            raise ValueError(f"modulation tables hold {len(tables.blocks)} blocks, the model has {len(self.blocks)}")
        if rope is None:
            rope = self.rope_tables(layout.positions)

        start, end = (0, s) if window is None else window
        if not 0 <= start < end or start >= s:
            raise ValueError(f"window {window} does not overlap the {s} packed rows")
        n = end - start
        spans = {name: _span(index, start, end) for name, index in
                 (("text", layout.text_index), ("video", layout.video_index), ("audio", layout.audio_index))}

        dtype = self.dtype
        t = self.token_refiner(self.condition_proj(text.to(dtype)))  # [Nt, hidden]
        x = t.new_zeros(n, cfg.hidden_size)  # [n, hidden]: this window's packed rows
        i0, i1 = spans["text"]
        x.index_copy_(0, layout.text_index[i0:i1] - start, t[i0:i1])
        for name, proj, rows_in in (("video", self.video_patch_proj, video_rows),
                                    ("audio", self.audio_patch_proj, audio_rows)):
            i0, i1 = spans[name]
            index = getattr(layout, f"{name}_index")
            _scatter_projected(x, proj, rows_in[i0:i1], index[i0:i1] - start)

        t_index = _window_rows(timestep_index, start, end)  # [n]
        rows = t_index * NUM_MODALITIES + _window_rows(layout.token_tags, start, end)  # [n] into the block tables
        rope = (_window_rows(rope[0], start, end), _window_rows(rope[1], start, end))
        sparse = None if self.vsa_sparsity is None else SparseAttention.for_layout(
            layout, self.vsa_sparsity, x.device, qk_int8=self.vsa_qk_int8)
        for block, table in zip(self.blocks, tables.blocks):
            x = block(x, table, rows, rope, sparse)

        final = tables.final
        x = modulate(x, self.final_layer.norm.weight, final[:, 0], final[:, 1], t_index, self.final_layer.norm.eps)
        i0, i1 = spans["video"]
        video = _head(self.final_layer.video_out, x, layout.video_index[i0:i1] - start)
        i0, i1 = spans["audio"]
        audio = _head(self.final_layer.audio_out, x, layout.audio_index[i0:i1] - start)
        return video, audio


def _span(index: torch.Tensor, start: int, end: int) -> tuple[int, int]:
    """Positions `[i0, i1)` of the entries of an ascending index that fall in `[start, end)`."""
    bounds = torch.searchsorted(index, torch.tensor([start, end], dtype=index.dtype, device=index.device))
    return int(bounds[0]), int(bounds[1])


def _window_rows(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """`t[start:end]` along dim 0, zero-padded past the end of `t` (pad rows of the last shard)."""
    part = t[start:end]
    if part.shape[0] < end - start:
        part = torch.cat([part, part.new_zeros(end - start - part.shape[0], *part.shape[1:])])
    return part


# Rows per chunk when projecting into / out of the packed sequence: bounds the transient fp32 activations of the
# fp32 projections (a full [72576, 5376] fp32 copy would be 1.6 GB at the released size).
_ROW_CHUNK = 16384


def _check_rows(name: str, t: torch.Tensor, n: int, width: int) -> None:
    if t.ndim != 2 or t.shape[0] != n or t.shape[1] != width:
        raise ValueError(f"{name} must be [{n}, {width}] for this layout, got {list(t.shape)}")


def _scatter_projected(x: torch.Tensor, proj: nn.Linear, rows: torch.Tensor, index: torch.Tensor) -> None:
    """`x[index] = proj(rows)` in row chunks; rows are cast to the projection dtype, results to `x.dtype`."""
    for start in range(0, rows.shape[0], _ROW_CHUNK):
        part = proj(rows[start:start + _ROW_CHUNK].to(proj.weight.dtype))
        x.index_copy_(0, index[start:start + _ROW_CHUNK], part.to(x.dtype))


def _head(proj: nn.Linear, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`proj(x[index])` in row chunks, at the head's dtype. x: `[S, hidden]`, index: `[N]` -> `[N, out]`."""
    parts = [
        proj(x.index_select(0, index[start:start + _ROW_CHUNK]).to(proj.weight.dtype))
        for start in range(0, index.numel(), _ROW_CHUNK)
    ]
    if not parts:
        return x.new_zeros(0, proj.out_features, dtype=proj.weight.dtype)
    return torch.cat(parts)
