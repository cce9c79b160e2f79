"""The run loop (megatron_gspo.run.loop) on a stub job whose step only counts: the order of its
evals, steps, logs and saves, preemption, "already finished", the accuracy band's verdicts and
each job's schedule. The same loop on the real jobs: test_lifetime.py."""

import os
import signal
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs import rl, sft
from megatron_gspo.run import loop
from megatron_gspo.run.preempt import Preempted

BASE = ["train.eval_every=0", "train.save_every=1"]
SCHEDULES = {"rl": rl.schedule, "sft": sft.schedule}
STEPS = {"rl": "train.steps", "sft": "sft.steps"}


@dataclass
class CountState:
    done: int = 0

    log_step = property(lambda self: 10 * self.done)  # optimizer steps: 10 per step here

    def to_checkpoint(self) -> dict:
        return {"done": self.done}


class NoBand:
    def update(self, step, accuracy):
        return False

    def record(self):
        return {}

    def summary(self):
        return ""

    def finish(self):
        return None


class StubJob:
    """A job whose `iteration` only counts, recording evals and steps in `events`; `signal_at`
    sends this process SIGTERM during that step (0-based)."""

    def __init__(self, schedule, events, signal_at=None, band=None, test=False):
        self.schedule, self.events, self.signal_at = schedule, events, signal_at
        self.state, self.band, self.has_test = CountState(), band or NoBand(), test

    def iteration(self):
        it = self.state.done
        self.events.append(("iter", it))
        if it == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.state.done = it + 1
        return {"reward/mean": float(it)}

    def evaluate(self):
        self.events.append(("eval", self.state.done))
        return {"eval/accuracy": 0.5}

    def test(self):
        """The test split's eval, recorded in `events` when the job has one (`test=True`)."""
        if not self.has_test:
            return {}
        self.events.append(("test", self.state.done))
        return {"test/accuracy": 0.25}

    def restore(self, extra):
        self.state = CountState(extra["done"])


def start(monkeypatch, *overrides, job="rl", resumed=None, first_start=False, **kwargs):
    """A stub job under `job`'s schedule for the config `overrides`, and its loop over a stub
    runtime whose logger, saves and resume are recorded in the job's `events`."""
    cfg = load_config(None, [*BASE, *overrides, "run_dir=stub_run"])
    events = []
    stub = StubJob(SCHEDULES[job](cfg), events, **kwargs)
    policy = SimpleNamespace(model=SimpleNamespace(module=torch.nn.Linear(2, 2)))
    logger = SimpleNamespace(log=lambda step, row: events.append(("log", step)))
    rt = SimpleNamespace(cfg=cfg, info=SimpleNamespace(is_main=False), job=job, policy=policy,
                         first_start=first_start, close=lambda: events.append("close"),
                         logger=logger)
    stub.saved = {}
    monkeypatch.setattr(loop, "try_resume", lambda rt: resumed)
    monkeypatch.setattr(loop, "save_state", lambda rt, n, extra: (
        events.append(("save", n)), stub.saved.update({n: extra})))
    return stub, loop.RunLoop(rt, stub)


def test_iteration_zero_eval_runs_on_a_fresh_run_only(monkeypatch):
    """The initial policy's eval is logged once, before the first rollout batch: a run resumed
    past iteration 0 does not evaluate (and log) it again. Each step's row is logged at the
    job's optimizer step."""
    fresh, run = start(monkeypatch, "train.steps=2", "train.eval_every=5", "train.save_every=0")
    assert run.run() == {"reward/mean": 1.0}
    assert fresh.events == [("eval", 0), ("log", 0), ("iter", 0), ("log", 10), ("iter", 1),
                            ("log", 20), "close"]
    resumed, run = start(monkeypatch, "train.steps=2", "train.eval_every=5",
                         "train.save_every=0", resumed={"done": 1})
    run.run()
    assert resumed.events == [("iter", 1), ("log", 20), "close"]
    no_eval, run = start(monkeypatch, "train.steps=1", "train.eval_every=0", "train.save_every=0")
    run.run()
    assert no_eval.events == [("iter", 0), ("log", 10), "close"]


def test_the_test_split_is_evaluated_at_the_first_and_last_step_only(monkeypatch):
    """A fresh run evaluates the test split at step 0 (after the validation eval and the band's
    verdict; in a row of its own when the schedule has no start eval) and at its last step;
    a resumed run only at its last step; never in between, whatever the eval cadence."""
    stub, run = start(monkeypatch, "train.steps=3", "train.eval_every=1", "train.save_every=0",
                      test=True)
    row = run.run()
    assert stub.events == [("eval", 0), ("test", 0), ("log", 0), ("iter", 0), ("eval", 1),
                           ("log", 10), ("iter", 1), ("eval", 2), ("log", 20), ("iter", 2),
                           ("eval", 3), ("test", 3), ("log", 30), "close"]
    assert row["test/accuracy"] == 0.25 and row["eval/accuracy"] == 0.5
    quiet, run = start(monkeypatch, "train.steps=2", "train.eval_every=0", "train.save_every=0",
                       test=True)
    run.run()
    assert quiet.events == [("test", 0), ("log", 0), ("iter", 0), ("log", 10), ("iter", 1),
                            ("test", 2), ("log", 20), "close"]
    resumed, run = start(monkeypatch, "train.steps=2", "train.eval_every=0",
                         "train.save_every=0", resumed={"done": 1}, test=True)
    run.run()
    assert resumed.events == [("iter", 1), ("test", 2), ("log", 20), "close"]


def test_a_band_that_stops_the_run_gets_the_last_test_eval_and_a_refused_start_none(
        monkeypatch):
    """Where the band stops SFT is its last step: the test split is evaluated there, after the
    band's verdict (which reads only the validation eval), and saved with the row. A start the
    band refuses runs no test eval."""
    stub, run = start(monkeypatch, "sft.steps=4", "sft.eval_every=2", job="sft",
                      band=ScriptedBand(stop_at=2), test=True)
    assert run.run() == {"reward/mean": 1.0, "eval/accuracy": 0.5, "test/accuracy": 0.25,
                         "band/step": 2.0}
    assert stub.events[-5:] == [("eval", 2), ("test", 2), ("log", 20), ("save", 2), "close"]
    assert stub.saved[2]["eval"]["test/accuracy"] == 0.25
    refused, run = start(monkeypatch, "train.steps=2", "train.eval_every=1",
                         band=ScriptedBand(refuse_at=0), test=True)
    with pytest.raises(ConfigError, match="outside the band at step 0"):
        run.run()
    assert refused.events == [("eval", 0), ("log", 0), "close"]


def test_signal_at_the_last_rollout_batch_saves_and_finishes_without_preempted(monkeypatch):
    """A signal during the final rollout batch saves it and returns normally (the run is
    done, nothing to resume); one earlier saves and raises Preempted."""
    last, run = start(monkeypatch, "train.steps=2", "train.save_every=0", signal_at=1)
    assert run.run() == {"reward/mean": 1.0}
    assert last.events == [("iter", 0), ("log", 10), ("iter", 1), ("log", 20), ("save", 2),
                           "close"]
    early, run = start(monkeypatch, "train.steps=3", "train.save_every=0", signal_at=0)
    with pytest.raises(Preempted, match="stopped at rollout batch 1 of 3"):
        run.run()
    assert early.events == [("iter", 0), ("log", 10), ("save", 1), "close"]


@pytest.mark.parametrize("job, unit", [("rl", "rollout batch"), ("sft", "SFT step")])
def test_a_signal_saves_where_no_cadence_would_for_either_job(monkeypatch, job, unit):
    """Neither schedule saves after step 1 of 3 (SFT only at its last step, RL with
    save_every=0 never); a signal there saves it, with the job's state, and stops."""
    stub, run = start(monkeypatch, f"{STEPS[job]}=3", "train.save_every=0", "sft.eval_every=0",
                      job=job, signal_at=0)
    with pytest.raises(Preempted, match=f"stopped at {unit} 1 of 3; checkpoint saved in "
                                        "stub_run; run the same command to resume"):
        run.run()
    assert [e for e in stub.events if e[0] == "save"] == [("save", 1)]
    assert stub.saved[1] == {"done": 1, "eval": {"reward/mean": 0.0}}


def test_progress_line_every_log_every_rollout_batches(monkeypatch, capsys):
    """The main rank prints a progress line after every `train.log_every`-th rollout batch."""
    _, run = start(monkeypatch, "train.steps=4", "train.save_every=0", "train.log_every=2")
    run.rt.info.is_main = True
    run.run()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[  2/4", "[  4/4"]
    assert lines[-1].startswith("[  4/4] reward/mean=3")


@pytest.mark.parametrize("job, key, units", [("rl", "train.steps", "rollout batches"),
                                             ("sft", "sft.steps", "SFT steps")])
def test_a_finished_run_says_so_and_does_nothing(monkeypatch, capsys, job, key, units):
    stub, run = start(monkeypatch, f"{key}=2", job=job, resumed={"done": 2, "eval": {"x": 1}})
    run.rt.info.is_main = True
    assert run.run() == {}
    assert stub.events == ["close"]
    assert f"stub_run already finished 2 of {key}=2 {units}; nothing to do (raise {key} to " \
           "continue it)" in capsys.readouterr().out


class ScriptedBand(NoBand):
    """Stops the run at step `stop_at`; raises a ConfigError at step `refuse_at`."""

    def __init__(self, stop_at=None, refuse_at=None, entered=None):
        self.stop_at, self.refuse_at, self.entered = stop_at, refuse_at, entered

    def update(self, step, accuracy):
        if step == self.refuse_at:
            raise ConfigError(f"accuracy {accuracy} outside the band at step {step}")
        if step == self.stop_at:
            self.entered = step
        return step == self.stop_at

    def record(self):
        return {} if self.entered is None else {"band/step": float(self.entered)}

    def summary(self):
        return f"entered the band at step {self.entered}"

    def finish(self):
        raise ConfigError("the band was not reached")


def test_the_band_stops_the_run_inside_it_with_its_record_saved(monkeypatch, capsys):
    stub, run = start(monkeypatch, "sft.steps=4", "sft.eval_every=2", job="sft",
                      band=ScriptedBand(stop_at=2))
    run.rt.info.is_main = True
    assert run.run() == {"reward/mean": 1.0, "eval/accuracy": 0.5, "band/step": 2.0}
    assert stub.events == [("eval", 0), ("log", 0), ("iter", 0), ("log", 10), ("iter", 1),
                           ("eval", 2), ("log", 20), ("save", 2), "close"]
    assert stub.saved[2]["band"] == {"band/step": 2.0} and stub.saved[2]["done"] == 2
    assert "entered the band at step 2; saved in stub_run" in capsys.readouterr().out
    # the same run again: done, nothing runs; its saved row and record come back
    again, run = start(monkeypatch, "sft.steps=4", "sft.eval_every=2", job="sft",
                       band=ScriptedBand(entered=2), resumed={"done": 2, "eval": {"x": 1.0}})
    run.rt.info.is_main = True
    assert run.run() == {"x": 1.0, "band/step": 2.0} and again.events == ["close"]
    assert "stub_run: entered the band at step 2; nothing to do" in capsys.readouterr().out


def test_outside_the_band_the_step_is_logged_and_saved_before_the_error(monkeypatch):
    """Past step 0 the trained step is kept; at step 0 (a refused start) nothing is saved and
    the run's record is forgotten when this start wrote it (a corrected re-run is then a
    first start), kept otherwise (a finished run's record)."""
    stub, run = start(monkeypatch, "sft.steps=4", "sft.eval_every=2", job="sft",
                      band=ScriptedBand(refuse_at=2))
    with pytest.raises(ConfigError, match="outside the band at step 2"):
        run.run()
    assert stub.events[-3:] == [("log", 20), ("save", 2), "close"]
    for first_start, forgotten in ((True, [("stub_run", "rl")]), (False, [])):
        calls = []
        monkeypatch.setattr(loop, "forget_run", lambda *a: calls.append(a))
        stub, run = start(monkeypatch, "train.steps=2", "train.eval_every=1",
                          band=ScriptedBand(refuse_at=0), first_start=first_start)
        with pytest.raises(ConfigError, match="outside the band at step 0"):
            run.run()
        assert stub.events == [("eval", 0), ("log", 0), "close"] and calls == forgotten


def test_the_bands_last_word_comes_after_the_last_step(monkeypatch):
    stub, run = start(monkeypatch, "sft.steps=2", "sft.eval_every=0", job="sft",
                      band=ScriptedBand())
    with pytest.raises(ConfigError, match="the band was not reached"):
        run.run()
    assert stub.events[-2:] == [("save", 2), "close"]  # saved before the error


def test_weights_gone_non_finite_stop_the_run_before_its_save(monkeypatch):
    stub, run = start(monkeypatch, "train.steps=3", "train.save_every=1")
    real = stub.iteration

    def poisoned():
        out = real()
        if stub.state.done == 2:
            run.rt.policy.model.module.weight.data[0, 0] = float("nan")
        return out

    stub.iteration = poisoned
    with pytest.raises(FloatingPointError, match=r"not finite after rollout batch 2 \(optimizer "
                                                 r"step 20; lr too high\?\); not saved: "
                                                 r"checkpoints in stub_run are untouched"):
        run.run()
    assert stub.events == [("iter", 0), ("log", 10), ("save", 1), ("iter", 1), ("log", 20),
                           "close"]


def test_save_every_also_saves_the_last_rollout_batch():
    cfg = load_config(None, ["train.save_every=3", "train.steps=4"])
    assert [rl.schedule(cfg).save_due(i) for i in range(1, 5)] == [False, False, True, True]
    assert not rl.schedule(load_config(None, ["train.save_every=0", "train.steps=4"])).save_due(4)


def test_sft_evaluates_and_prints_every_eval_every_and_at_the_last_step_and_saves_at_the_last():
    s = sft.schedule(load_config(None, ["sft.steps=5", "sft.eval_every=2"]))
    assert [n for n in range(1, 6) if s.eval_due(n)] == [2, 4, 5]
    assert [n for n in range(1, 6) if s.progress_due(n)] == [2, 4, 5]
    assert [n for n in range(1, 6) if s.save_due(n)] == [5] and s.start_eval
    quiet = sft.schedule(load_config(None, ["sft.steps=5", "sft.eval_every=0"]))
    assert not any(quiet.eval_due(n) or quiet.progress_due(n) for n in range(1, 6))
    assert quiet.save_due(5) and quiet.start_eval  # the initial policy is still evaluated


def test_rl_evaluates_the_initial_policy_only_for_an_eval_cadence_or_a_start_band():
    def start_eval(*overrides):
        return rl.schedule(load_config(None, list(overrides))).start_eval

    assert not start_eval("train.eval_every=0")
    assert start_eval("train.eval_every=3")
    assert start_eval("train.eval_every=0", "train.start_accuracy=[0,0.5]")
    s = rl.schedule(load_config(None, ["train.steps=5", "train.eval_every=2"]))
    assert [n for n in range(1, 6) if s.eval_due(n)] == [2, 4]  # not forced at the last


def test_the_run_room_never_imports_the_jobs():
    """Jobs plug into the run loop through its protocol; no module of megatron_gspo.run imports
    megatron_gspo.jobs, at module level or inside a function."""
    import ast

    room = os.path.dirname(loop.__file__)
    for name in sorted(os.listdir(room)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(room, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [f"{n.module}.{a.name}" for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) for a in n.names]
        assert not [m for m in imported if m.startswith("megatron_gspo.jobs")], name
