"""File-system helpers the config, checkpoint and export writers share (no torch)."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """`write(file)` into a tmp file next to `path` (`.NAME.*.tmp`, which a run dir's clean-up
    removes; created with the mode open() would give, not mkstemp's 0600), fsync, then
    os.replace and persist the rename: a reader sees the old file or the new one, never half of
    it. Whatever `write` or the file system raises propagates, and no tmp file is left."""
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(d)


def fsync_path(path: str) -> None:
    """Persist a file, or a folder's entries after a rename (best effort: not every OS or
    filesystem lets a folder be opened or synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask (read by setting it and back: os has no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
