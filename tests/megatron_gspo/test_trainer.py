"""Trainer: off-policy minibatches, resume, NaN guard, replay isolation, flips, CLI errors."""

import os

import pytest
import torch

from megatron_gspo.config.schema import ConfigError, load_config
from megatron_gspo.run.metrics import read_jsonl

BASE = ["model.preset=tiny", "task.name=addition", "task.kwargs.num_digits=1", "task.n_train=60",
        "task.n_eval=8", "rollout.prompts_per_batch=4", "rollout.group_size=4",
        "rollout.max_new_tokens=3", "train.num_minibatches=4", "train.eval_every=0",
        "train.save_every=1", "wandb.mode=disabled", "optim.lr=3e-3", "loss.name=grpo"]


def digit_first(example, completion: str) -> float:
    """A reward an untrained policy earns ~40% of the time, so groups have variance."""
    return float(completion[:1].isdigit())


def make_trainer(tmp_path, *overrides, name="run", **parts):
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*BASE, f"run_dir={tmp_path / name}", *overrides])
    trainer = Trainer.from_config(cfg, **parts)
    object.__setattr__(trainer.rt.task, "reward", digit_first)  # frozen dataclass
    return trainer


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.model.module.named_parameters()}


def test_first_minibatch_is_on_policy_later_ones_are_not(tmp_path):
    """Ratio is exactly 1 on the first minibatch (pi == pi_old) and moves after a step
    (docs/pitfalls.md#minibatches: with one minibatch GSPO would be plain on-policy PG)."""
    trainer = make_trainer(tmp_path, "train.steps=1", "loss.name=gspo")
    trainer.train()
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert [r["train/minibatch"] for r in rows] == [0, 1, 2, 3]
    assert abs(rows[0]["policy/ratio/mean"] - 1.0) < 1e-5
    assert rows[0]["policy/clip_frac/token"] == 0.0
    assert max(abs(r["policy/ratio/mean"] - 1.0) for r in rows[1:]) > 1e-5


def test_resume_gives_the_same_next_step(tmp_path):
    straight = make_trainer(tmp_path, "train.steps=2", name="straight")
    straight.train()
    first = make_trainer(tmp_path, "train.steps=1", name="resumed")
    first.train()
    resumed = make_trainer(tmp_path, "train.steps=2", name="resumed")
    assert resumed.state.iteration == 1 and resumed.state.opt_step == 4
    resumed.train()
    a, b = params(straight), params(resumed)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=1e-6, msg=n)
    rows_a = read_jsonl(os.path.join(straight.cfg.run_dir, "metrics.jsonl"))
    rows_b = read_jsonl(os.path.join(resumed.cfg.run_dir, "metrics.jsonl"))
    assert rows_a[-1]["reward/mean"] == rows_b[-1]["reward/mean"]
    assert rows_a[-1]["policy/loss"] == pytest.approx(rows_b[-1]["policy/loss"], abs=1e-6)
    # the log keeps the rows up to the checkpoint's optimizer step, none twice
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]


def test_nan_loss_is_skipped_then_aborts_without_losing_checkpoints(tmp_path):
    make_trainer(tmp_path, "train.steps=1", "train.max_skipped_steps=2").train()  # checkpointed
    trainer = make_trainer(tmp_path, "train.steps=3", "train.max_skipped_steps=2")
    before = params(trainer)
    real = trainer.loss_fn

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    trainer.loss_fn = nan_loss
    with pytest.raises(FloatingPointError, match="max_skipped_steps=2"):
        trainer.train()  # 4 minibatches: the 3rd consecutive skip aborts
    after = params(trainer)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert any(r.get("train/skipped") == 1.0 for r in rows)
    ckpt = os.path.join(trainer.cfg.run_dir, "checkpoints")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "1"


def test_no_update_means_zero_flips_and_update_means_some(tmp_path):
    frozen = make_trainer(tmp_path, "train.steps=1", "optim.lr=0.0", name="frozen")
    frozen.train()
    rows = read_jsonl(os.path.join(frozen.cfg.run_dir, "metrics.jsonl"))
    assert all(r["moe/flip_rate/mean"] == 0.0 for r in rows)
    moving = make_trainer(tmp_path, "train.steps=1", "optim.lr=0.05", name="moving")
    moving.train()
    rows = read_jsonl(os.path.join(moving.cfg.run_dir, "metrics.jsonl"))
    assert max(r["moe/flip_rate/mean"] for r in rows) > 0.0
    assert "moe/flip_rate/layer_01" in rows[0] and "moe/load_imbalance/layer_00" in rows[0]


def test_routing_replay_is_confined_to_the_policy_forward(tmp_path, monkeypatch):
    """With r2 the loss forward replays pi_old's routes, but rollout / eval never do."""
    from moe.replay import assert_routing_idle

    trainer = make_trainer(tmp_path, "train.steps=1", "train.routing_replay=r2",
                           "train.eval_every=1")
    real_sample, calls = trainer.rt.sampler.sample, []

    def checked_sample(*args, **kwargs):  # the run's sampler: rollouts and eval
        assert_routing_idle(trainer.policy)
        calls.append(1)
        return real_sample(*args, **kwargs)

    trainer.rt.sampler.sample = checked_sample
    replayed, live = _spy_replayed_routes(trainer.policy)
    trainer.train()
    assert_routing_idle(trainer.policy)
    assert len(calls) >= 3  # the start eval, the rollout, the eval after it
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    last = rows[-1]
    assert last["replay/cache_bytes"] > 0
    L, n_mb = len(trainer.policy.router_replays), trainer.cfg.train.num_minibatches
    assert len(replayed) == L * n_mb  # every loss forward replays, in every layer
    # the first minibatch's policy forward (pi == pi_old) replays exactly what it would route
    for r, v in zip(replayed[:L], live[:L]):
        assert torch.equal(r.sort(-1).values, v.sort(-1).values)
    # later forwards still get pi_old's routes while the live router has moved (drift > 0)
    moved = sum(int((r.sort(-1).values != v.sort(-1).values).any(-1).sum())
                for r, v in zip(replayed[L:], live[L:]))
    assert moved > 0 and last["moe/drift_vs_old/mean"] > 0


def _spy_replayed_routes(policy):
    """Wrap each router's top-k: in replay forwards, keep (replayed ids, ids it would pick)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replayed, live = [], []
    for router in policy.router_replays:
        def topk(scores, k, *args, _inner=router.get_replay_topk, _router=router, **kwargs):
            probs, ids = _inner(scores, k, *args, **kwargs)
            if _router.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                named = dict(zip(("num_groups", "group_topk", "default_compute_topk"), args),
                             **kwargs)
                compute = named.pop("default_compute_topk")
                replayed.append(ids.detach().cpu())
                live.append(compute(scores, k, **named)[1].detach().cpu())
            return probs, ids
        router.get_replay_topk = topk
    return replayed, live


def test_sft_checkpoint_initialises_rl(tmp_path):
    from megatron_gspo.jobs.sft import run_sft

    sft_cfg = load_config(None, [*BASE, f"run_dir={tmp_path / 'sft'}", "sft.steps=3",
                                 "sft.batch_size=8", "sft.eval_every=0"])
    run_sft(sft_cfg)
    trainer = make_trainer(tmp_path, "train.steps=1", f"init_checkpoint={tmp_path / 'sft'}")
    from megatron_gspo.run.setup import build_policy
    from moe import dist_ckpt

    fresh = build_policy(trainer.cfg, trainer.rt.tokenizer.vocab_size, optim=None)
    saved = build_policy(trainer.cfg, trainer.rt.tokenizer.vocab_size, optim=None, seed=123)
    dist_ckpt.load(saved, str(tmp_path / "sft" / "checkpoints" / "step_000003" / "dist"))
    fresh, saved = dict(fresh.model.module.named_parameters()), \
        dict(saved.model.module.named_parameters())
    for n, p in trainer.policy.model.module.named_parameters():
        torch.testing.assert_close(p.detach(), saved[n], atol=0, rtol=0, msg=n)
    assert any(not torch.equal(p, saved[n]) for n, p in fresh.items())  # SFT moved them
    # the weights only: RL starts with a fresh Adam and lr schedule, not SFT's 3 updates
    assert trainer.policy.optimizer.scheduler.num_steps == 0


def test_missing_init_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="init_checkpoint=.*nope: no such directory"):
        make_trainer(tmp_path, f"init_checkpoint={tmp_path / 'nope'}")
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written


@pytest.mark.parametrize("argv, fragment", [
    (["train", "train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train", "--config", "nope.yaml"], "config file not found: nope.yaml"),
    (["train", "train.routing_replay=r3", "rollout.kv_cache=false"], "rollout.kv_cache=true"),
    (["train", "task.kwargs.num_digits=1", "wandb.mode=disabled", "run_dir=RUN"],
     "task.n_train / task.n_eval: Addition(num_digits=1) has only 100 distinct prompts"),
    (["train", "task.name=dataset", "data.train_files=[BAD]", "wandb.mode=disabled",
      "run_dir=RUN"], "bad.jsonl:1: not valid JSON"),
])
def test_cli_bad_config_exits_2_naming_the_problem(capsys, tmp_path, argv, fragment):
    from megatron_gspo.cli import main

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    argv = [a.replace("RUN", str(tmp_path / "run")).replace("BAD", str(tmp_path / "bad.jsonl"))
            for a in argv]

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_flips_under_replay_take_one_forward_per_step_and_equal_separate_passes(tmp_path,
                                                                                monkeypatch):
    """R2, flip_every=1, 4 minibatches: the "before" routing comes from pi_old's pass (first
    step) or the previous step's "after" pass over both minibatches, so 4 no-grad routing
    passes instead of 8, with the same flip and drift metrics as separate passes."""
    from megatron_gspo.algo import flips
    from megatron_gspo.jobs import rl as trainer_mod

    rows_per_pass, real_routing = [], flips.current_routing
    monkeypatch.setattr(flips, "current_routing", lambda policy, tokens_BT, *a, **k: (
        rows_per_pass.append(tokens_BT.shape[0]) or real_routing(policy, tokens_BT, *a, **k)))
    run = ["train.steps=1", "train.routing_replay=r2", "train.num_minibatches=4",
           "train.flip_every=1", "optim.lr=0.05"]
    shared = make_trainer(tmp_path, *run, name="shared")
    B = shared.local_prompts * shared.cfg.rollout.group_size
    shared.train()
    assert rows_per_pass == [B // 2] * 3 + [B // 4]  # 3 passes over 2 minibatches, then 1
    rows_per_pass.clear()
    real_step = trainer_mod.Trainer.train_step
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", lambda self, mb, **_: real_step(self, mb))
    separate = make_trainer(tmp_path, *run, name="separate")
    separate.train()
    assert rows_per_pass == [B // 4] * 8  # before + after for each step
    got, want = (read_jsonl(os.path.join(t.cfg.run_dir, "metrics.jsonl"))
                 for t in (shared, separate))
    keys = [k for k in want[0] if k.startswith(("moe/flip_rate/", "moe/drift_vs_old/"))]
    assert keys and max(r["moe/flip_rate/mean"] for r in want) > 0
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_replay_source_is_pi_old_for_r2_and_the_sampler_for_r3(tmp_path, monkeypatch, mode):
    """The sampler's routing is made to differ from pi_old's (on CPU they agree exactly, see
    test_rollout), so replaying the wrong one is caught."""
    from megatron_gspo.algo import flips as flips_mod
    from megatron_gspo.jobs import rl as trainer_mod
    from tests.megatron_gspo.samplers import backend, shift_routing

    trainer = make_trainer(tmp_path, "train.steps=1", f"train.routing_replay={mode}",
                           "train.num_minibatches=2", "train.flip_every=1",
                           backend("shifted", shift_routing))
    real_step, seen = trainer_mod.Trainer.train_step, []

    def spy(self, mb, **kwargs):
        assert (mb.rollout.routing is None) == (mode == "r2")
        source = mb.rollout.routing if mode == "r3" else mb.old_routing
        assert torch.equal(mb.replay.ids_NLK, source.ids_NLK)
        seen.append(mode)
        return real_step(self, mb, **kwargs)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", spy)
    befores = []

    class SpyFlips(flips_mod.StepFlips):
        def __init__(self, *args, before=None, **kwargs):
            befores.append(before)
            super().__init__(*args, before=before, **kwargs)

    monkeypatch.setattr(flips_mod, "StepFlips", SpyFlips)
    trainer.train()
    assert seen == [mode, mode]
    # flips compare the live routing before and after a step: pi_old's routing stands in for
    # "before" on the first step under R2 only; under R3 it is the (shifted) sampler's
    assert (befores[0] is not None) == (mode == "r2")
    last = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))[-1]
    assert last["replay/cache_bytes"] > 0
    if mode == "r3":
        assert last["rollout/routing_mismatch/mean"] > 0.1
    else:
        assert "rollout/routing_mismatch/mean" not in last


def test_r3_without_kv_cache_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.kv_cache=true"):
        load_config(None, ["train.routing_replay=r3", "rollout.kv_cache=false"])


def test_minibatch_select_keeps_every_part_row_aligned():
    """One `select` slices tokens, pi_old log-probs, advantages and both routing caches."""
    from megatron_gspo.rollout.batch import RolloutBatch
    from megatron_gspo.jobs.rl import Minibatch, TrainerState
    from moe.replay import RoutingReplayCache

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
    state = TrainerState.from_dict({"iteration": 2, "opt_step": 8, "unknown": 1})
    assert (state.iteration, state.opt_step, state.reward_ema) == (2, 8, None)


def test_batch_passes_in_token_budgeted_forwards_equal_one_pass(tmp_path):
    """train.logprob_max_tokens: pi_old's pass, R3's replayed pi_old pass and the reference
    policy's run in forwards of at most that many tokens, with the numbers of one pass."""
    over = ["train.routing_replay=r3", "loss.kl_coef=0.1"]
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
    rows_log = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
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


def test_non_finite_loss_with_finite_grads_is_skipped(tmp_path):
    """The guard reads the loss itself, not only the grad norm: loss + inf has finite grads."""
    trainer = make_trainer(tmp_path, "train.steps=1", "train.max_skipped_steps=10")
    before, real = params(trainer), trainer.loss_fn

    def inf_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss + float("inf"), metrics

    trainer.loss_fn = inf_loss
    trainer.train()
    after = params(trainer)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert [r["train/skipped"] for r in rows] == [1.0] * 4
    assert trainer.state.skipped_in_a_row == 4


def _stub(**train):
    from types import SimpleNamespace

    from megatron_gspo.jobs.rl import TrainerState

    cfg = load_config(None, [*BASE, *(f"train.{k}={v}" for k, v in train.items())])
    return SimpleNamespace(cfg=cfg, state=TrainerState(),
                           rt=SimpleNamespace(info=SimpleNamespace(is_main=False)))


def test_guard_aborts_after_more_than_max_consecutive_skips_and_a_step_resets():
    from megatron_gspo.jobs.rl import Trainer

    t = _stub(max_skipped_steps=2)
    for stepped in (False, False, True, False, False):  # 2 in a row, reset, 2 in a row
        assert Trainer.guard(t, stepped) == {"train/skipped": float(not stepped)}
    assert t.state.skipped_in_a_row == 2
    with pytest.raises(FloatingPointError, match="3 consecutive"):
        Trainer.guard(t, False)


def test_local_prompts_checks_each_data_parallel_ranks_rows():
    from megatron_gspo.jobs.rl import local_prompts

    cfg = load_config(None, [*BASE, "train.num_minibatches=8", "rollout.group_size=4"])
    assert local_prompts(cfg, 1) == 4 and local_prompts(cfg, 2) == 2  # 16 / 8 rows per rank
    cfg = load_config(None, [*BASE, "train.num_minibatches=16", "rollout.group_size=4"])
    assert local_prompts(cfg, 1) == 4
    with pytest.raises(ConfigError, match="num_minibatches=16"):
        local_prompts(cfg, 2)  # 8 rows per rank do not split into 16
    with pytest.raises(ConfigError, match="not divisible"):
        local_prompts(cfg, 3)


def test_save_every_also_saves_the_last_rollout_batch():
    from megatron_gspo.jobs.rl import Trainer

    t = _stub(save_every=3, steps=4)
    assert [Trainer.should_save(t, i) for i in range(1, 5)] == [False, False, True, True]
    assert not Trainer.should_save(_stub(save_every=0, steps=4), 4)


def test_reward_collapse_alert_follows_the_ema():
    from megatron_gspo.jobs.rl import Trainer

    t = _stub(collapse_reward_drop=0.5)
    assert Trainer.collapse_alerts(t, {"reward/mean": 1.0})["alert/reward_collapse"] == 0.0
    out = Trainer.collapse_alerts(t, {"reward/mean": 0.0})  # ema 0.7 of best 1.0: no alert
    assert t.state.reward_ema == pytest.approx(0.7) and out["alert/reward_collapse"] == 0.0
    Trainer.collapse_alerts(t, {"reward/mean": 0.0})  # 0.49 < 0.5: alert
    assert t.state.reward_ema == pytest.approx(0.49) and t.state.best_reward_ema == 1.0
    assert Trainer.collapse_alerts(t, {"reward/mean": 0.0})["alert/reward_collapse"] == 1.0
