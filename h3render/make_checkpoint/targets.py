"""Where `h3render make-checkpoint` would write, checked before anything is written and before torch is imported
(torch-free: a wrong OUT answers at once, not after the ~6 s import of the writer's modules)."""

from __future__ import annotations

from pathlib import Path


def check_extras(adapter: str | Path | None = None, bundle: str | Path | None = None,
                 out: str | Path | None = None) -> None:
    """The adapter file and bundle folder `make_checkpoint` would also write, refused before anything is written:
    the adapter a new file, the bundle a new or empty folder (as `check_output` holds OUT), neither of them OUT or
    inside it (a trial: `--adapter` naming the single-file checkpoint itself overwrote the DiT with the adapter).

    Raises:
        ValueError: the message names the path and what to do.
    """
    target = None if out is None else Path(out).resolve()
    for option, given in (("--adapter", adapter), ("--adapter-bundle", bundle)):
        if given is None or target is None:
            continue
        where = Path(given).resolve()
        if where == target or target in where.parents:
            raise ValueError(f"make-checkpoint: {option} {given} is {'OUT itself' if where == target else 'inside OUT'}"
                             f" ({out}); name a path outside the checkpoint")
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
    not be loaded, and for the same reason a folder layout must not be. Any layout: the path must be new, or an empty
    folder.

    Raises:
        ValueError: the message names the path and what to do.
    """
    out = Path(out_dir)
    if layout == "single-file" and out.suffix != ".safetensors":
        raise ValueError(f"make-checkpoint: {out_dir}: a single-file checkpoint must end in .safetensors "
                         f"(it is found by that suffix), e.g. {out.name}.safetensors")
    if layout != "single-file" and out.suffix == ".safetensors":
        raise ValueError(f"make-checkpoint: {out_dir}: a checkpoint folder cannot end in .safetensors (--checkpoint "
                         f"and --transformer read that suffix as a single-file DiT); e.g. {out.stem}")
    if out.exists() and (out.is_file() or any(out.iterdir())):
        what = "is a file" if out.is_file() else "is a folder that is not empty"
        raise ValueError(f"make-checkpoint: {out_dir} already exists and {what}; name a new "
                         f"{'file' if layout == 'single-file' else 'or empty folder'}")
    return out
