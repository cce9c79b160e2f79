"""megatron_gspo.run.preempt: what a signal sets and how ranks agree on it (the handlers end to end
are in test_faults.py)."""

import signal

from megatron_gspo import dist as dist_utils
from megatron_gspo.run.preempt import Preempted, Preemption


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
