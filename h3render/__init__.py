"""h3render: batch renderer for MiniMax-H3 (joint video + stereo audio diffusion) to H.264/AAC MP4.

The repository's top-level `presets/` folder is the subpackage `h3render.presets` of an installed h3render
(pyproject.toml `[tool.setuptools.package-dir]`, plain or editable install); `scripts/_bootstrap.py` maps it the
same way for a checkout that is not installed. The kernels are `h3render/kernels/` (not a top-level `kernels/`:
that name is a PyPI package, which transformers imports).
"""

__version__ = "0.1.0"
