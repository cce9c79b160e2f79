"""Trainer pieces without a model: the run loop's eval / save / preemption decisions on a stub
(its `iteration` only counts), and the metric helpers on hand-made batches."""

import os
import signal
from types import SimpleNamespace

import pytest

from megatron_gspo.config import load_config
from tests.megatron_gspo.test_trainer import BASE


class LoopStub:
    """What `Trainer.train` touches, recording the order of evals, iterations, logs and saves;
    `signal_at` sends this process SIGTERM during that iteration (0-based)."""

    def __init__(self, *overrides, iteration=0, signal_at=None):
        from megatron_gspo.trainer import Trainer, TrainerState

        self.cfg = load_config(None, [*BASE, *overrides])
        self.state = TrainerState(iteration=iteration)
        self.events, self.signal_at = [], signal_at
        self.rt = SimpleNamespace(info=SimpleNamespace(is_main=False),
                                  close=lambda: self.events.append("close"))
        self.should_save = lambda it: Trainer.should_save(self, it)

    def evaluate(self):
        self.events.append(("eval", self.state.iteration))
        return {"eval/accuracy": 0.5}

    def iteration(self):
        it = self.state.iteration
        self.events.append(("iter", it))
        if it == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.state.iteration = it + 1
        return {"reward/mean": float(it)}

    def _log(self, step, metrics):
        self.events.append(("log", step))


def run_loop(monkeypatch, stub):
    from megatron_gspo import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "save_state",
                        lambda rt, it, extra: stub.events.append(("save", it)))
    return trainer_mod.Trainer.train(stub)


def test_iteration_zero_eval_runs_on_a_fresh_run_only(monkeypatch):
    """The initial policy's eval is logged once, before the first rollout batch: a run resumed
    past iteration 0 does not evaluate (and log) it again."""
    fresh = LoopStub("train.steps=2", "train.eval_every=5", "train.save_every=0")
    assert run_loop(monkeypatch, fresh) == {"reward/mean": 1.0}
    assert fresh.events == [("eval", 0), ("log", 0), ("iter", 0), ("iter", 1), "close"]
    resumed = LoopStub("train.steps=2", "train.eval_every=5", "train.save_every=0",
                       iteration=1)
    run_loop(monkeypatch, resumed)
    assert resumed.events == [("iter", 1), "close"]
    no_eval = LoopStub("train.steps=1", "train.eval_every=0", "train.save_every=0")
    run_loop(monkeypatch, no_eval)
    assert no_eval.events == [("iter", 0), "close"]


def test_signal_at_the_last_rollout_batch_saves_and_finishes_without_preempted(monkeypatch):
    """A signal during the final rollout batch saves it and returns normally (the run is
    done, nothing to resume); one earlier saves and raises Preempted."""
    from megatron_gspo.preempt import Preempted

    last = LoopStub("train.steps=2", "train.save_every=0", signal_at=1)
    assert run_loop(monkeypatch, last) == {"reward/mean": 1.0}
    assert last.events == [("iter", 0), ("iter", 1), ("save", 2), "close"]
    early = LoopStub("train.steps=3", "train.save_every=0", signal_at=0)
    with pytest.raises(Preempted, match="stopped at rollout batch 1 of 3"):
        run_loop(monkeypatch, early)
    assert early.events == [("iter", 0), ("save", 1), "close"]
