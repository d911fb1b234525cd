"""Run scripts/*.py from a source checkout in which h3render is not installed (the GPU machine runs
`python scripts/bench.py` with only PYTHONPATH set): `import _bootstrap` before the first h3render import.

An installed h3render (a wheel, or `pip install -e .`) wins and nothing changes. Otherwise the checkout's root joins
`sys.path`, for `h3render` itself, and a finder maps `h3render.presets` to the checkout's top-level `presets/`
folder, as pyproject's `[tool.setuptools.package-dir]` does for the wheel and setuptools' editable finder does for
an editable install. The package itself knows nothing of checkouts.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> the checkout folder the wheel ships under that name (pyproject `[tool.setuptools.package-dir]`).
FOLDERS = {"h3render.presets": ROOT / "presets"}


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds `h3render.presets` in the checkout; last on `sys.meta_path`, so an installed
    h3render's own packages are found first. Their submodules then follow the package's `__path__` as usual."""

    def find_spec(self, name, path=None, target=None):
        folder = FOLDERS.get(name)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def install() -> None:
    """Make `import h3render` (and its presets) work from this checkout; idempotent."""
    if importlib.util.find_spec("h3render") is None:
        sys.path.insert(0, str(ROOT))
    if not any(isinstance(finder, CheckoutFolders) for finder in sys.meta_path):
        sys.meta_path.append(CheckoutFolders())


install()
