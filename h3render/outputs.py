"""Where a job's files go and whether they are current: output, temp and lock paths, the resume check, the out dir.

Torch-free (the front end's `--dry-run` plan uses it); the MP4 record check imports `h3render.timing` when a record
is there to check.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from h3render.exits import UsageError
from h3render.sidecar import SidecarUnreadable, media_mismatch, read_sidecar



class BatchUsageError(UsageError):
    """A usage error found before anything renders (exit 2, one line): two jobs share an output, a bad out dir."""


class JobPathError(OSError):
    """A job's folder cannot be used: a file in its way, or a symlinked folder leading out of the out dir."""


def output_paths(out_dir: Path, job) -> tuple[Path, Path]:
    """Final ``(mp4, sidecar)`` paths of a job: ``<out_dir>/<job.output>.mp4`` and ``.json``."""
    base = Path(out_dir) / job.output
    return base.with_name(base.name + ".mp4"), base.with_name(base.name + ".json")


# The temp namespace: every temp name of a job is its final name with TEMP_MARK inserted or appended, and no output
# may end in it (`jobs.output_path_problem`), so no job's final name is ever another job's temp name (a job "b.tmp"
# would finish as b's temp "b.tmp.mp4" and be deleted by b's claim and sweep). tests/unit/test_output_names.py
# holds the writers (media.temp_path_for, sidecar.write_sidecar) to these names.
TEMP_MARK = ".tmp"


def temp_paths(mp4: Path, sidecar: Path) -> tuple[Path, ...]:
    """The temp names a job's final files pass through: ``<name>.tmp.mp4`` (media.Mp4Writer), and for the
    sidecar both ``<name>.json.tmp`` (sidecar.write_sidecar) and ``<name>.tmp.json``. Written only by the holder
    of the job's lock."""
    return (mp4.with_name(mp4.stem + TEMP_MARK + ".mp4"), sidecar.with_name(sidecar.name + TEMP_MARK),
            sidecar.with_name(sidecar.stem + TEMP_MARK + ".json"))


def lock_path(mp4: Path) -> Path:
    """``<name>.lock`` beside the job's MP4: held while the job renders (`h3render.locks`)."""
    return mp4.with_name(mp4.stem + ".lock")


def render_reason(job, mp4: Path, sidecar: Path, *, overwrite: bool = False, since_ns: int | None = None
                  ) -> str | None:
    """Why the job must be rendered ("overwrite", "no MP4", "no sidecar", "sidecar unreadable", "parameters
    changed (seed, keyframes)" naming the job fields that differ, "MP4 empty", or an MP4 that is not the one its
    sidecar records: `h3render.sidecar.media_mismatch`), or None when its outputs are complete and were rendered
    with ``job.params()`` (skip it).

    With `overwrite` and `since_ns` (when this queue started, `time.time_ns()`): outputs complete and current whose
    MP4 was put in place since then (its inode change time: the writer renames the MP4 there) count as rendered,
    by another queue of the same run on this out dir (two `--overwrite` queues rendered every job twice, a trial
    found). A timestamp that runs ahead of this host's clock (a shared filesystem's server) could make an output
    renamed just before the queue started count too.
    """
    if overwrite:
        try:
            fresh = since_ns is not None and mp4.stat().st_ctime_ns >= since_ns
        except OSError:
            fresh = False
        return render_reason(job, mp4, sidecar) and "overwrite" if fresh else "overwrite"
    try:  # is_file() raises for a name the OS refuses (ENAMETOOLONG: out dir + output over PATH_MAX)
        if not mp4.is_file():
            return "no MP4"
        if not sidecar.is_file():
            return "no sidecar"
    except OSError as exc:  # rendered, the job then fails alone naming the path; the queue goes on
        return f"cannot check its files: {exc.strerror or exc}"
    try:
        doc = read_sidecar(sidecar)
        recorded = doc["job"]
    except (SidecarUnreadable, KeyError):
        return "sidecar unreadable"
    # Round-trip through JSON so tuples compare equal to the lists the sidecar holds.
    now = json.loads(json.dumps(job.params()))
    if recorded != now:  # named, as resume's "skipped" line names what differs ("parameters changed (seed)")
        keys = sorted(k for k in {*recorded, *now} if recorded.get(k) != now.get(k)) if isinstance(recorded, dict) \
            else []
        return "parameters changed" + (f" ({', '.join(keys)})" if keys else "")
    record = doc.get("mp4")
    if record is None:  # a sidecar written before the MP4 record existed: only an empty MP4 can be told
        try:
            return "MP4 empty" if mp4.stat().st_size == 0 else None
        except OSError:
            return "no MP4"
    return media_mismatch(mp4, record)


def existing_outputs_problem(mp4: Path, sidecar: Path) -> str | None:
    """Why `h3render prompt -o` may not write `mp4` and its `sidecar` without --overwrite: something stands at
    either name (an earlier render, a symlink, dangling or not), which the final rename would replace; or None."""
    taken = [str(p) for p in (mp4, sidecar) if os.path.lexists(p)]
    if not taken:
        return None
    them = "it" if len(taken) == 1 else "them"
    return (f"{' and '.join(taken)} already exist{'s' * (len(taken) == 1)}; pass --overwrite to replace {them} "
            f"(once the new render is complete), or choose another -o")


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create the out dir (and its parents).

    Raises:
        BatchUsageError: naming the component in the way: a file, a broken or a looping symlink.
    """
    out_dir = Path(out_dir)
    problem = blocker(out_dir)
    if problem is not None:
        raise BatchUsageError(f"--out-dir {out_dir}: {problem}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BatchUsageError(f"--out-dir {out_dir}: cannot create it: {exc.strerror or exc}") from None
    return out_dir


def blocker(folder: Path) -> str | None:
    """What stops `folder` from being (or becoming, by mkdir) a folder: its nearest existing ancestor-or-self is a
    file or a dangling/looping symlink; None when nothing does."""
    for p in (folder, *folder.parents):
        if not os.path.lexists(p):
            continue
        if p.is_dir():
            return None
        if p.is_symlink():
            try:
                os.stat(p)
            except OSError as exc:
                what = "a symlink loop" if exc.errno == errno.ELOOP else f"a broken symlink (to {os.readlink(p)})"
                return f"{p} is {what}"
        return f"{p} is a file, not a folder"
    return None


def path_problem(mp4: Path, sidecar: Path, out_real: Path) -> str | None:
    """Why a job's MP4 and sidecar cannot be written where they go (the message names the path), or None: the
    folder resolves outside the out dir (`out_real`, resolved; a symlinked folder), something blocks the folder
    (`blocker`), or a folder stands at an output name. Checked by the queue before each render (`batch._Attempt`)
    and by `--dry-run` (`dry_run.plan_lines`), so a dry run names the jobs a real run would fail."""
    folder = mp4.parent
    try:
        real = folder.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop, before Python 3.13
        return f"{folder}: cannot resolve the job's folder: {exc}"
    if real != out_real and out_real not in real.parents:
        return (f"{folder}: the job's folder leads out of the out dir {out_real} (it resolves to {real}: a symlinked "
                "folder); nothing is written outside the out dir")
    problem = blocker(folder)
    if problem is not None:
        return f"cannot create the job's folder {folder}: {problem}"
    for final in (mp4, sidecar):  # found before the render, not by the rename after it
        if final.is_dir():
            return f"{final}: a folder stands at the job's output name; nothing can be written there"
    return None


def make_folders(folder: Path) -> list[Path]:
    """Make `folder` and its missing parents, as ``mkdir(parents=True, exist_ok=True)``; returns the ones this call
    made, outermost first, for `remove_empty_folders` (one another process made meanwhile is not ours).

    Raises:
        OSError: as ``Path.mkdir`` (a file in the way, no permission).
    """
    missing = []
    probe = folder
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    made = []
    for path in reversed(missing):
        try:
            path.mkdir()
            made.append(path)
        except FileExistsError:
            pass  # made meanwhile by another queue (or something else in the way: the call below says what)
    folder.mkdir(parents=True, exist_ok=True)
    return made


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove each of `folders` (the ones `make_folders` made for a job that wrote nothing) that is still empty,
    innermost first: an interrupted job left `out/shots/deep/` behind empty (a trial). ``rmdir`` never removes a
    folder with anything in it, so another job's or another process's files there keep it, and its parents."""
    for path in reversed(folders):
        try:
            path.rmdir()
        except OSError:
            return  # not empty (or gone): what holds it holds its parents too
