"""Preemption: SIGTERM (what schedulers send), Ctrl-C or SIGHUP (the terminal closed) stops a
run at the next safe point.

    with Preemption() as stop:
        for step in ...:
            ...one whole step...
            if stop.requested():          # every rank gets the same answer
                save(); raise Preempted(stop.signum, "...")

The first signal only sets a flag; the loop finishes its step, saves a checkpoint and raises
`Preempted`, which the CLI turns into a one-line message and exit status 128 + signal number
(the shell's convention for a signal, so `make` or a job script stops too). A second signal
ends the process at once: the other one at any moment (its handler is reset to the default at
the first), the same one from `DUPLICATE_S` seconds after the first. Sooner it is the same
event delivered twice: torchrun forwards a SIGTERM to its workers that a scheduler signalling
every process of the job has sent them too; exiting at that second copy lost the checkpoint
(measured: SIGTERM to torchrun, then 0.3 s later to its two EP workers: no checkpoint before,
one after). Under torchrun the save must end within its `--shutdown-timeout` (torch 2.13: 30 s
by default), after which it SIGKILLs the workers. Ranks may receive the signal at different
moments: `requested()` all-reduces it (MAX), so every rank stops after the same step. SIGHUP is
left alone where it is ignored already (`nohup`).

Before the loop (config, model build, dataset load, the first eval) there is no step to finish:
under `StartupSignals` the same signals raise `Interrupted` (a BaseException, as
KeyboardInterrupt is, so no `except Exception` swallows it) where the process is, which the CLI
turns into one line and exit status 128 + signal number; nothing is saved and nothing already
written is touched. `Preemption` replaces those handlers for the loop and puts them back after.
"""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
DUPLICATE_S = 2.0  # a repeat of the first signal sooner than this is the same event, twice


class Preempted(Exception):
    """The run stopped early on a signal after saving; `signum` is the signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Interrupted(BaseException):
    """A signal before the training loop started (under `StartupSignals`); `signum` is it."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} received during start-up: stopped "
                         "before training; nothing was saved and nothing already written changed")
        self.signum = signum


class StartupSignals:
    """SIGTERM / SIGINT / SIGHUP raise `Interrupted` inside the block (main thread only; SIGHUP
    stays ignored under nohup); the handlers before come back on exit."""

    def __init__(self) -> None:
        self._previous: dict = {}

    def _raise(self, signum, frame) -> None:
        raise Interrupted(signum)

    def __enter__(self) -> "StartupSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in SIGNALS}
            if self._previous[signal.SIGHUP] is signal.SIG_IGN:
                del self._previous[signal.SIGHUP]
            for s in self._previous:
                signal.signal(s, self._raise)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class Preemption:
    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict = {}  # the signals handled here -> their handlers before

    def _handle(self, signum, frame) -> None:
        self.signum, self._first_at = signum, time.monotonic()
        for s in self._previous:  # the other signals take the default action: exit at once
            signal.signal(s, self._repeat if s == signum else signal.SIG_DFL)
        print(f"\n{signal.Signals(signum).name} received: stopping after this step and saving "
              "a checkpoint (send it again to exit at once)", flush=True)

    def _repeat(self, signum, frame) -> None:
        """The first signal again: a copy (torchrun's forward) within DUPLICATE_S, else the
        default action (exit at once)."""
        if time.monotonic() - self._first_at < DUPLICATE_S:
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in SIGNALS}
            if self._previous[signal.SIGHUP] is signal.SIG_IGN:  # nohup: stays ignored
                del self._previous[signal.SIGHUP]
            for s in self._previous:
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self) -> int:
        """The signal number if any rank was signalled, else 0 (one all-reduce when
        distributed)."""
        # heavy import (torch): the CLI imports this module before any job, and `megatron-gspo
        # config` and argument errors answer without loading torch
        from megatron_gspo.dist import max_over_ranks

        return max_over_ranks(self.signum)
