"""The run dir's lock: one process writes a run at a time (`run_dir/.lock`, flock'ed by rank 0).

    run_dir/.lock   "pid 1234 job train": the process holding the lock (its forks hold none and
                    die with it, moe.platform.children)

A second process is refused in one line naming a live holder: the pid the lock file names while
that process lives, else the live processes that have the lock file open (Linux /proc), with
their command lines. Claims in one process share the lock until the last release
(`megatron_gspo.run.rundir.claim_run_dir` takes it).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from megatron_gspo.errors import RunDirError

LOCK_FILE = ".lock"


# Locks this process holds, by real path: a second Trainer in one process (tests, a notebook)
# shares the lock; another process is refused.
_HELD: dict[str, list] = {}


@dataclass
class RunDirLock:
    path: str

    def release(self) -> None:
        held = _HELD.get(self.path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            os.close(held[0])  # closing the descriptor drops the flock
            del _HELD[self.path]


def _close_locks_in_child() -> None:
    """In a forked child: close the run-dir locks' descriptors (the parent keeps its lock; a
    child that outlived it would hold the lock on its behalf)."""
    for fd, _ in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


def lock_run_dir(run_dir: str, job: str) -> RunDirLock:
    """Lock run_dir for this process (its forks do not hold the lock)."""
    path = os.path.realpath(os.path.join(run_dir, LOCK_FILE))
    if path in _HELD:
        _HELD[path][1] += 1
        return RunDirLock(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"run_dir={run_dir} is being written by another process "
                          f"({_holder(path, owner)}); wait for it to finish or choose another "
                          "run_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} job {job}".encode())
    _HELD[path] = [fd, 1]
    return RunDirLock(path)


def _holder(path: str, owner: str) -> str:
    """Who holds the lock at `path`: `owner` (the lock file's "pid N job J") while that process
    lives; else the live processes that have the file open (Linux /proc), which a process forked
    by the owner may be (it inherits the lock)."""
    pid = owner.split()[1] if owner.startswith("pid ") and len(owner.split()) > 1 else ""
    if pid.isdigit() and _alive(int(pid)):
        return owner
    holders = "; ".join(f"pid {p}: {_command(p)}" for p in _processes_with_open(path))
    named = f"the lock file names {owner}, which has exited" if pid.isdigit() else \
        "the lock file names no owner"
    return f"{holders}; {named}" if holders else f"{owner}; no holder found"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    try:  # a zombie holds nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _processes_with_open(path: str) -> list[int]:
    """The pids (this one left out) with file `path` open, read from /proc; [] without it."""
    target = os.stat(path)
    found = []
    for entry in sorted(os.listdir("/proc"), key=lambda e: (len(e), e)) \
            if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                found.append(int(entry))
                break
    return found


def _command(pid: int) -> str:
    """The command line of `pid` (its first 120 characters), or '?'."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        return "?"
    return text[:120] + ("..." if len(text) > 120 else "") or "?"
