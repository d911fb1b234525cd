"""Environment for the subprocesses tests start: the checkout first on PYTHONPATH, whatever was there kept after it
(on the GPU machine the carried wheels come through PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
