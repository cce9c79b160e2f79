"""Processes this one starts die with it (Linux), so none outlives a trainer killed with SIGKILL.

    tie_forks()                        # from now on, forks of the main thread die with it
    manager = spawned_manager(ctx)     # a multiprocessing Manager whose server dies with us
                                       # (and only then: a group's SIGTERM leaves it alone)

megatron-core's dist_checkpointing writer forks one process per write bucket during a save (a
copy of the trainer: its memory, its open descriptors, its signal handlers) and keeps a
multiprocessing Manager, started with the spawn method, for the writers' results. A trainer
SIGKILLed during a save left them behind: the forked writer waiting forever for a parent that
was gone (SIGTERM did not stop it: it had the trainer's handler, which only sets a flag), the
Manager, and through them the resource tracker. `die_with_parent` asks the kernel to SIGKILL the
calling process when its parent dies (`prctl(PR_SET_PDEATHSIG)`); `tie_forks` has every process
forked from the main thread call it first thing, and `spawned_manager` starts a Manager whose
server calls it. The resource tracker is left alone: it exits by itself once every process
holding its pipe is gone, after cleaning up what they leaked.

The kernel sends the signal when the *thread* that forked exits, so only forks of the main
thread (which lives as long as the process) are tied; a fork from another thread is left as it
was. The forked children keep the trainer's signal handlers: a SIGTERM to the whole process
group (torchrun, schedulers) must not kill a writer in the middle of the save it asks for.
Elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from multiprocessing.managers import SyncManager

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_FORKS = {"tied": False, "parent": 0, "main_thread": False}


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (pid `parent`, the process that started it) dies;
    at once if it is gone already. A no-op elsewhere than Linux."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)  # the C library this process runs on
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _before_fork() -> None:
    _FORKS["parent"] = os.getpid()
    _FORKS["main_thread"] = threading.current_thread() is threading.main_thread()


def _in_forked_child() -> None:
    if _FORKS["main_thread"]:
        die_with_parent(_FORKS["parent"])


def tie_forks() -> None:
    """From now on, every process forked from this process's main thread (and, through the
    hook it inherits, from its children's) dies with its parent. Idempotent."""
    if not _FORKS["tied"]:
        os.register_at_fork(before=_before_fork, after_in_child=_in_forked_child)
        _FORKS["tied"] = True


def _serve_until_parent_dies(parent: int) -> None:
    """A Manager server's start: it dies with `parent` and ignores SIGTERM and SIGINT."""
    die_with_parent(parent)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawned_manager(ctx) -> SyncManager:
    """A started multiprocessing `SyncManager` of context `ctx` whose server process dies with
    this one (the thread calling this: call it from the main thread).

    The server ignores SIGTERM and SIGINT: a signal to the whole process group (torchrun's
    shutdown, `kill -- -PGID`, a scheduler's preemption) asks the trainer for a last save, and
    a server ended by it mid-save failed that save with 'Broken pipe'. It ends with the trainer
    (parent death), or at `shutdown()` (a message, then SIGKILL if it lingers)."""
    manager = SyncManager(ctx=ctx)
    manager.start(initializer=_serve_until_parent_dies, initargs=(os.getpid(),))
    return manager
