"""`python -m h3render.docs`: where the documentation, the sidecar and batch-report JSON schemas and the SLURM batch
script are on this machine, so that `--help`'s "docs/sidecar.md" can be found from a wheel install too.

The repository's docs/ folder is shipped in the wheel as the data package `h3render.docs` (pyproject.toml), with
scripts/h3render.sbatch beside the Markdown files (docs/h3render.sbatch is a link to it in the checkout).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def shipped_files() -> list[Path]:
    """The documentation (*.md), the JSON schemas (schema/*.json) and the SLURM batch script, sorted."""
    found = [*HERE.glob("*.md"), *HERE.glob("schema/*.json"), HERE / "h3render.sbatch"]
    return sorted(path for path in found if path.is_file())


def main() -> None:
    print(f"h3render documentation: {HERE}")
    for path in shipped_files():
        print(f"  {path.relative_to(HERE)}")


if __name__ == "__main__":
    main()
