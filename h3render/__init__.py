"""h3render: batch renderer for MiniMax-H3 (joint video + stereo audio diffusion) to H.264/AAC MP4.

The repository's top-level `kernels/` and `presets/` folders are the subpackages `h3render.kernels` and
`h3render.presets` of an installed h3render (pyproject.toml `[tool.setuptools.package-dir]`, plain or editable
install); `scripts/_bootstrap.py` maps them the same way for a checkout that is not installed.
"""

__version__ = "0.1.0"
