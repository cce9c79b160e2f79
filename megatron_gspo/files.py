"""File-system helpers the config, checkpoint and export writers share (no torch)."""

from __future__ import annotations

import os


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
