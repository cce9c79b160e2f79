"""Routing Replay in the RL job (megatron_gspo.jobs.rl; GSPO paper, sec. 5.3): what R2 and R3
replay and where (only the loss's forward), flips under replay, router noise, the sampler's
routing and log-prob mismatch, truncated importance sampling."""

from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.sampler import register_sampler
from tests.jsonl import step_rows
from tests.megatron_gspo.jobs.trainers import make_trainer
from tests.megatron_gspo.samplers import backend, shift_routing


def test_routing_replay_is_confined_to_the_policy_forward(tmp_path, monkeypatch):
    """With r2 the loss forward replays pi_old's routes, but rollout / eval never do."""
    from moe.routing.replay import assert_routing_idle

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
    rows = step_rows(trainer.cfg.run_dir)
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
    """Wrap each router's top-k: in the loss's replay forwards (with grad: not the routing
    log-ratio's no-grad one), keep (replayed ids, ids it would pick)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replayed, live = [], []
    for router in policy.router_replays:
        def topk(scores, k, *args, _inner=router.get_replay_topk, _router=router, **kwargs):
            probs, ids = _inner(scores, k, *args, **kwargs)
            if _router.router_replay_action == RouterReplayAction.REPLAY_FORWARD \
                    and torch.is_grad_enabled():
                named = dict(zip(("num_groups", "group_topk", "default_compute_topk"), args),
                             **kwargs)
                compute = named.pop("default_compute_topk")
                replayed.append(ids.detach().cpu())
                live.append(compute(scores, k, **named)[1].detach().cpu())
            return probs, ids
        router.get_replay_topk = topk
    return replayed, live


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
    monkeypatch.setattr(trainer_mod.Trainer, "train_step",
                        lambda self, mb, **_: real_step(self, mb))
    separate = make_trainer(tmp_path, *run, name="separate")
    separate.train()
    assert rows_per_pass == [B // 4] * 8  # before + after for each step
    got, want = (step_rows(t.cfg.run_dir)
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
    last = step_rows(trainer.cfg.run_dir)[-1]
    assert last["replay/cache_bytes"] > 0
    if mode == "r3":
        assert last["rollout/routing_mismatch/mean"] > 0.1
    else:
        assert "rollout/routing_mismatch/mean" not in last


def test_r3_without_kv_cache_is_a_config_error():
    from megatron_gspo.rollout.backends import check_config

    with pytest.raises(ConfigError, match="rollout.decoders.kv_cache=true"):
        check_config(load_config(None, ["train.routing_replay=r3",
                                        "rollout.decoders.kv_cache=false"]))


register_sampler("plain_stub")(lambda policy, tokenizer, cfg: None)  # a Backend() by default


@pytest.mark.parametrize("replay, sampler, dtype, kv_cache, dynamic, sp, want", [
    ("r3", "lean", "same", True, False, True, True),  # R3 always records
    ("off", "lean", "same", True, False, False, False),  # same precision: nothing to measure
    ("off", "lean", "bf16", True, False, False, True),
    ("r2", "megatron", "bf16", True, False, False, True),
    ("off", "lean", "bf16", False, False, False, False),  # no KV cache
    ("off", "lean", "bf16", True, True, False, False),  # dynamic sampling's several rounds
    ("off", "lean", "bf16", True, False, True, False),  # sequence parallelism
    ("off", "megatron_engine", "same", True, False, False, True),  # an engine: always
    ("off", "vllm", "same", False, True, False, False),  # ... but one routing per round
    ("off", "plain_stub", "same", True, False, False, False),  # declares no routing record
    ("off", "lean", "noise", True, False, False, True),  # rollout.decoders.router_noise_std > 0
    ("off", "lean", "noise", False, False, False, False),  # ... with the KV cache only
])
def test_records_sampler_routing_only_where_it_can(replay, sampler, dtype, kv_cache, dynamic, sp,
                                                   want):
    """The sampler records its routing for R3, for an inference engine's mismatch, or for a
    different-precision or noisy-router decoder's mismatch when the KV cache, one round and no
    sequence parallelism make it possible: what its backend declares (`sampler.Backend`)."""
    from megatron_gspo.jobs.rl import Trainer

    noise = dtype == "noise"
    cfg = load_config(None, [
        f"train.routing_replay={replay}", f"rollout.backend={sampler}",
        f"rollout.decoders.kv_cache={kv_cache}", f"filter.dynamic_sampling={dynamic}",
        *(["model.tp=2", "model.sequence_parallel=true"] if sp else []),
        "rollout.decoders.router_noise_std=0.5" if noise
        else f"rollout.decoders.sampler_dtype={dtype}"])
    assert Trainer.records_sampler_routing(SimpleNamespace(cfg=cfg)) is want


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


@pytest.mark.parametrize("mode", ["off", "r2"])
def test_router_noise_reaches_only_the_unreplayed_loss_forward(tmp_path, mode):
    """lr=0: every forward sees the same weights, so without noise every ratio is 1 and no
    expert flips. Noise on the loss's forward moves GRPO's ratios and flips experts, while the
    sampler and pi_old stay clean (their log-probs agree to rounding); under R2 it does nothing."""
    trainer = make_trainer(tmp_path, "train.steps=1", "optim.lr=0.0", "train.num_minibatches=2",
                           "train.router_noise_std=1.0", f"train.routing_replay={mode}",
                           "train.flip_every=1", backend("clean", lambda *a: None))
    policy = trainer.policy
    real = trainer.rt.sampler.sample

    def clean(*args, **kwargs):  # no router carries the noisy top-k while the sampler runs
        assert not any("get_replay_topk" in vars(r) for r in policy.router_replays)
        return real(*args, **kwargs)
    trainer.rt.sampler.sample = clean
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/logprob_mismatch/mean"] < 1e-5  # sampler vs pi_old: both clean
        if mode == "off":
            assert r["moe/loss_routing_vs_old/mean"] > 0.2  # the loss's forward was noisy
            assert r["moe/flip_rate/mean"] == r["moe/loss_routing_vs_old/mean"]
            assert r["policy/log_ratio/abs_max"] > 1e-3  # (an untrained model: small)
        else:
            assert r["moe/loss_routing_vs_old/mean"] == 0.0
            assert r["moe/flip_rate/mean"] == 0.0
            assert r["policy/log_ratio/abs_max"] < 1e-5


def test_r3_pi_old_replays_the_sampler_routing(tmp_path):
    """Under R3 pi_old's forward routes as the sampler did, so a rollout batch's first
    minibatch (pi == pi_old) has ratio 1 exactly, even when the sampler's routing differs from
    the trainer's (before the fix pi_old used the live routing and the first ratio was not 1)."""
    trainer = make_trainer(tmp_path, "train.steps=2", "train.routing_replay=r3",
                           "train.num_minibatches=2", "train.flip_every=1",
                           backend("shifted", shift_routing))
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    first = [r for r in rows if r.get("train/minibatch") == 0]
    later = [r for r in rows if r.get("train/minibatch") == 1]
    assert len(first) == 2 and len(later) == 2
    for r in first:
        assert r["policy/log_ratio/abs_max"] < 1e-5
        assert r["policy/clip_frac/token"] == 0.0
        assert r["moe/loss_routing_vs_old/mean"] == 0.0  # pi_old's routing is the sampler's
        assert r["rollout/routing_mismatch/mean"] > 0.5  # ids shifted (sets may overlap)
        # the sampler really routed as the trainer does live; only its report is shifted
        assert r["rollout/logprob_mismatch/mean"] < 1e-5
        assert r["rollout/logprob_mismatch_r3/mean"] > 1e-3
    assert any(r["policy/log_ratio/abs_max"] > 1e-4 for r in later)  # the check can fail
    # every loss forward used exactly the replayed routes (moe.routing.replay.watch_replayed)
    assert [r["replay/route_diff"] for r in rows if "train/minibatch" in r] == [0.0] * 4


@pytest.mark.parametrize("mode", ["off", "r3"])
def test_bf16_sampler_is_a_real_mismatch_that_tis_reweights(tmp_path, mode):
    """rollout.decoders.sampler_dtype=bf16 with an fp32 trainer: the sampler's log-probs differ
    from the trainer's recompute (fp32 on both sides agrees to < 1e-5, see the noise test above) and
    loss.tis_cap weights the tokens by min(pi_old / pi_sampler, cap); R3 still makes the first
    minibatch on-policy (pi_old replays the bf16 sampler's routing in fp32); without R3 the
    sampler's routing is recorded anyway, to log its mismatch."""
    trainer = make_trainer(tmp_path, "train.steps=1", "rollout.decoders.sampler_dtype=bf16",
                           "loss.tis_cap=1.0001", f"train.routing_replay={mode}",
                           "train.num_minibatches=2")
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    for r in rows:
        assert r["rollout/logprob_mismatch/mean"] > 1e-4
        assert r["policy/tis/max_raw"] > 1.0 and r["policy/tis/mean"] <= 1.0001
        assert r["policy/tis/mean"] != 1.0 and r["policy/tis/clip_frac"] > 0
        assert "rollout/routing_mismatch/mean" in r  # recorded without R3 too
    first = [r for r in rows if r["train/minibatch"] == 0]
    assert first and first[0]["policy/log_ratio/abs_max"] < 1e-5


@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_sampler_router_noise_is_a_routing_mismatch_r3_removes(tmp_path, mode):
    """rollout.decoders.router_noise_std: the sampler routes noisily (rollouts and evals), the
    trainer cleanly. The mismatch is logged in every arm; R3's pi_old replays the sampler's noisy
    routing and reproduces its log-probs to fp32 rounding (the engine's policy exactly), while
    without R3 pi_old is the clean recompute and differs from the sampler's."""
    trainer = make_trainer(tmp_path, "train.steps=1", "rollout.decoders.router_noise_std=1.0",
                           f"train.routing_replay={mode}", "train.num_minibatches=2",
                           "train.eval_every=1")
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    for r in (r for r in rows if "train/minibatch" in r):
        assert r["rollout/routing_mismatch/mean"] > 0.1
        assert r["rollout/logprob_mismatch/mean"] > 1e-3
        if mode == "r3":
            assert r["rollout/logprob_mismatch_r3/mean"] < 1e-5
    first = [r for r in rows if r.get("train/minibatch") == 0]
    assert first and first[0]["policy/log_ratio/abs_max"] < 1e-5  # pi_old is the trainer's


@pytest.mark.parametrize("kind", ["fixed", "fresh"])
def test_sampler_router_noise_is_seeded_per_rollout_and_off_at_zero(tmp_path, kind):
    """The same rollout batch draws the same noise (a resumed run samples what an
    uninterrupted one would); std 0 samples exactly what a run without the knob does."""
    def rollout(*overrides, name):
        trainer = make_trainer(tmp_path, "train.steps=1", *overrides, name=name)
        try:
            batch = trainer.rollout(0)
            return batch.tokens_BT, batch.sampler_logp_BT
        finally:
            trainer.rt.close()

    noise = ["rollout.decoders.router_noise_std=3.0", f"rollout.decoders.router_noise={kind}"]
    tokens, logp = rollout(*noise, name="a")
    again = rollout(*noise, name="b")
    assert torch.equal(tokens, again[0]) and torch.equal(logp, again[1])
    clean = rollout(name="c")
    zero = rollout("rollout.decoders.router_noise_std=0.0", name="d")
    assert torch.equal(clean[0], zero[0]) and torch.equal(clean[1], zero[1])
    assert not torch.equal(logp, clean[1])


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_gspo_on_the_samplers_logprobs_sees_its_routing_mismatch_unless_r3(tmp_path, replay):
    """GSPO with pi_old = the sampler's log-probs: on a rollout batch's first minibatch (the
    weights are pi_old's) the sequence ratio is the sampler-trainer mismatch alone, and a
    routing disagreement puts sequences past GSPO's clip (3e-4 / 4e-4) before any update; R3
    replays the sampler's routing in the loss's forward, so that ratio is 1 and nothing clips
    (docs/pitfalls.md#gspo-on-an-engines-likelihoods)."""
    trainer = make_trainer(tmp_path, "train.steps=1", "loss.name=gspo", "loss.eps_low=3e-4",
                           "loss.eps_high=4e-4", "rollout.use_sampler_logprobs=true",
                           "rollout.decoders.router_noise_std=1.0",
                           f"train.routing_replay={replay}",
                           "train.num_minibatches=2")
    trainer.train()
    first = [r for r in step_rows(trainer.cfg.run_dir) if r.get("train/minibatch") == 0]
    assert len(first) == 1
    if replay == "r3":
        assert first[0]["policy/log_ratio/abs_max"] < 1e-5
        assert first[0]["policy/clip_frac/seq"] == 0.0
    else:
        assert first[0]["policy/log_ratio/abs_mean"] > 1e-3
        assert first[0]["policy/clip_frac/seq"] > 0.0


def test_sampler_router_noise_needs_our_decoders():
    from megatron_gspo.rollout.backends import check_config

    with pytest.raises(ConfigError, match=r"^rollout.decoders.router_noise_std=0.5: needs "
                                          r"rollout.backend=lean or megatron\b.* not 'vllm'$"):
        check_config(load_config(None, ["rollout.decoders.router_noise_std=0.5",
                                        "rollout.backend=vllm"]))
    with pytest.raises(ConfigError, match="rollout.decoders.router_noise_std=-1"):
        load_config(None, ["rollout.decoders.router_noise_std=-1"])


def test_tis_with_sampler_logprobs_is_a_config_error():
    with pytest.raises(ConfigError, match="loss.tis_cap"):
        load_config(None, ["loss.tis_cap=2", "rollout.use_sampler_logprobs=true"])


def test_tis_weight_is_pi_old_over_the_sampler_capped():
    """min(exp(old - sampler), cap) in the trainer's direction: a token pi_old likes more than
    the sampler did is up-weighted (to the cap), one it likes less down-weighted."""
    from megatron_gspo.jobs.rl import Trainer

    stub = SimpleNamespace(cfg=load_config(None, ["loss.tis_cap=2"]))
    resp_BT = torch.ones(1, 2)
    mb = SimpleNamespace(old_logp_BT=torch.tensor([[-1.0, -2.0]]), response_BT=resp_BT,
                         rollout=SimpleNamespace(sampler_logp_BT=torch.tensor([[-2.0, -1.5]])))
    kwargs, _ = Trainer.tis(stub, mb)
    torch.testing.assert_close(kwargs["is_weight_BT"],
                               torch.tensor([[2.0, float(torch.tensor(-0.5).exp())]]))


def test_use_sampler_logprobs_makes_pi_old_the_samplers(tmp_path):
    """rollout.use_sampler_logprobs=true: the loss's pi_old is the sampler's log-probs (here
    shifted so they cannot agree with the trainer's recompute by rounding)."""
    def shifted(s, prompts, params):
        s.logp_BT -= 0.25 * s.response_BT

    shifted_logprobs = backend("shifted_logprobs", shifted)
    for flag in ("true", "false"):
        trainer = make_trainer(tmp_path, "train.steps=1", f"rollout.use_sampler_logprobs={flag}",
                               shifted_logprobs, name=f"s_{flag}")
        batch = trainer.rollout(0)
        full, _ = trainer.prepare(batch)
        assert torch.equal(full.old_logp_BT, batch.sampler_logp_BT) == (flag == "true")
        trainer.rt.close()
