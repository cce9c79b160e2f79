"""megatron_gspo.run.preempt: what a signal sets, how ranks agree on it, what a repeat or another
signal does, SIGHUP under nohup (a run preempted end to end, either job: test_lifetime.py)."""

import os
import signal
import subprocess
import sys

import pytest

from megatron_gspo import dist as dist_utils
from megatron_gspo.run.preempt import Preempted, Preemption

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_a_rank_stops_when_any_peer_was_signalled(monkeypatch):
    """Guards requested()'s all-reduce: a rank that got no signal still stops after the step
    in which a peer got one (MAX over ranks), else the ranks would hang in the next
    collective."""
    seen = []

    def peer_got_sigterm(value):
        seen.append(value)
        return max(value, int(signal.SIGTERM))

    monkeypatch.setattr(dist_utils, "max_over_ranks", peer_got_sigterm)
    stop = Preemption()
    assert stop.requested() == signal.SIGTERM and seen == [0]


def test_nothing_is_requested_before_a_signal_and_outside_the_main_thread():
    """A fresh Preemption requests nothing; entered off the main thread (where Python cannot
    install handlers) it leaves the handlers alone instead of raising."""
    import threading

    assert Preemption().requested() == 0
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def enter():
        with Preemption() as stop:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            seen["requested"] = stop.requested()

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert seen == {"handler": before, "requested": 0}
    assert signal.getsignal(signal.SIGTERM) is before


def test_preempted_carries_the_signal_number():
    e = Preempted(signal.SIGTERM, "stopped at rollout batch 2 of 3")
    assert e.signum == signal.SIGTERM and str(e) == "stopped at rollout batch 2 of 3"


def test_first_signal_arms_the_default_action_for_the_other_and_filters_its_copy():
    from megatron_gspo.run.preempt import Preemption

    # the handlers in force before (pytest's default_int_handler, or SIG_IGN when the suite
    # runs in the background under nohup) come back on exit
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the process must see the kill
    try:
        with Preemption() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.signum == signal.SIGINT and stop.requested() == signal.SIGINT
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the other one kills
            os.kill(os.getpid(), signal.SIGINT)  # a copy at once (torchrun's forward): ignored
            assert stop.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is before[1]
    finally:
        signal.signal(signal.SIGINT, before[0])


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter in the repository root (signals there cannot reach
    pytest)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60,
                          cwd=ROOT)


_SIGNAL_TWICE = """
import os, signal, sys, time
from megatron_gspo.run import preempt
with preempt.Preemption() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    stop._first_at -= float(sys.argv[1])  # as if that long had passed
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    print("saved", stop.requested())
"""


@pytest.mark.parametrize("later_s, survives", [(0.0, True), (2.5, False)])
def test_a_repeat_of_the_first_signal_exits_at_once_only_after_the_duplicate_window(
        later_s, survives):
    """torchrun forwards a SIGTERM its workers got already (a scheduler that signals every
    process of the job): that copy used to kill the worker before it saved. A repeat
    DUPLICATE_S (2 s) or more after the first still exits at once."""
    proc = _python(_SIGNAL_TWICE, str(later_s))
    if survives:
        assert proc.returncode == 0 and f"saved {int(signal.SIGTERM)}" in proc.stdout, proc
    else:
        assert proc.returncode == -signal.SIGTERM and "saved" not in proc.stdout, proc


_HANGUP = """
import os, signal, sys
from megatron_gspo.run import preempt
if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
with preempt.Preemption() as stop:
    print("handler", signal.getsignal(signal.SIGHUP) == stop._handle, flush=True)
    os.kill(os.getpid(), signal.SIGHUP)
    print("saved", stop.requested(), flush=True)
"""


@pytest.mark.parametrize("mode", ["terminal", "nohup"])
def test_a_closed_terminal_saves_and_nohup_stays_ignored(mode):
    """SIGHUP (an ssh session or terminal gone) ended a run without a checkpoint; it now stops
    it like SIGTERM. Under nohup SIGHUP stays ignored: the run goes on."""
    proc = _python(_HANGUP, mode)
    lines = [ln for ln in proc.stdout.splitlines() if ln]
    want = ["handler True", "SIGHUP received: stopping after this step and saving a checkpoint "
            "(send it again to exit at once)", "saved 1"] if mode == "terminal" else \
        ["handler False", "saved 0"]
    assert proc.returncode == 0 and lines == want, proc
