"""h3render: batch renderer for MiniMax-H3 (joint video + stereo audio diffusion) to H.264/AAC MP4."""

__version__ = "0.1.0"
