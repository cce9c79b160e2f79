"""moe.platform.children: a Manager server that a process-group SIGTERM leaves alone, and that still dies
with the process that started it."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

from moe.platform.children import spawned_manager

ROOT = __file__.rsplit("/tests/", 1)[0]


def wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    """Whether process `pid` is gone (or a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_sigterm_to_the_manager_server_leaves_its_queue_working():
    """torchrun's shutdown signals the worker's whole process group: the Manager serving
    megatron's checkpoint-writer results died with it, and the last save the signal asks for
    failed with 'Broken pipe' when the signal came during a save."""
    manager = spawned_manager(mp.get_context("spawn"))
    try:
        queue = manager.Queue()
        os.kill(manager._process.pid, signal.SIGTERM)
        time.sleep(0.5)  # a default handler ends the server well within this
        queue.put(7)
        assert queue.get(timeout=5) == 7
    finally:
        manager.shutdown()
    assert not manager._process.is_alive()


def test_the_manager_server_dies_with_its_parent():
    """The server outlived a SIGKILLed trainer (and held the resource tracker) before it was
    tied to its parent; ignoring SIGTERM must not undo that."""
    code = ("import multiprocessing as mp, sys\n"
            "from moe.platform.children import spawned_manager\n"
            "m = spawned_manager(mp.get_context('spawn'))\n"
            "print(m._process.pid, flush=True)\n"
            "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        server = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=30)
        assert wait_gone(server)
    finally:
        if parent.poll() is None:
            parent.kill()
