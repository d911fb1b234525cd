"""Triton kernels, each beside its plain-torch reference (naive.py).

Each public function runs Triton on CUDA tensors and the reference elsewhere (`use_triton=` forces either).
The DiT's element-wise work per block: `qk_norm_rope_qkv` (qkv split + per-head RMSNorm + RoPE), `modulate`
(AdaLN RMSNorm + scale/shift), `gated_residual` (x + gate * y) and `swiglu` (FFN activation).
"""

from h3render.kernels.gated_residual import gated_residual
from h3render.kernels.modulate import modulate
from h3render.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_qkv
from h3render.kernels.swiglu import swiglu

__all__ = ["gated_residual", "modulate", "qk_norm_rope", "qk_norm_rope_qkv", "swiglu"]
