"""Sequence packing in the RL step (train.pack): packed forwards give the padded step's pi_old
pass, log-probs, loss and gradients to float32 rounding for every loss, without replay and
with R2 and R3, in microbatches binned by real tokens; the flips per layer are the padded
run's; the step logs its padding share and microbatch count."""

import contextlib
import math

import pytest
import torch

from tests.jsonl import step_rows
from tests.megatron_gspo.jobs.trainers import make_trainer

ATOL = 1e-6  # float32: packed and padded forwards differ by summation order only
RAGGED = ("task.kwargs.num_digits=3", "rollout.max_new_tokens=5")
"""Prompts of 4 to 8 tokens (left padding) and responses up to 5 (right padding)."""


def _grads(policy) -> dict:
    return {n: p.main_grad.clone() for n, p in policy.model.module.named_parameters()}


def _step(trainer, mb):
    """One minibatch's forwards and backwards (no optimizer step): (log-probs, loss metrics,
    grads)."""
    from megatron_gspo.jobs.rl_step import accumulate

    policy = trainer.policy
    policy.zero_grad()
    tis, _ = trainer.tis(mb)
    done = accumulate(policy, mb, trainer.cfg, trainer.loss_fn, tis,
                      lambda rows: contextlib.nullcontext(), (0.0, None))
    assert done.finite
    return done.logp_BT, done.metrics, _grads(policy)


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_packed_step_equals_the_padded_step(tmp_path, loss, replay):
    """The same rollout batch through the padded and the packed trainer: pi_old's log-probs
    and routing (R3: pi_old replaying the sampler's routing; grpo: with the KL reference's),
    in forwards of 40 tokens (packed: bins in another row order), then a minibatch's step in
    microbatches of a 24-token budget (packed: bins of real tokens in another row order than
    the padded row chunks), log-probs, loss and every gradient within 1e-6."""
    t = make_trainer(tmp_path, *RAGGED, "train.pack=false", f"loss.name={loss}",
                     f"train.routing_replay={replay}", "train.micro_max_tokens=24",
                     "train.logprob_max_tokens=40",
                     "loss.kl_coef=0.01" if loss == "grpo" else "loss.kl_coef=0")
    batch = t.rollout(0)
    padded, _ = t.prepare(batch)
    mb_rows = torch.randperm(len(batch), generator=torch.Generator().manual_seed(0))[:4]
    mb = padded.select(mb_rows)
    want_logp, want_metrics, want_grads = _step(t, mb)
    t.policy.pack = True
    if t.ref_policy is not None:
        t.ref_policy.pack = True
    packed, _ = t.prepare(batch)
    resp_BT = batch.response_BT.bool()
    assert resp_BT.sum() > 20
    torch.testing.assert_close(packed.old_logp_BT[resp_BT], padded.old_logp_BT[resp_BT],
                               atol=ATOL, rtol=0)
    if padded.ref_logp_BT is not None:
        torch.testing.assert_close(packed.ref_logp_BT[resp_BT], padded.ref_logp_BT[resp_BT],
                                   atol=ATOL, rtol=0)
    assert torch.equal(packed.old_routing.ids_NLK.sort(-1).values,
                       padded.old_routing.ids_NLK.sort(-1).values)
    got_logp, got_metrics, got_grads = _step(t, mb)
    resp = mb.response_BT.bool()
    torch.testing.assert_close(got_logp[resp], want_logp[resp], atol=ATOL, rtol=0)
    assert abs(got_metrics["policy/loss"] - want_metrics["policy/loss"]) <= ATOL
    assert 2 <= got_metrics["train/microbatches"] < want_metrics["train/microbatches"]
    assert want_metrics["train/pad_frac"] > 0 == got_metrics["train/pad_frac"]
    assert max(float(g.abs().max()) for g in want_grads.values()) > 1e-4  # a real gradient
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("replay", ["off", "r2"])
def test_flips_per_layer_are_the_padded_runs(tmp_path, replay):
    """One rollout batch (4 optimizer steps, flips measured at each) of the padded and the
    packed run from the same weights and seed: the same flips, layer by layer, and the same
    losses to float rounding."""
    rows = {}
    for pack in (False, True):
        t = make_trainer(tmp_path, *RAGGED, "train.steps=1", "train.flip_every=1",
                         f"train.routing_replay={replay}", f"train.pack={str(pack).lower()}",
                         "train.micro_max_tokens=24", name=f"pack_{pack}")
        t.train()
        rows[pack] = step_rows(t.cfg.run_dir)
    keys = [k for k in rows[False][0] if k.startswith(("moe/flip_rate", "moe/drift_vs_old",
                                                       "moe/loss_routing_vs_old", "moe/any_flip"))]
    assert any("layer_01" in k for k in keys)
    assert any(r["moe/flip_rate/mean"] > 0 for r in rows[False])
    for a, b in zip(rows[False], rows[True]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert math.isclose(a["policy/loss"], b["policy/loss"], rel_tol=1e-5, abs_tol=1e-6)
        assert b["train/pad_frac"] == 0 < a["train/pad_frac"]


def test_packing_is_refused_where_it_cannot_run():
    """One line naming the key and the way out, before anything is claimed: megatron's
    attention has no packed path, and the all-gather dispatcher across EP ranks needs equal
    token counts; sft.pack for SFT, train.pack for RL; off packs nothing."""
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.jobs import rl, sft
    from megatron_gspo.run.setup import packs

    with pytest.raises(ConfigError, match="train.pack=true packs sequences.*model.attention="
                                          "sdpa or train.pack=false"):
        packs(load_config(None, ["model.attention=megatron"]), rl.SPEC)
    with pytest.raises(ConfigError, match="sft.pack=true with model.ep=2 needs "
                                          "model.dispatcher=alltoall"):
        packs(load_config(None, ["model.ep=2", "model.dispatcher=allgather"]), sft.SPEC)
    assert not packs(load_config(None, ["model.attention=megatron", "train.pack=false"]),
                     rl.SPEC)
    assert packs(load_config(None, ["model.ep=2"]), rl.SPEC)  # auto: the all-to-all
