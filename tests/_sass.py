"""Hopper machine code of our Triton kernels, compiled on a machine without a GPU, and one check on it: whether a
K loop writes a register that an in-flight warpgroup MMA still reads its A operand from.

`wgmma.mma_async` reads its register operand asynchronously: the registers must not change until a
`wgmma.wait_group` (SASS `WARPGROUP.DEPBAR.LE gsb0, k`) has retired that MMA. Triton 3.6, the device's, pipelines a
loop's MMAs one commit group each with `DEPBAR.LE 7`, so up to seven run into the next iteration, and ptxas places the
next iteration's loads into their A registers (docs/performance.md §32.3: wrong sums on an H200). The check simulates
the loop body twice in program order: each `HGMMA` / `IGMMA` joins the open group, one carrying `gsb0` closes it, a
`DEPBAR.LE k` retires all but the k newest groups, and any other instruction whose destination is an A register of an
issued MMA not yet retired is reported. Predicates are ignored (a predicated wait counts as taken).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

_MMA = re.compile(r"[HI]GMMA\.\S+ R\d+, R(\d+),")


def _code(sass: str) -> list[tuple[int, str]]:
    """(address, instruction without its predicate) for every SASS instruction."""
    return [(int(a, 16), re.sub(r"^@!?U?P\w+\s+", "", t.strip()))
            for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _written(instruction: str) -> set[int]:
    """The general registers an instruction writes (its first operand, widened for .64 / .128 / .WIDE forms)."""
    m = re.match(r"(\S+)\s+R(\d+)\b", instruction)
    if not m or "GMMA" in m[1]:
        return set()
    op = m[1]
    if ".128" in op or (op.startswith("LDSM") and op.endswith(".4")):
        width = 4
    elif ".64" in op or ".WIDE" in op or op.startswith("CS2R") or (op.startswith("LDSM") and op.endswith(".2")):
        width = 2
    else:
        width = 1
    return set(range(int(m[2]), int(m[2]) + width))


def _mma_loops(sass: str):
    """The instructions of each loop (head to its branch back) that contains warpgroup MMAs, in program order."""
    code = _code(sass)
    for addr, text in code:
        back = re.search(r"BRA 0x([0-9a-f]+)", text)
        if back and int(back[1], 16) < addr:
            body = [t for a, t in code if int(back[1], 16) <= a <= addr]
            if any("GMMA" in t for t in body):
                yield body


def a_register_hazards(sass: str) -> list[str]:
    """Instructions of a loop that contains warpgroup MMAs which write an in-flight MMA's A registers (empty: none)."""
    found = []
    for body in _mma_loops(sass):
        in_flight: list[set[int]] = []
        open_group: set[int] = set()
        for _ in range(2):  # the second pass starts with what the first left in flight: the loop's back edge
            for t in body:
                if t.startswith("WARPGROUP.DEPBAR.LE"):
                    keep = int(re.search(r"0x([0-9a-f]+)", t)[1], 16)
                    in_flight = in_flight[max(0, len(in_flight) - keep):] if keep else []
                elif "GMMA" in t.split(" ")[0]:
                    if m := _MMA.match(t):
                        open_group |= set(range(int(m[1]), int(m[1]) + 4))
                    if "gsb0" in t:
                        in_flight.append(open_group)
                        open_group = set()
                elif any(_written(t) & group for group in (*in_flight, open_group)):  # committed or not: reading
                    found.append(t)
    return found


def waits_for_all_before_loading(sass: str) -> bool:
    """Whether the first K loop with warpgroup MMAs retires all of them (`DEPBAR.LE gsb0, 0x0`) before its first
    shared-memory load: `_wgmma_drain`'s mark, whatever the Triton version does around it."""
    for body in _mma_loops(sass):
        first = next(t for t in body if t.startswith(("LDS", "WARPGROUP.DEPBAR.LE gsb0, 0x0")))
        return first.startswith("WARPGROUP.DEPBAR")
    raise ValueError("no loop with warpgroup MMAs in this SASS")


def compile_sass(script: str, *args: str) -> str:
    """Run `script` (which prints SASS) in a child Python with Triton compiling for real: this process may run
    Triton's interpreter (TRITON_INTERPRET=1), which compiles nothing."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


# Shared head of the child scripts: compile `fn` for sm_90a with `signature` / `constexprs` / `options` and print the
# SASS from Triton's own ptxas and cuobjdump.
_COMPILE = """
import subprocess, sys, tempfile
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor


def desc(dtype, shape, block):
    return mangle_type(TensorDescriptor.from_tensor(torch.empty(*shape, dtype=dtype), block))


def sass(fn, types, constexprs, options, arch=90):
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                 for n in fn.arg_names}
    src = ASTSource(fn, signature, {(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
"""

FP8_WEIGHT_GEMM = _COMPILE + """
from h3render.kernels.fp8_weight import triton_impl as ti

decode, drain, arch = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]) if len(sys.argv) > 3 else 90
x = torch.float16 if decode == 2 else torch.bfloat16
print(sass(ti._wfp8_kernel,
           {"x_ptr": "*fp16" if decode == 2 else "*bf16", "w_ptr": "*u8", "y_ptr": "*bf16",
            "desc_x": desc(x, (256, 512), [128, 128]), "desc_w": desc(torch.uint8, (256, 512), [64, 128])},
           {"HAS_BIAS": False, "PARTIAL": False, "BLOCK_N": 64, "BLOCK_T": 128, "BLOCK_K": 128, "DECODE": decode,
            "TMA": True, "DRAIN": drain, "UPCAST": False},
           {"num_warps": 4, "num_stages": 3}, arch))
"""

VSA_FINE_TMA = _COMPILE + """
from h3render.kernels.vsa import triton_hopper

int8 = sys.argv[1] == "1"
print(sass(triton_hopper._fine_tma_kernel,
           {"q_ptr": "*bf16", "o_ptr": "*bf16", "gate_ptr": "*bf16", "row_of_slot_ptr": "*i32", "sizes_ptr": "*i32",
            "sel_ptr": "*i32", "scale_log2": "fp32",
            "desc_k": desc(torch.int8 if int8 else torch.bfloat16, (640, 7168), [64, 128]),
            "desc_v": desc(torch.bfloat16, (640, 7168), [64, 128])},
           {"HEAD_DIM": 128, "TILE_ROWS": 64, "GATE": True, "IEEE": False, "UPCAST": False, "QK_INT8": int8,
            "LONG_FIRST": True},
           {"num_warps": 4, "num_stages": 2, "maxnreg": 168}))
"""
