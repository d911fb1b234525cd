"""Per-job LoRA sets on a resident DiT, without reloading (issue #25 item 2): `LoraState.switch` moves the DiT from
the LoRA set it holds to the next job's, in one of two ways.

* ``fuse`` (exact fuse / unfuse): the first time a weight is touched its base value is copied to host memory;
  the weight becomes ``(base.fp32 + sum_i strength_i * up_i @ down_i).to(dtype)``, always computed from that copy,
  never from a previously fused value; a weight the next set leaves alone is copied back. The copies are kept
  across switches (host memory grows to the weights any set touched, at most the DiT's block linears). A job therefore sees
  exactly the weights a fresh load + fuse of its own set gives (bit-equal), and the base comes back bit-for-bit.
  No per-forward cost; a switch costs one rank-R GEMM and two copies per touched weight.
* ``side`` (un-fused side path): a forward hook on each touched linear adds ``(x @ down.T) @ up.T`` with the
  strengths and alpha/rank scales folded into ``up`` in fp32 and then cast to the linear's compute dtype. The
  weights are never written, so it works beside `models.fp8.Fp8Linear` (whose input is quantized e4m3 rows: the
  side path reads them dequantized, in bf16) and the switch is free; each forward pays two thin GEMMs and one
  extra read of x and of the output per touched linear.

Choice (``--lora-mode auto``): ``side`` with ``--precision fp8`` (the FP8 DiT holds no bf16 weight to fuse into;
re-quantizing per switch would need a bf16 copy of every touched weight), ``fuse`` otherwise. The estimate at the
release shape (1344x768x243 + 256 text rows: S = 73,642), a LoRA on every block linear, H200 (4.8 TB/s):

* side path, per forward: each linear reads x again and reads + writes its output once more for the add, 2 bytes
  each: per block S x (5376 + 7168 + 5376 + 14336) x 2 + S x (21504 + 5376 + 28672 + 5376) x 4 ≈ 22.7 GB, x 50
  blocks ≈ 1.1 TB ≈ 0.24 s per LoRA set: ≈ 6 % of the block GEMMs (3.76 s) and ≈ 1.5 % of the 15.66 s forward
  (docs/performance.md §1). A 49-forward base job pays it 49 times: ≈ 12 s.
* fuse, per switch: restore then rebuild 19.3 B weights (39 GB bf16): the pinned copies go back at PCIe speed
  (≈ 50 GB/s: ≈ 0.8 s) and the fp32 rebuild streams ≈ 12 bytes per weight on the device (≈ 0.05 s), ≈ 1-2 s.

So ``fuse`` for base jobs (≈ 12 s against 1-2 s, both small beside a ≈ 13 min job); for a 4-forward turbo job the
two are close (≈ 1 s each), and
the queue groups jobs by LoRA set (`h3render.runner.render_order`), so switches are few. `scripts/bench_lora.py`
measures both at that shape (docs/lora.md gives the command); these numbers are estimates until it has run.

The AdaLN projections (which build the per-schedule modulation tables) are linears like the others: both modes
change them, and the engine keys its cached tables by the LoRA set (`h3render.engine`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from h3render.checkpoint.adapter_checks import check_fused
from h3render.checkpoint.lora import LoraFile
from h3render.models.dit_config import DiTConfig

MODES = ("auto", "fuse", "side")


def resolve_mode(mode: str | None, precision: str) -> str:
    """``auto`` / None -> ``side`` for fp8, ``fuse`` otherwise (module docstring); ``fuse`` with fp8 is refused."""
    if mode in (None, "auto"):
        return "side" if precision == "fp8" else "fuse"
    if mode not in MODES:
        raise ValueError(f"--lora-mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "fuse" and precision == "fp8":
        raise ValueError("--lora-mode fuse cannot go with --precision fp8 (the FP8 DiT keeps no bf16 weights to fuse "
                         "into); use --lora-mode side or auto")
    return mode


def set_key(entries: Sequence[tuple[LoraFile, float]]) -> tuple[tuple[str, float], ...]:
    """The identity of a LoRA set: (file, scales, strength) in order, strength-0 entries dropped (they change
    nothing)."""
    return tuple((str(lora.path), hash(lora.scales), float(strength)) for lora, strength in entries if strength != 0)


class LoraState:
    """The LoRA set a resident DiT holds, and the means to switch it (module docstring).

    Args:
        dit: the loaded `models.dit.DiT` (nn.Linear or `Fp8Linear` block linears).
        config: its `DiTConfig`.
        mode: "fuse" or "side" (`resolve_mode`).
    """

    def __init__(self, dit: nn.Module, config: DiTConfig, mode: str):
        if mode not in ("fuse", "side"):
            raise ValueError(f"LoraState mode must be fuse or side, got {mode!r}")
        self.dit, self.config, self.mode = dit, config, mode
        self.key: tuple = ()
        # The part of `key` the AdaLN tables depend on: the set when it touches an AdaLN projection or the time
        # embedder (they build the tables), else () (the tables of the base weights serve).
        self.tables_key: tuple = ()
        # fuse: native weight name -> its base value (host memory, pinned on CUDA), kept across switches (the base
        # never changes, so a weight is copied out once; `reset_base` when it does: the FastH3 student fused in).
        self._base: dict[str, torch.Tensor] = {}
        self._fused: set[str] = set()  # the weights that hold a LoRA now
        self._hooks: dict[str, Any] = {}  # side: native module path -> hook handle
        self.seconds = 0.0  # time of the last switch
        self.switches = 0

    @torch.no_grad()
    def switch(self, entries: Sequence[tuple[LoraFile, float]]) -> bool:
        """Hold exactly ``entries`` ((LoRA file, strength), stacked: their products add). No-op when the set is
        the one held. Returns whether anything changed.

        Raises:
            LoraError: a file does not fit this DiT config, or its values are corrupt (the previous set is gone
                then: the DiT holds the base weights).
        """
        entries = [(lora, float(s)) for lora, s in entries if float(s) != 0]
        key = set_key(entries)
        if key == self.key:
            return False
        t0 = time.perf_counter()
        self.clear()
        deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        try:
            for lora, strength in entries:
                for param, (down, up) in lora.factors(self.config).items():
                    deltas.setdefault(param, []).append((down, up, strength))
            if self.mode == "fuse":
                self._fuse(deltas, entries)
            else:
                self._attach(deltas)
        except BaseException:
            self.clear()  # never half a set: the base weights, and a key that says so
            raise
        self.key = key
        self.tables_key = key if any(_builds_tables(p) for p in deltas) else ()
        self.switches += 1
        self.seconds = time.perf_counter() - t0
        return True

    def clear(self) -> None:
        """Back to the base weights: fused weights restored bit-for-bit from their copies, hooks removed."""
        params = dict(self.dit.named_parameters()) if self._fused else {}
        for name in self._fused:
            params[name].data.copy_(self._base[name], non_blocking=True)
        self._fused.clear()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.key = self.tables_key = ()

    def reset_base(self) -> None:
        """`clear`, then forget the base copies: the weights under them changed (a FastH3 student fused in place)."""
        self.clear()
        self._base.clear()

    def _fuse(self, deltas, entries) -> None:
        params = dict(self.dit.named_parameters())
        where = entries[0][0].path if entries else "LoRA"
        for name, parts in deltas.items():
            param = params.get(name)
            if param is None:
                raise ValueError(f"{where}: {name!r} is not a parameter of this DiT (an FP8 linear? use --lora-mode "
                                 f"side)")
            if name not in self._base:
                base = param.data.to("cpu", copy=True)
                self._base[name] = base.pin_memory() if param.device.type == "cuda" else base
            self._fused.add(name)
            weight = param.data.to(torch.float32, copy=True)  # the base: `switch` cleared the previous set
            for down, up, strength in parts:
                weight.addmm_(up.to(weight.device), down.to(weight.device), alpha=strength)  # [out, R] @ [R, in]
            check_fused(where, name, weight)
            param.data.copy_(weight.to(param.dtype))

    def _attach(self, deltas) -> None:
        for name, parts in deltas.items():
            module_path = name.removesuffix(".weight")
            module = self.dit.get_submodule(module_path)
            dtype = _compute_dtype(module)
            device = _device(module)
            down = torch.cat([d for d, _, _ in parts]).to(device=device, dtype=dtype)
            up = torch.cat([u * s for _, u, s in parts], dim=1).to(device=device, dtype=dtype)  # scales in fp32
            self._hooks[module_path] = module.register_forward_hook(_side_path(down, up))

    def record(self, entries: Sequence[tuple[LoraFile, float]]) -> list[dict]:
        """The sidecar's ``extra.loras``: one entry per LoRA of the job, as given (a strength-0 one included, with its
        strength 0)."""
        return [dict(lora.record(strength), mode=self.mode) for lora, strength in entries]


def _builds_tables(param: str) -> bool:
    """Whether a native weight takes part in building the AdaLN modulation tables."""
    return ".adaln_proj." in param or param.startswith(("time_embedder.", "adaln_basis."))


def _compute_dtype(module: nn.Module) -> torch.dtype:
    out_dtype = getattr(module, "out_dtype", None)  # Fp8Linear: writes bf16
    return out_dtype if out_dtype is not None else module.weight.dtype


def _device(module: nn.Module) -> torch.device:
    return module.weight.device


def _side_path(down: torch.Tensor, up: torch.Tensor):
    """The forward hook adding ``x @ down.T @ up.T`` ([S, in] -> [S, R] -> [S, out]) to a linear's output."""

    def hook(module, args, output):
        x = args[0]
        if not isinstance(x, torch.Tensor):  # `Fp8Rows` from a fused producer: the e4m3 rows, dequantized
            x = x.dequantize(output.dtype)
        d, u = (down, up) if down.device == x.device else (down.to(x.device), up.to(x.device))  # AdaLN visits
        side = torch.nn.functional.linear(torch.nn.functional.linear(x.to(d.dtype), d), u)
        return output + side.to(output.dtype)

    return hook
