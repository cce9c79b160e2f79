"""RL's metrics (megatron_gspo.jobs.rl_metrics) on hand-made batches, and the collapse alerts
(the `collapse_alerts` instrument, megatron_gspo.jobs.rl_instruments) on a stub."""

import pytest
import torch

from megatron_gspo.jobs.rl_instruments import CollapseAlerts
from tests.megatron_gspo.jobs.trainers import stub


def _alerts(t, row: dict) -> dict:
    """The collapse alerts of the stub trainer `t`'s instrument on a rollout batch's `row`."""
    if not hasattr(t, "alerts"):
        t.alerts = CollapseAlerts(t)
    return t.alerts.on_iteration(None, row)


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

    from megatron_gspo.jobs.rl_metrics import rollout_metrics

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
    train time; the overlap = the share of the rollout the trainer did not wait for (a
    rollout sampled beside it: 0.5 s waited of 2 s), 0 when it waited for all of it."""
    from megatron_gspo.run.metrics import Timer
    from megatron_gspo.jobs.rl_metrics import throughput

    clock = iter([0.0, 0.5, 10.0, 14.0])
    timer = Timer(clock=lambda: next(clock), cuda_sync=False)
    with timer("rollout_wait"):  # 0.5 s
        pass
    timer.add("rollout", 2.0)  # sampled in the producer's thread
    with timer("train"):  # 4 s
        pass
    assert throughput(_batch(), timer) == pytest.approx(
        {"perf/rollout_tokens_per_s": 7 / 2, "perf/train_tokens_per_s": 16 / 4,
         "perf/overlap_frac": 0.75})
    timer.add("rollout_wait", 2.0)  # the synchronous loop: waited for the whole rollout
    assert throughput(_batch(), timer)["perf/overlap_frac"] == 0.0


def test_reward_collapse_alert_follows_the_ema():
    t = stub(collapse_reward_drop=0.5)
    assert _alerts(t, {"reward/mean": 1.0})["alert/reward_collapse"] == 0.0
    out = _alerts(t, {"reward/mean": 0.0})  # ema 0.7 of best 1.0: no alert
    assert t.state.reward_ema == pytest.approx(0.7) and out["alert/reward_collapse"] == 0.0
    _alerts(t, {"reward/mean": 0.0})  # 0.49 < 0.5: alert
    assert t.state.reward_ema == pytest.approx(0.49) and t.state.best_reward_ema == 1.0
    assert _alerts(t, {"reward/mean": 0.0})["alert/reward_collapse"] == 1.0


def test_entropy_and_small_reward_collapse_alerts():
    """Entropy below the floor (strictly) alerts, a metrics dict without entropy does not, a
    reward that never rose above 0.05 cannot "crash", and one exactly at the drop does not."""
    t = stub(collapse_entropy_floor=0.05, collapse_reward_drop=0.5)
    at_floor = _alerts(t, {"reward/mean": 1.0, "policy/entropy": 0.05})
    assert at_floor == {"alert/reward_collapse": 0.0, "alert/entropy_collapse": 0.0}
    below = _alerts(t, {"reward/mean": 1.0, "policy/entropy": 0.04})
    assert below == {"alert/reward_collapse": 0.0, "alert/entropy_collapse": 1.0}
    assert _alerts(t, {"reward/mean": 1.0})["alert/entropy_collapse"] == 0.0
    low = stub(collapse_reward_drop=0.5)
    for r in (0.04, 0.0, 0.0, 0.0):  # ema 0.04, 0.028, 0.0196, 0.01372: below half the best
        out = _alerts(low, {"reward/mean": r})
    assert low.state.reward_ema < 0.02 and out["alert/reward_collapse"] == 0.0
    edge = stub(collapse_reward_drop=0.3)  # ema 0.7 after 1, 0 is exactly 0.7 of the best
    _alerts(edge, {"reward/mean": 1.0})
    assert _alerts(edge, {"reward/mean": 0.0})["alert/reward_collapse"] == 0.0


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_routing_log_ratio_is_what_replay_removes(tmp_path, mode):
    """`policy/routing_log_ratio`: from a rollout batch's second minibatch on (measured steps
    only), the loss's log-probs against the same weights under pi_old's routing. Noise on the
    loss's routers moves them apart; R2 and R3 replay pi_old's routing in the loss, so it is 0
    there. Not logged on the first minibatch, nor where flips are not measured."""
    from tests.jsonl import step_rows
    from tests.megatron_gspo.jobs.trainers import make_trainer

    trainer = make_trainer(tmp_path, "train.steps=1", "train.num_minibatches=4",
                           "train.router_noise_std=1.0", f"train.routing_replay={mode}",
                           "train.flip_every=2")
    trainer.train()
    rows = {r["train/minibatch"]: r for r in step_rows(trainer.cfg.run_dir)}
    keys = ("policy/routing_log_ratio/abs_mean", "policy/routing_log_ratio/past_clip")
    assert not any(k in rows[m] for k in keys for m in (0, 1, 3))  # first, or not measured
    got = [rows[2][k] for k in keys]
    if mode == "off":
        assert got[0] > 5e-4 and 0 <= got[1] <= 1  # (an untrained model: small)
    else:
        assert got == [0.0, 0.0]


def test_routing_log_ratio_forwards_the_packing_bins_in_batch_order(single_process):
    """The routing log-ratio's no-grad forward of a packed policy runs the token budget's bins
    of real tokens (`algo.packing.microbatches`), as the pi_old pass does, not row slices
    counted at the padded width, and scores each row against its own log-probs."""
    from types import SimpleNamespace

    from megatron_gspo.algo.packing import microbatches
    from megatron_gspo.jobs.rl_metrics import routing_log_ratio
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import ParallelLayout
    from moe.routing.replay import current_routing

    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, optim=None,
                             pack=True)
    B, T, start, budget = 8, 24, 4, 48
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(0, preset.vocab_size, (B, T), generator=g)
    lengths = [24, 6, 7, 5, 8, 6, 9, 5]  # one long row, the rest short: a long tail
    valid_BT = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    response_BT = valid_BT.clone()
    response_BT[:, :start] = False
    logp_BT, routing = current_routing(policy, tokens_BT, valid_BT, start=start)
    mb = type("Minibatch", (SimpleNamespace,), {"__len__": lambda self: B})(
        tokens_BT=tokens_BT, valid_BT=valid_BT, response_BT=response_BT, old_routing=routing,
        rollout=SimpleNamespace(response_start=start))
    cfg = SimpleNamespace(train=SimpleNamespace(logprob_max_tokens=budget),
                          rollout=SimpleNamespace(temperature=1.0))
    forwards, inner = [], policy.token_logprobs
    policy.token_logprobs = lambda t, v, *a, **k: forwards.append(int(v.sum())) or inner(t, v, *a,
                                                                                         **k)
    got = routing_log_ratio(policy, mb, torch.zeros(B, T), cfg)
    bins = microbatches(valid_BT, budget, True)
    assert len(forwards) == len(bins) < B * T // budget and max(forwards) <= max(budget, 24)
    want = logp_BT[response_BT].abs().double().mean()  # |0 - log pi| row by row
    assert got["policy/routing_log_ratio/abs_mean"] == pytest.approx(float(want), rel=1e-6)
