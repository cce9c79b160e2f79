"""Trainer pieces without a model: the run loop's eval / save / preemption decisions on a stub
(its `iteration` only counts), and the metric helpers on hand-made batches."""

import os
import signal
from types import SimpleNamespace

import pytest

from megatron_gspo.config.schema import load_config
from tests.megatron_gspo.test_trainer import BASE, _stub


class LoopStub:
    """What `Trainer.train` touches, recording the order of evals, iterations, logs and saves;
    `signal_at` sends this process SIGTERM during that iteration (0-based)."""

    def __init__(self, *overrides, iteration=0, signal_at=None):
        from megatron_gspo.jobs.rl import Trainer, TrainerState

        self.cfg = load_config(None, [*BASE, *overrides])
        self.state = TrainerState(iteration=iteration)
        self.events, self.signal_at = [], signal_at
        self.rt = SimpleNamespace(info=SimpleNamespace(is_main=False),
                                  close=lambda: self.events.append("close"))
        self.should_save = lambda it: Trainer.should_save(self, it)
        self.check_start = lambda first_eval: Trainer.check_start(self, first_eval)

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

    def check_weights(self, iteration):
        pass


def run_loop(monkeypatch, stub):
    from megatron_gspo.jobs import rl as trainer_mod

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
    from megatron_gspo.run.preempt import Preempted

    last = LoopStub("train.steps=2", "train.save_every=0", signal_at=1)
    assert run_loop(monkeypatch, last) == {"reward/mean": 1.0}
    assert last.events == [("iter", 0), ("iter", 1), ("save", 2), "close"]
    early = LoopStub("train.steps=3", "train.save_every=0", signal_at=0)
    with pytest.raises(Preempted, match="stopped at rollout batch 1 of 3"):
        run_loop(monkeypatch, early)
    assert early.events == [("iter", 0), ("save", 1), "close"]


def test_progress_line_every_log_every_rollout_batches(monkeypatch, capsys):
    """The main rank prints a progress line after every `train.log_every`-th rollout batch."""
    stub = LoopStub("train.steps=4", "train.save_every=0", "train.log_every=2")
    stub.rt.info.is_main = True
    run_loop(monkeypatch, stub)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[  2/4", "[  4/4"]
    assert lines[-1].startswith("[  4/4] reward/mean=3")


def _batch():
    """Four rows of 4 columns; response lengths 2, 1, 3, 1; rewards 1, 0, 0.5, 1.5."""
    import torch

    from megatron_gspo.rollout.batch import RolloutBatch

    resp_BT = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0], [0, 1, 1, 1], [0, 0, 0, 1]]).bool()
    sampler_logp_BT = torch.tensor([[9, -1, -2, 9], [9, 9, -0.5, 9], [9, -1, -1, -1],
                                    [9, 9, 9, -3]], dtype=torch.float64)
    return RolloutBatch(tokens_BT=torch.zeros(4, 4, dtype=torch.long),
                        valid_BT=torch.ones(4, 4, dtype=torch.bool), response_BT=resp_BT,
                        sampler_logp_BT=sampler_logp_BT,
                        rewards_B=torch.tensor([1.0, 0.0, 0.5, 1.5], dtype=torch.float64),
                        group_B=torch.zeros(4, dtype=torch.long), completions=list("abcd"),
                        examples=list("ABCD"))


def test_rollout_metrics_by_hand():
    """Reward mean / population std / accuracy (reward >= 1), response lengths, and the
    sampler-vs-recompute |log-prob| gap over response tokens only (prompt columns hold 9)."""
    import math

    import torch

    from megatron_gspo.jobs.rl import rollout_metrics

    recompute_BT = torch.tensor([[0, -1.5, -1, 0], [0, 0, -0.75, 0], [0, -1, -1, -1],
                                 [0, 0, 0, -2]], dtype=torch.float64)
    # response gaps: 0.5, 1.0 | 0.25 | 0, 0, 0 | 1.0: sum 2.75 over 7 tokens, max 1.0
    got = rollout_metrics(_batch(), recompute_BT)
    assert got == pytest.approx({
        "reward/mean": 0.75, "reward/std": math.sqrt(1.25 / 4), "reward/accuracy": 0.5,
        "response/length/mean": 1.75, "response/length/max": 3.0,
        "rollout/logprob_mismatch/mean": 2.75 / 7, "rollout/logprob_mismatch/max": 1.0})
    assert rollout_metrics(_batch(), recompute_BT, "x/") == pytest.approx(
        {"x/mean": 2.75 / 7, "x/max": 1.0})


def test_throughput_divides_tokens_by_their_phase_time():
    """Rollout tokens/s = response tokens / rollout time; train tokens/s = all valid tokens /
    train time."""
    from megatron_gspo.run.metrics import Timer
    from megatron_gspo.jobs.rl import throughput

    clock = iter([0.0, 2.0, 10.0, 14.0])
    timer = Timer(clock=lambda: next(clock), cuda_sync=False)
    with timer("rollout"):  # 2 s
        pass
    with timer("train"):  # 4 s
        pass
    assert throughput(_batch(), timer) == pytest.approx(
        {"perf/rollout_tokens_per_s": 7 / 2, "perf/train_tokens_per_s": 16 / 4})


def test_entropy_and_small_reward_collapse_alerts():
    """Entropy below the floor (strictly) alerts, a metrics dict without entropy does not, a
    reward that never rose above 0.05 cannot "crash", and one exactly at the drop does not."""
    from megatron_gspo.jobs.rl import Trainer

    t = _stub(collapse_entropy_floor=0.05, collapse_reward_drop=0.5)
    at_floor = Trainer.collapse_alerts(t, {"reward/mean": 1.0, "policy/entropy": 0.05})
    assert at_floor == {"alert/reward_collapse": 0.0, "alert/entropy_collapse": 0.0}
    below = Trainer.collapse_alerts(t, {"reward/mean": 1.0, "policy/entropy": 0.04})
    assert below == {"alert/reward_collapse": 0.0, "alert/entropy_collapse": 1.0}
    assert Trainer.collapse_alerts(t, {"reward/mean": 1.0})["alert/entropy_collapse"] == 0.0
    low = _stub(collapse_reward_drop=0.5)
    for r in (0.04, 0.0, 0.0, 0.0):  # ema 0.04, 0.028, 0.0196, 0.01372: below half the best
        out = Trainer.collapse_alerts(low, {"reward/mean": r})
    assert low.state.reward_ema < 0.02 and out["alert/reward_collapse"] == 0.0
    edge = _stub(collapse_reward_drop=0.3)  # ema 0.7 after 1, 0 is exactly 0.7 of the best
    Trainer.collapse_alerts(edge, {"reward/mean": 1.0})
    assert Trainer.collapse_alerts(edge, {"reward/mean": 0.0})["alert/reward_collapse"] == 0.0


@pytest.mark.parametrize("replay, sampler, dtype, kv_cache, dynamic, sp, want", [
    ("r3", "lean", "same", True, True, True, True),  # R3 always records
    ("off", "lean", "same", True, False, False, False),  # same precision: nothing to measure
    ("off", "lean", "bf16", True, False, False, True),
    ("r2", "megatron", "bf16", True, False, False, True),
    ("off", "lean", "bf16", False, False, False, False),  # no KV cache
    ("off", "lean", "bf16", True, True, False, False),  # dynamic sampling's several rounds
    ("off", "lean", "bf16", True, False, True, False),  # sequence parallelism
    ("off", "megatron_engine", "same", True, False, False, True),  # an engine: always
    ("off", "vllm", "same", False, True, False, False),  # ... but one routing per round
    ("off", "custom", "same", True, False, False, False),  # another sampler: as the decoders
])
def test_records_sampler_routing_only_where_it_can(replay, sampler, dtype, kv_cache, dynamic, sp,
                                                   want):
    """The sampler records its routing for R3, for an inference engine's mismatch, or for a
    different-precision decoder's mismatch when the KV cache, one round and no sequence
    parallelism make it possible."""
    from megatron_gspo.jobs.rl import Trainer

    ns = SimpleNamespace
    cfg = ns(train=ns(routing_replay=replay),
             rollout=ns(sampler=sampler, sampler_dtype=dtype, kv_cache=kv_cache),
             filter=ns(dynamic_sampling=dynamic), model=ns(sequence_parallel=sp))
    assert Trainer.records_sampler_routing(ns(cfg=cfg)) is want


def test_router_noise_is_a_fresh_seeded_draw_per_step_and_off_under_replay(monkeypatch):
    """Each optimizer step gets its own noise; the same step gets the same (resumable); a
    replayed forward or std 0 gets none."""
    import torch

    from megatron_gspo.jobs import rl as trainer_mod

    monkeypatch.setattr(trainer_mod, "router_noise", lambda policy, std, gen: (std, gen))
    t = _stub(router_noise_std=0.5)
    t.policy = SimpleNamespace(device="cpu")
    live, replayed = SimpleNamespace(replay=None), SimpleNamespace(replay=object())

    def draw(step, mb=live):
        t.state.opt_step = step
        std, gen = trainer_mod.Trainer.router_noise(t, mb)
        return std, (None if gen is None else torch.randn(4, generator=gen).tolist())

    assert draw(3) == draw(3) and draw(3)[0] == 0.5
    assert draw(3)[1] != draw(4)[1]
    assert draw(3, replayed) == (0.0, None)
    quiet = _stub(router_noise_std=0.0)
    quiet.policy = t.policy
    assert trainer_mod.Trainer.router_noise(quiet, live) == (0.0, None)

