"""One rollout batch of the RL job (megatron_gspo.jobs.rl): the seeded prompt draw, pi_old's and the
reference policy's passes (temperature, token budget), advantages and the overlong filter, and the
minibatches that partition the batch."""

import dataclasses

import pytest
import torch

from tests.jsonl import step_rows
from tests.megatron_gspo.jobs.trainers import make_trainer, params
from tests.megatron_gspo.samplers import backend


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


def test_batch_passes_in_token_budgeted_forwards_equal_one_pass(tmp_path):
    """train.logprob_max_tokens: pi_old's pass, R3's replayed pi_old pass and the reference
    policy's run in forwards of at most that many tokens (padded: rows x the batch's width;
    packed, real tokens: tests/megatron_gspo/jobs/test_rl_packing.py), with the numbers of one
    pass."""
    over = ["train.routing_replay=r3", "loss.kl_coef=0.1", "train.pack=false"]
    one = make_trainer(tmp_path, *over, "train.logprob_max_tokens=0", name="one")
    batch = one.rollout(0)
    T = batch.tokens_BT.shape[1]
    chunked = make_trainer(tmp_path, *over, f"train.logprob_max_tokens={3 * T + 1}",
                           name="chunked")
    assert len(batch) > 3 and len(batch) % 3  # several chunks, a short last one
    forwards = []
    for t in (one, chunked):
        for policy in (t.policy, t.ref_policy):
            policy.model.module.output_layer.register_forward_hook(
                lambda m, args, out: forwards.append(out[0].shape[1]))
    (mb_one, shared_one), (mb, shared) = one.prepare(batch), chunked.prepare(batch)
    n = len(batch)
    assert forwards[:3] == [n] * 3  # pi_old, R3 pi_old, reference: one forward each
    k = -(-n // 3)  # forwards of <= 3 sequences, near-equal
    assert len(forwards[3:]) == 3 * k and max(forwards[3:]) <= 3 and sum(forwards[3:]) == 3 * n
    for name in ("old_logp_BT", "ref_logp_BT"):
        torch.testing.assert_close(getattr(mb, name), getattr(mb_one, name), atol=1e-6,
                                   rtol=1e-6)
    assert torch.equal(mb.old_routing.ids_NLK, mb_one.old_routing.ids_NLK)
    assert shared["rollout/logprob_mismatch/mean"] == pytest.approx(
        shared_one["rollout/logprob_mismatch/mean"], rel=1e-5, abs=1e-7)
    for t in (one, chunked):
        t.rt.close()


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


def test_minibatch_select_keeps_every_part_row_aligned():
    """One `select` slices tokens, pi_old log-probs, advantages and both routing caches."""
    from megatron_gspo.rollout.batch import RolloutBatch
    from megatron_gspo.jobs.rl import Minibatch, TrainerState
    from moe.routing.replay import RoutingReplayCache

    B, T, L, K = 4, 3, 2, 2
    valid_BT = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool)
    N = int(valid_BT.sum())
    ids_NLK = torch.arange(N * L * K).reshape(N, L, K) % 8
    row_of_N = torch.arange(B).repeat_interleave(valid_BT.sum(1))
    cache = RoutingReplayCache(ids_NLK, valid_BT, num_experts=8)
    rollout = RolloutBatch(tokens_BT=torch.arange(B * T).reshape(B, T), valid_BT=valid_BT,
                           response_BT=valid_BT, sampler_logp_BT=torch.zeros(B, T),
                           rewards_B=torch.arange(B, dtype=torch.float), group_B=torch.arange(B),
                           completions=list("abcd"), examples=list("ABCD"), routing=cache)
    full = Minibatch(rollout, old_logp_BT=torch.arange(B * T, dtype=torch.float).reshape(B, T),
                     adv_B=torch.arange(B, dtype=torch.float) * 10, old_routing=cache,
                     replay=cache, ref_logp_BT=None)
    rows = torch.tensor([3, 1])
    mb = full.select(rows)
    assert len(mb) == 2 and mb.rollout.completions == ["d", "b"] and mb.ref_logp_BT is None
    assert torch.equal(mb.tokens_BT, full.tokens_BT[rows])
    assert torch.equal(mb.old_logp_BT, full.old_logp_BT[rows])
    assert mb.adv_B.tolist() == [30.0, 10.0]
    want = torch.cat([ids_NLK[row_of_N == 3], ids_NLK[row_of_N == 1]])
    for c in (mb.replay, mb.old_routing, mb.rollout.routing):
        assert torch.equal(c.ids_NLK, want) and torch.equal(c.valid_BT, valid_BT[rows])
    state = TrainerState.from_checkpoint({"iteration": 2, "opt_step": 8, "unknown": 1})
    assert (state.iteration, state.opt_step, state.reward_ema) == (2, 8, None)


def test_minibatches_partition_the_batch_and_reuse_pi_old_advantages_and_ref(tmp_path,
                                                                            monkeypatch):
    """Every optimizer step's loss gets its rows' pi_old log-probs, group advantages (over the
    G responses of a prompt, computed once for the rollout batch) and reference log-probs; the
    minibatches partition the batch; the logged token means divide by response tokens."""
    from megatron_gspo.jobs import rl as trainer_mod
    from megatron_gspo.algo.advantages import group_advantages

    trainer = make_trainer(tmp_path, "train.steps=1", "loss.kl_coef=0.1")
    G, n_mb = trainer.cfg.rollout.group_size, trainer.cfg.train.num_minibatches
    prepared, rows_of, calls, ents = [], [], [], []
    real_prepare, real_select = trainer.prepare, trainer_mod.Minibatch.select
    trainer.prepare = lambda batch: prepared.append(real_prepare(batch)) or prepared[-1]

    def select(self, rows):
        if prepared and self is prepared[0][0]:
            rows_of.append(rows.clone())
        return real_select(self, rows)

    monkeypatch.setattr(trainer_mod.Minibatch, "select", select)
    real_loss, real_logprobs = trainer.loss_fn, trainer.policy.token_logprobs
    trainer.loss_fn = lambda logp, old, adv, resp, cfg, ref_logp_BT=None, **kw: (
        calls.append((logp.detach(), old, adv, resp, ref_logp_BT))
        or real_loss(logp, old, adv, resp, cfg, ref_logp_BT=ref_logp_BT, **kw))

    def logprobs(*args, with_entropy=False, **kwargs):
        out = real_logprobs(*args, with_entropy=with_entropy, **kwargs)
        if with_entropy:
            ents.append(out[1].detach())
        return out

    trainer.policy.token_logprobs = logprobs
    trainer.train()
    (full, shared), = prepared
    B = len(full)
    assert len(rows_of) == len(calls) == n_mb
    assert torch.equal(torch.cat(rows_of).sort().values, torch.arange(B))  # a partition
    want_adv, _ = group_advantages(full.rollout.rewards_B, G, eps=trainer.cfg.loss.adv_eps)
    assert torch.equal(full.adv_B, want_adv)
    assert full.adv_B.view(-1, G).sum(1).abs().max() < 1e-5 and full.adv_B.abs().sum() > 0
    rows_log = step_rows(trainer.cfg.run_dir)
    for rows, (logp, old, adv, resp, ref), ent, row in zip(rows_of, calls, ents, rows_log):
        assert torch.equal(old, full.old_logp_BT[rows]) and torch.equal(adv, full.adv_B[rows])
        assert ref is not None and torch.equal(ref, full.ref_logp_BT[rows])
        n_tok = float(resp.sum())
        assert row["policy/log_ratio/abs_mean"] == pytest.approx(
            float(((logp - old).abs() * resp).sum()) / n_tok, rel=1e-5, abs=1e-7)
        assert row["policy/entropy"] == pytest.approx(float((ent * resp).sum()) / n_tok,
                                                      rel=1e-5)
    resp_BT = full.response_BT
    mismatch = float(((full.rollout.sampler_logp_BT - full.old_logp_BT).abs() * resp_BT).sum()
                     / resp_BT.sum())
    assert shared["rollout/logprob_mismatch/mean"] == pytest.approx(mismatch, rel=1e-5, abs=1e-9)
