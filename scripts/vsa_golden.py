"""Golden tensors of FastVideo 0.2.1's own VSA-H3 code, for tests/parity/test_vsa_parity.py (CPU, fp32).

Downloads the fastvideo 0.2.1 wheel (`pip download fastvideo==0.2.1 --no-deps`) unless `--wheel` names one, loads
`fastvideo/attention/backends/video_sparse_attn_h3.py` and what it needs from it with the heavy package imports
stubbed, and runs `MiniMaxH3VSAImpl.forward` on tiny random q/k/v/gate. Its fine stage calls the CUDA kernel
`block_sparse_attn`; here that name is bound to FastVideo's own CPU oracle `reference_sparse_attention` (from the
wheel's `fastvideo/tests/attention/test_vsa_h3_metadata.py`: masked SDPA over the padded tile buffer). No FastVideo
code is copied into this repository; only its outputs are saved.

Inputs are drawn so that top-k has no near-ties: for every (head, video query tile) the k-th and (k+1)-th video tile
scores differ by at least `MIN_GAP` (else the seed is advanced), so the selected set does not depend on rounding.

Usage: python scripts/vsa_golden.py [--wheel fastvideo-0.2.1-py3-none-any.whl] [--out tests/data/vsa_golden.pt]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch

MIN_GAP = 1e-3  # fp32 scores are ~1e-7 accurate; a 1e-3 gap keeps the top-k set unambiguous

# (prefix segments in packed order, video grid (T, H, W), heads, head dim, sparsity). Case "ragged" is ragged in all
# three grid axes with every prefix segment leaving a remainder tile; "empty_cond" drops a zero-length segment.
CASES = {
    "ragged": ((70, 5, 130), (9, 6, 5), 2, 8, 0.75),
    "empty_cond": ((37, 0, 21), (5, 6, 7), 2, 16, 0.5),
    "dense": ((37, 0, 21), (5, 6, 7), 2, 8, 0.0),
}

_FILES = (
    "fastvideo/attention/backends/abstract.py",
    "fastvideo/attention/backends/video_sparse_attn.py",
    "fastvideo/attention/backends/video_sparse_attn_h3.py",
    "fastvideo/attention/backends/video_sparse_attn_h3_probe.py",
    "fastvideo/tests/attention/test_vsa_h3_metadata.py",
)


def _wheel(path: str | None, tmp: Path) -> Path:
    if path:
        return Path(path)
    subprocess.run([sys.executable, "-m", "pip", "download", "fastvideo==0.2.1", "--no-deps", "-q", "-d", str(tmp)],
                   check=True)
    return next(tmp.glob("fastvideo-0.2.1-*.whl"))


def _stub_packages(root: Path) -> None:
    """Empty `fastvideo.*` packages over the extracted files (their real `__init__`s import ~50 dependencies)."""

    class _Logger(logging.LoggerAdapter):
        def warning_once(self, msg, *a, **k):
            self.warning(msg)

        def info_once(self, msg, *a, **k):
            self.info(msg)

    for name in ("fastvideo", "fastvideo.attention", "fastvideo.attention.backends", "fastvideo.tests",
                 "fastvideo.tests.attention"):
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = mod
    logger_mod = types.ModuleType("fastvideo.logger")
    logger_mod.init_logger = lambda name: _Logger(logging.getLogger(name), {})
    sys.modules["fastvideo.logger"] = logger_mod
    dist_mod = types.ModuleType("fastvideo.distributed")
    dist_mod.get_sp_group = lambda: None
    sys.modules["fastvideo.distributed"] = dist_mod


def _import(name: str, root: Path):
    spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _ties_free(q: torch.Tensor, k: torch.Tensor, h3, meta, sparsity: float) -> bool:
    """Whether every (head, video query tile) has a clear gap at its top-k boundary."""
    impl_tile = lambda x: h3.MiniMaxH3VSAImpl(2, 8, False, 1.0).tile(x, meta).clone()  # noqa: E731
    qp = h3._pool_tiles(impl_tile(q), meta.variable_block_sizes, 64)
    kp = h3._pool_tiles(impl_tile(k), meta.variable_block_sizes, 64)
    scores = torch.matmul(qp, kp.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p, v = meta.num_prefix_tiles, meta.num_video_tiles
    kk = max(1, min(math.ceil((1 - sparsity) * v), v))
    if kk == v:
        return True
    top = scores[..., p:, p:].topk(kk + 1, dim=-1).values
    return bool(((top[..., kk - 1] - top[..., kk]) > MIN_GAP).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", help="a downloaded fastvideo-0.2.1 wheel (default: pip download it)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/data/vsa_golden.pt"))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with zipfile.ZipFile(_wheel(args.wheel, tmp)) as zf:
            for f in _FILES:
                zf.extract(f, tmp)
        _stub_packages(tmp)
        for f in _FILES:
            _import(f[:-3].replace("/", "."), tmp)
        h3 = sys.modules["fastvideo.attention.backends.video_sparse_attn_h3"]
        oracle = sys.modules["fastvideo.tests.attention.test_vsa_h3_metadata"].reference_sparse_attention

        golden = {}
        for name, (prefix, grid, heads, dim, sparsity) in CASES.items():
            meta = h3.MiniMaxH3VSAMetadataBuilder().build(
                current_timestep=0, raw_latent_shape=(grid[0], 2 * grid[1], 2 * grid[2]), patch_size=(1, 2, 2),
                VSA_sparsity=sparsity, prefix_segments=prefix, device=torch.device("cpu"), tile_size=64)

            def fine_on_cpu(q, k, v, mask, sizes, meta=meta):  # stands in for the CUDA kernel: [B, H, S_pad, D]
                out = oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, meta)
                return out.transpose(1, 2), None

            h3.block_sparse_attn_64_bhsd = fine_on_cpu
            impl = h3.MiniMaxH3VSAImpl(num_heads=heads, head_size=dim, causal=False, softmax_scale=dim ** -0.5)
            seq = meta.total_seq_length
            seed = 0
            while True:
                gen = torch.Generator().manual_seed(seed)
                q, k, v, g = (torch.randn(1, seq, heads, dim, generator=gen) for _ in range(4))
                if _ties_free(q, k, h3, meta, sparsity):
                    break
                seed += 1
            tiled = [impl.tile(x, meta).clone() for x in (q, k, v, g)]
            with_gate = impl.postprocess_output(impl.forward(*tiled, meta), meta)[0]
            no_gate = impl.postprocess_output(impl.forward(*tiled[:3], None, meta), meta)[0]
            golden[name] = dict(
                prefix=prefix, grid=grid, sparsity=sparsity, seed=seed,
                q=q[0], k=k[0], v=v[0], gate=g[0], out=with_gate, out_no_gate=no_gate,
                sizes=meta.variable_block_sizes.clone(), slot=meta.untile_combined_index.clone(),
                num_prefix=meta.num_prefix_tiles,
            )
            print(f"{name}: S={seq} tiles={meta.variable_block_sizes.numel()} P={meta.num_prefix_tiles} seed={seed}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
