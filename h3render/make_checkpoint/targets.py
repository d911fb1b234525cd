"""Where `h3render make-checkpoint` would write, checked before anything is written and before torch is imported
(torch-free: a wrong OUT answers at once, not after the ~6 s import of the writer's modules)."""

from __future__ import annotations

from pathlib import Path


def check_extras(adapter: str | Path | None = None, bundle: str | Path | None = None) -> None:
    """The adapter file and bundle folder `make_checkpoint` would also write, refused before anything is written:
    the adapter a new file, the bundle a new or empty folder (as `check_output` holds OUT).

    Raises:
        ValueError: the message names the path and what to do.
    """
    if adapter is not None:
        path = Path(adapter)
        if path.exists():
            raise ValueError(f"make-checkpoint: --adapter {adapter} already exists; name a new file")
    if bundle is not None:
        path = Path(bundle)
        if path.exists() and (path.is_file() or any(path.iterdir())):
            raise ValueError(f"make-checkpoint: --adapter-bundle {bundle} already exists and is not empty; name a "
                             f"new or empty folder")


def check_output(out_dir: str | Path, layout: str) -> Path:
    """The path `make_checkpoint` would write `layout` to, refused before anything is written.

    A "single-file" DiT must be named `*.safetensors`: `read_checkpoint_info` (hence `--checkpoint` and
    `--transformer`) tells a single file from a checkpoint folder by that suffix, so a file named otherwise could
    not be loaded. Any layout: the path must be new, or an empty folder.

    Raises:
        ValueError: the message names the path and what to do.
    """
    out = Path(out_dir)
    if layout == "single-file" and out.suffix != ".safetensors":
        raise ValueError(f"make-checkpoint: {out_dir}: a single-file checkpoint must end in .safetensors "
                         f"(it is found by that suffix), e.g. {out.name}.safetensors")
    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise ValueError(f"make-checkpoint: {out_dir} already exists and is not empty; name a new "
                         f"{'file' if layout == 'single-file' else 'or empty folder'}")
    return out
