"""Trainer parts on the tiny model: what one iteration logs, how the rollout is drawn, the
reference policy, pi_old's pass (temperature, advantages, overlong filter, routing mismatch)."""

import dataclasses
import os

import pytest
import torch

from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.samplers import backend
from tests.megatron_gspo.test_trainer import make_trainer, params


def test_iteration_rows_carry_iteration_eval_alerts_and_timings_where_due(tmp_path):
    """Two iterations of two minibatches, eval_every=2: an eval row before the run, then
    `train/iteration` per row; the end-of-iteration row alone carries alerts, timings and
    throughput, and the eval only after iteration 2 (the 2nd rollout batch done)."""
    trainer = make_trainer(tmp_path, "train.steps=2", "train.num_minibatches=2",
                           "train.eval_every=2", "train.save_every=0")
    trainer.train()
    first, *rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert first["step"] == 0 and "eval/accuracy" in first and "train/iteration" not in first
    assert [(r["train/iteration"], r["train/minibatch"], r["step"]) for r in rows] == \
        [(0, 0, 1), (0, 1, 2), (1, 0, 3), (1, 1, 4)]
    ends = [r for r in rows if r["train/minibatch"] == 1]
    for r in rows:
        end = r["train/minibatch"] == 1
        for key in ("alert/reward_collapse", "alert/entropy_collapse", "time/rollout",
                    "perf/train_tokens_per_s"):
            assert (key in r) == end, (key, r["step"])
    assert ["eval/accuracy" in r for r in ends] == [False, True]


def test_a_skipped_step_logs_no_flips(tmp_path):
    """A step the guard skipped changed nothing, so it reports no flip metrics."""
    trainer = make_trainer(tmp_path, "train.steps=1", "train.num_minibatches=2",
                           "train.flip_every=1", "train.save_every=0")
    real = trainer.loss_fn
    trainer.loss_fn = lambda *a, **k: (lambda out: (out[0] + float("inf"), out[1]))(real(*a, **k))
    trainer.train()
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert [r["train/skipped"] for r in rows] == [1.0, 1.0]
    assert not any(k.startswith("moe/flip_rate") for r in rows for k in r)


def test_rollout_draw_is_seeded_by_iteration_and_rank_with_the_configured_sampler(tmp_path):
    """The prompts are the same for the same (iteration, data-parallel rank) and differ across
    either; the sampler gets rollout.* as configured (G copies of each prompt, group-major),
    and the policy is back in train mode afterwards."""
    calls = []

    def spy(s, prompts, params):
        calls.append((prompts, params))

    trainer = make_trainer(tmp_path, "rollout.temperature=0.7", "rollout.top_p=0.9",
                           "rollout.max_new_tokens=2", backend("spy", spy))
    for it in (0, 0, 1):
        trainer.rollout(it)
    trainer.rt.info = dataclasses.replace(trainer.rt.info, dp_rank=1)
    trainer.rollout(0)
    trainer.rt.close()
    prompts = [c[0] for c in calls]
    G = trainer.cfg.rollout.group_size
    assert len(prompts[0]) == trainer.local_prompts * G == 4 * G
    assert all(prompts[0][i] == prompts[0][i - i % G] for i in range(len(prompts[0])))
    assert prompts[0] == prompts[1] and prompts[2] != prompts[0] and prompts[3] != prompts[0]
    params = calls[0][1]
    assert (params.max_new_tokens, params.temperature, params.top_p, params.greedy) == \
        (2, 0.7, 0.9, False)
    assert trainer.policy.model.training


def test_reference_policy_is_the_initial_weights_and_only_with_a_kl(tmp_path):
    """loss.kl_coef > 0 builds a frozen reference from init_checkpoint's weights (what the
    policy starts from); kl_coef 0 builds none."""
    make_trainer(tmp_path, "train.steps=1", name="init").train()  # moves off the random init
    init = f"init_checkpoint={tmp_path / 'init'}"
    none = make_trainer(tmp_path, init, name="no_kl")
    assert none.ref_policy is None
    none.rt.close()
    kl = make_trainer(tmp_path, init, "loss.kl_coef=0.1", name="kl")
    ref = dict(kl.ref_policy.model.module.named_parameters())
    fresh = make_trainer(tmp_path, name="fresh")
    assert any(not torch.equal(p, ref[n].detach()) for n, p in params(fresh).items())
    for n, p in params(kl).items():
        assert torch.equal(p, ref[n].detach()), n
    for t in (kl, fresh):
        t.rt.close()


def test_a_failed_build_releases_the_run_dir(tmp_path, monkeypatch):
    """An error while building the reference policy closes the runtime: the run dir's lock
    is free (another process could claim it; a second descriptor here can)."""
    import fcntl

    from megatron_gspo.jobs import rl as trainer_mod
    from megatron_gspo.run.rundir import LOCK_FILE

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(trainer_mod, "build_policy", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        make_trainer(tmp_path, "loss.kl_coef=0.1")
    fd = os.open(tmp_path / "run" / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while still held
    finally:
        os.close(fd)


def test_pi_old_and_reference_passes_use_the_temperature_and_their_own_weights(tmp_path):
    """At temperature 0.7, R3's replayed pi_old pass and the reference pass (initial weights =
    the policy's) give the sampler's log-probs, up to rounding; once the policy has moved, the
    reference's stay (they come from the frozen copy)."""
    trainer = make_trainer(tmp_path, "rollout.temperature=0.7", "train.routing_replay=r3",
                           "loss.kl_coef=0.1")
    batch = trainer.rollout(0)
    full, shared = trainer.prepare(batch)
    resp_BT = batch.response_BT
    assert shared["rollout/logprob_mismatch_r3/max"] < 1e-5
    assert not full.old_logp_BT.requires_grad and not full.ref_logp_BT.requires_grad  # no graph
    gap_BT = (full.ref_logp_BT - batch.sampler_logp_BT).abs() * resp_BT
    assert float(gap_BT.max()) < 1e-5
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the policy moves on; the reference stays where it was
        for p in trainer.policy.model.module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    moved, _ = trainer.prepare(batch)
    trainer.rt.close()
    torch.testing.assert_close(moved.ref_logp_BT, full.ref_logp_BT, rtol=0, atol=1e-6)
    assert float(((moved.old_logp_BT - full.old_logp_BT).abs() * resp_BT).max()) > 1e-3


def test_advantages_use_adv_eps_and_the_overlong_filter(tmp_path):
    """pi_old's pass normalises advantages with loss.adv_eps and zeroes truncated rows'
    advantages under filter.overlong."""
    from megatron_gspo.algo.advantages import group_advantages

    trainer = make_trainer(tmp_path, "loss.adv_eps=0.5", "filter.overlong=true")
    batch = trainer.rollout(0)
    full, shared = trainer.prepare(batch)
    trainer.rt.close()
    want, _ = group_advantages(batch.rewards_B, 4, eps=0.5)
    cut_B = batch.truncated_B
    assert 0 < int(cut_B.sum()) < len(batch)  # both kinds of row, or the check could not fail
    torch.testing.assert_close(full.adv_B[~cut_B], want[~cut_B], rtol=0, atol=0)
    assert full.adv_B[cut_B].abs().sum() == 0 and want[cut_B].abs().sum() > 0
    assert shared["filter/overlong_masked"] == pytest.approx(float(cut_B.float().mean()))


def test_routing_mismatch_counts_the_loss_positions_only(tmp_path):
    """The sampler's routing is altered at every token whose logits score no response token
    (the prompt, and the last response token): the logged mismatch stays 0."""
    from megatron_gspo.algo.flips import loss_positions

    def shifted_off_loss(s, prompts, params):
        r = s.routing
        off_N = ~loss_positions(s.response_BT)[s.valid_BT]
        ids = r.ids_NLK.long()
        ids[off_N] = (ids[off_N] + 1) % r.num_experts
        r.ids_NLK = ids.to(r.ids_NLK.dtype)

    trainer = make_trainer(tmp_path, "train.routing_replay=r3",
                           backend("shifted_off_loss", shifted_off_loss))
    _, shared = trainer.prepare(trainer.rollout(0))
    trainer.rt.close()
    assert shared["rollout/routing_mismatch/mean"] == 0.0
