"""Time the Triton kernels against their torch references, and the attention backends, at the released shapes.

Run on a GPU machine:  python scripts/bench_kernels.py [--seq 73642] [--skip-attention] [--check]
or import `check_kernels`, `bench_kernels`, `bench_attention` and `format_table` (scripts/bench.py does).

Shapes (released MiniMax-H3, 1344x768 x 243 frames, DESIGN.md §1): S = 73,642 packed rows, hidden C = 5376,
56 heads x 128 (RoPE on 96 dims), FFN 14336. Times are triton.testing.do_bench medians. GB/s counts the bytes a
kernel must read and write once (its minimum traffic); attention TFLOP/s counts 4 * S^2 * H * D.
"""

from __future__ import annotations

import argparse

import torch

import _bootstrap  # noqa: F401  (h3render from this checkout when it is not installed; scripts/ is sys.path[0])
from bench_common import rel_err
from h3render.kernels import gated_residual, modulate, qk_norm_rope_qkv, swiglu
from h3render.models import attention as attn_mod

RELEASED = dict(S=73_642, C=5376, H=56, D=128, R=96, F=14_336, K=2)


def _do_bench_ms(fn, rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _kernel_cases(S: int, C: int, H: int, D: int, R: int, F: int, K: int, device: str, dtype: torch.dtype, seed: int):
    """(name, call(use_triton) -> Tensor | tuple, bytes moved) for each kernel at one shape."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=device, generator=g)).to(dtype)

    elt = torch.finfo(dtype).bits // 8
    qkv = randn(S, H * 3 * D).view(S, H, 3, D)
    q_w, k_w = randn(D, scale=0.1) + 1, randn(D, scale=0.1) + 1
    angles = torch.rand(S, R // 2, device=device, generator=g) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()  # [S, R] fp32
    x, y = randn(S, C, scale=3.0), randn(S, C)
    norm_w = randn(C, scale=0.1) + 1
    table = randn(K * 3, 6, C, scale=0.5)  # [R, 6, C]
    row_index = torch.randint(0, K * 3, (S,), device=device, generator=g)
    h = randn(S, 2 * F, scale=2.0)
    return [
        ("qk_norm_rope_qkv", lambda t: qk_norm_rope_qkv(qkv, q_w, k_w, cos, sin, use_triton=t),
         2 * 3 * S * H * D * elt + 2 * S * R * 4),
        ("modulate", lambda t: modulate(x, norm_w, table[:, 0], table[:, 1], row_index, use_triton=t),
         2 * S * C * elt),
        ("gated_residual", lambda t: gated_residual(x, y, table[:, 2], row_index, use_triton=t), 3 * S * C * elt),
        ("swiglu", lambda t: swiglu(h, use_triton=t), 3 * S * F * elt),
    ]


def _max_rel_err(a, b) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(rel_err(x, y) for x, y in zip(a, b) if x is not None)


def check_kernels(device: str = "cuda", tol: float = 1e-2) -> list[dict]:
    """Compiled Triton vs torch reference on odd shapes (S = 1, 37, 129; C not a power of two), bf16 and fp32.

    Returns:
        One row per (kernel, shape, dtype) with its relative error.

    Raises:
        AssertionError: a relative error exceeds `tol` (bf16) or 1e-5 (fp32), or an output holds NaN.
    """
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for S, C, H, D, R, F in ((1, 7, 1, 8, 6, 1), (37, 1000, 3, 40, 24, 45), (129, 5376, 56, 128, 96, 2500)):
            for name, call, _ in _kernel_cases(S, C, H, D, R, F, 2, device, dtype, seed=S):
                ours, ref = call(True), call(False)
                err = _max_rel_err(ours, ref)
                limit = 1e-5 if dtype == torch.float32 else tol
                assert err <= limit, f"{name} S={S} {dtype}: rel err {err:.2e} > {limit}"
                rows.append(dict(kernel=name, S=S, dtype=str(dtype).replace("torch.", ""), rel_err=f"{err:.1e}"))
    return rows


def bench_kernels(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, **shape) -> list[dict]:
    """Median time of each Triton kernel and its torch reference at the released shape (overridable by keyword).

    Returns:
        One row per kernel: triton_ms, naive_ms, speedup, GB/s of the Triton kernel, rel_err vs the reference.
    """
    dims = {**RELEASED, **shape}
    rows = []
    for name, call, nbytes in _kernel_cases(**dims, device=device, dtype=dtype, seed=0):
        err = _max_rel_err(call(True), call(False))
        t_ms = _do_bench_ms(lambda: call(True))
        n_ms = _do_bench_ms(lambda: call(False))
        rows.append(dict(kernel=name, S=dims["S"], triton_ms=f"{t_ms:.3f}", naive_ms=f"{n_ms:.3f}",
                         speedup=f"{n_ms / t_ms:.1f}x", triton_GBps=f"{nbytes / t_ms / 1e6:.0f}", rel_err=f"{err:.1e}"))
        torch.cuda.empty_cache()
    return rows


def bench_attention(S: int = RELEASED["S"], H: int = RELEASED["H"], D: int = RELEASED["D"],
                    backends=("sdpa", *(n for n in attn_mod.REGISTRY if n != "sdpa"))) -> list[dict]:
    """One attention layer ([1, S, H, D] bf16) per backend, "sdpa" (the reference) first; a backend that cannot run
    here gets a note, not a crash.

    Returns:
        One row per backend: seconds, TFLOP/s (4 * S^2 * H * D flops), rel_err vs default SDPA, or a note.
    """
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * S * S * H * D
    previous = attn_mod._selected
    rows, ref = [], None
    try:
        for name in backends:
            try:
                attn_mod.select_backend(name)
                out = attn_mod.attention(q, k, v)
            except (ValueError, RuntimeError) as exc:
                rows.append(dict(backend=name, seconds="-", TFLOPs="-", rel_err="-", note=str(exc)[:80]))
                continue
            ref = out if ref is None else ref
            err = rel_err(out, ref)
            del out
            seconds = _do_bench_ms(lambda: attn_mod.attention(q, k, v), rep_ms=1000) / 1e3
            rows.append(dict(backend=name, seconds=f"{seconds:.4f}", TFLOPs=f"{flops / seconds / 1e12:.0f}",
                             rel_err=f"{err:.1e}", note=""))
    finally:
        attn_mod._selected = previous
    return rows


def format_table(rows: list[dict]) -> str:
    """Plain-text table with one column per key of the first row."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(str(r.get(k, ""))) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys), "  ".join("-" * widths[k] for k in keys)]
    lines += ["  ".join(str(r.get(k, "")).ljust(widths[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=RELEASED["S"], help="packed rows S (default: released 73,642)")
    parser.add_argument("--check", action="store_true", help="first compare Triton vs torch on odd shapes")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.check:
        print(format_table(check_kernels()), end="\n\n")
    if not args.skip_kernels:
        print(format_table(bench_kernels(S=args.seq)), end="\n\n")
    if not args.skip_attention:
        print(format_table(bench_attention(S=args.seq)))


if __name__ == "__main__":
    main()
