"""Running scripts/bench.py's `main` in the test process: the CPU smoke runs of its stages."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_bench(argv: list[str], out: Path) -> list[dict]:
    """`python scripts/bench.py ARGV --out OUT` in this process, with one intra-op thread (the two CI cores are
    shared: tiny ops spin-wait for each other's threads with more); every row it wrote to `out`."""
    sys.path.insert(0, str(SCRIPTS))
    saved_argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = ["bench.py", *argv, "--out", str(out)]
    torch.set_num_threads(1)
    try:
        import bench

        bench.RESULTS.clear()
        bench.main()
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)
        sys.path.remove(str(SCRIPTS))
    return json.loads(Path(out).read_text())


@contextlib.contextmanager
def script_module(name: str):
    """scripts/NAME.py imported, with scripts/ on sys.path while the block runs (its own imports are siblings)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))
