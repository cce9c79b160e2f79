"""Routing Replay in the trainer: router noise reaches only the loss's forward (and replay
removes it)."""

import os

import pytest

from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.samplers import backend, shift_routing
from tests.megatron_gspo.test_trainer import make_trainer


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
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
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
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
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


@pytest.mark.parametrize("mode", ["off", "r3"])
def test_bf16_sampler_is_a_real_mismatch_that_tis_reweights(tmp_path, mode):
    """rollout.sampler_dtype=bf16 with an fp32 trainer: the sampler's log-probs differ from the
    trainer's recompute (fp32 on both sides agrees to < 1e-5, see the noise test above) and
    loss.tis_cap weights the tokens by min(pi_old / pi_sampler, cap); R3 still makes the first
    minibatch on-policy (pi_old replays the bf16 sampler's routing in fp32); without R3 the
    sampler's routing is recorded anyway, to log its mismatch."""
    trainer = make_trainer(tmp_path, "train.steps=1", "rollout.sampler_dtype=bf16",
                           "loss.tis_cap=1.0001", f"train.routing_replay={mode}",
                           "train.num_minibatches=2")
    trainer.train()
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    for r in rows:
        assert r["rollout/logprob_mismatch/mean"] > 1e-4
        assert r["policy/tis/max_raw"] > 1.0 and r["policy/tis/mean"] <= 1.0001
        assert r["policy/tis/mean"] != 1.0 and r["policy/tis/clip_frac"] > 0
        assert "rollout/routing_mismatch/mean" in r  # recorded without R3 too
    first = [r for r in rows if r["train/minibatch"] == 0]
    assert first and first[0]["policy/log_ratio/abs_max"] < 1e-5


def test_tis_with_sampler_logprobs_is_a_config_error():
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.tis_cap"):
        load_config(None, ["loss.tis_cap=2", "rollout.use_sampler_logprobs=true"])


def test_tis_weight_is_pi_old_over_the_sampler_capped():
    """min(exp(old - sampler), cap) in the trainer's direction: a token pi_old likes more than
    the sampler did is up-weighted (to the cap), one it likes less down-weighted."""
    from types import SimpleNamespace

    import torch

    from megatron_gspo.config.schema import load_config
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
    import torch

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
