"""Per-job OS file locks, so that two queues sharing an out dir never render, sweep or commit the same job at once.

A lock is ``flock(LOCK_EX | LOCK_NB)`` on a small file (``<out_dir>/<output>.lock`` for a job). The kernel drops it
when its holder exits in any way, SIGKILL included, so a later run picks up what a dead holder left: the lock
file may stay behind, but nobody holds it. The holder writes ``<host> <pid>`` into the file, for messages.

Releasing unlinks the file while still holding it. Another process may have opened that file just before the
unlink and lock it just after; it then finds that the path no longer names the file it locked (gone, or another
inode) and tries again, so at most one process ever holds the lock of a path.

flock works on local filesystems and on NFS (Linux maps it to byte-range locks there); a filesystem that refuses
it (Lustre mounted without ``-o flock``) raises `LockUnsupported`, and the queue then runs unlocked, saying so.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LockUnsupported(OSError):
    """The filesystem does not support flock."""


class FileLock:
    """An acquired lock; `release` gives it back and removes the file. Not reentrant."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def try_acquire(cls, path: str | os.PathLike) -> "FileLock | None":
        """The lock of `path` (created if missing), or None when another live process holds it.

        Raises:
            LockUnsupported: the filesystem refuses flock.
            OSError: the file cannot be created or opened (its message names the path).
        """
        path = Path(path)
        while True:
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except OSError as exc:
                os.close(fd)
                if exc.errno in _UNSUPPORTED:
                    raise LockUnsupported(exc.errno, f"{path}: file locks are not supported here: {exc.strerror}")
                raise OSError(exc.errno, f"{path}: cannot lock: {exc.strerror}") from None
            try:
                same = os.lstat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released (unlinked) by its previous holder between our open and flock
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
            except OSError:
                pass  # a full disk: the lock holds all the same, only the holder's name is missing
            return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock; safe to call twice."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass  # already gone, or a read-only folder: an unheld lock file is harmless
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file without following a link: a symlink planted at the lock's name is removed
    (the name is ours: no lock is ever a symlink), so the truncate and write that follow never reach a file
    outside the out dir. A hard link or a non-regular file there is refused, naming the path.

    Raises:
        OSError: the file cannot be created or opened, or is not a plain file of its own.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP and os.path.islink(path):  # O_NOFOLLOW met a symlink
                os.unlink(path)
                continue
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise OSError(errno.EEXIST, f"{path}: cannot lock: the lock file is {what}; remove it")
        return fd


def holder(path: str | os.PathLike) -> str:
    """Who holds the lock at `path`, for messages: "pid 4242 on gpu-node-17", or "another process"."""
    try:
        host, pid = Path(path).read_text(encoding="utf-8").split()
    except (OSError, ValueError, UnicodeDecodeError):
        return "another process"
    return f"pid {pid} on {host}"
