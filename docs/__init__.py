"""The repository's docs/ folder as the data package `h3render.docs`: Markdown docs, the JSON schemas (schema/) and
the SLURM batch script, shipped in the wheel (pyproject.toml). `python -m h3render.docs` prints where they are."""
