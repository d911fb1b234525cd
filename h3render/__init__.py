"""h3render: batch renderer for MiniMax-H3 (joint video + stereo audio diffusion) to H.264/AAC MP4."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The wheel (and an editable install) map the repository's top-level kernels/ and presets/ to h3render.kernels and
# h3render.presets (pyproject.toml). A source checkout used without installing (`python scripts/bench.py` on the GPU
# machine) finds them the same way through this: the checkout's root joins the package's search path.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 (a package's __path__)
