"""Preemption: SIGTERM (what schedulers send) or Ctrl-C stops a run at the next safe point.

    with Preemption() as stop:
        for step in ...:
            ...one whole step...
            if stop.requested():          # every rank gets the same answer
                save(); raise Preempted(stop.signum, "...")

The first signal only sets a flag; the loop finishes its step, saves a checkpoint and raises
`Preempted`, which the CLI turns into a one-line message and exit status 128 + signal number
(the shell's convention for a signal, so `make` or a job script stops too). The handlers are
reset to the default at the first signal, so a second one ends the process at once. Ranks may
receive the signal at different moments: `requested()` all-reduces it (MAX), so every rank stops
after the same step.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped early on a signal after saving; `signum` is the signal."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class Preemption:
    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for s in SIGNALS:  # a second signal takes the default action: exit at once
            signal.signal(s, signal.SIG_DFL)
        print(f"\n{signal.Signals(signum).name} received: stopping after this step and saving "
              "a checkpoint (send it again to exit at once)", flush=True)

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self) -> int:
        """The signal number if any rank was signalled, else 0 (one all-reduce when
        distributed)."""
        from megatron_gspo.dist_utils import max_over_ranks

        return max_over_ranks(self.signum)
