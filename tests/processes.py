"""Child processes of the tests: a command started in its own session (torchrun and its workers,
a trainer and its engines) that a hang must not outlive."""

from __future__ import annotations

import os
import signal
import subprocess


def communicate_or_kill(proc: subprocess.Popen, timeout: float):
    """`proc.communicate(timeout=timeout)`; past the timeout its whole session is SIGKILLed
    (it was started with start_new_session=True) and TimeoutExpired fails the test."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
