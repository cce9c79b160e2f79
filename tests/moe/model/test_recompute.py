"""Activation recompute (megatron's recompute_granularity / recompute_modules) leaves the
gradients unchanged, with and without Routing Replay."""

import pytest
import torch

from tests.moe.grads import reduce_grads, reduced_grads
from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.model.settings import ParallelLayout, Recompute
from moe.routing.replay import (RoutingReplayCache, assert_routing_idle, current_routing,
                                replay_routing)
from tests.moe.parallel_worker import batch, loss_fn

SETTINGS = [Recompute("selective", ("moe",)), Recompute("selective", ("core_attn",)),
            Recompute("full")]


def grads_after(recompute: Recompute, forwards):
    """Grads of one backward through the summed losses of `forwards(policy)` (a list), on a
    fresh tiny policy, and the policy."""
    preset = get_preset("tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=3,
                             optim=None, recompute=recompute)
    policy.zero_grad()
    policy.backward(sum(forwards(policy)))
    reduce_grads(policy)
    assert_routing_idle(policy)
    return reduced_grads(policy), policy


def grads(recompute: Recompute, replay_from: RoutingReplayCache | None = None):
    """Grads of the fixed-batch loss (optionally under a forced routing), and the policy."""
    tokens_BT, valid_BT, readout_BTV = batch(get_preset("tiny").vocab_size)

    def forwards(policy):
        with replay_routing(policy, replay_from):
            return [loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)]

    return grads_after(recompute, forwards)


def forced_routing(policy) -> RoutingReplayCache:
    """A routing unlike the live one: each token's live top-k shifted to other experts."""
    tokens_BT, valid_BT, _ = batch(policy.preset.vocab_size)
    _, live = current_routing(policy, tokens_BT, valid_BT)
    shifted = (live.ids_NLK.long() + 1) % policy.preset.num_experts
    return RoutingReplayCache(shifted.to(live.ids_NLK.dtype), live.valid_BT, live.num_experts)


@pytest.mark.parametrize("recompute", SETTINGS, ids=lambda r: f"{r.granularity}-{r.modules}")
def test_recompute_gives_the_same_grads(single_process, recompute):
    ref, _ = grads(Recompute())
    got, policy = grads(recompute)
    assert policy.model.module.config.recompute_granularity == recompute.granularity
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("recompute", [SETTINGS[0], SETTINGS[2]],
                         ids=lambda r: f"{r.granularity}")
def test_recompute_replays_the_forward_routing_in_the_backward(single_process, recompute):
    """Under Routing Replay the recomputed routers replay the cached routing too: the grads
    are those of the replayed forward, not of the live routing the routers would pick."""
    live_grads, policy = grads(Recompute())
    forced = forced_routing(policy)
    ref, _ = grads(Recompute(), replay_from=forced)
    got, _ = grads(recompute, replay_from=forced)
    router = next(n for n in ref if "router" in n)
    assert not torch.allclose(ref[router], live_grads[router])  # the replay matters
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_a_no_grad_replayed_forward_queues_nothing_for_the_backward(single_process):
    """A replayed no-grad forward (pi_old's pass under R3, eval) has no backward: queueing its
    routing would make the next backward's recompute replay it instead of the live routing."""
    tokens_BT, valid_BT, readout_BTV = batch(get_preset("tiny").vocab_size)

    def forwards(policy):
        with torch.no_grad(), replay_routing(policy, forced_routing(policy)):
            policy.logits(tokens_BT, valid_BT)
        assert policy.backward_replays == []
        return [loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)]

    ref, _ = grads_after(Recompute(), forwards)
    got, _ = grads_after(Recompute("full"), forwards)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("recompute", [SETTINGS[0], SETTINGS[2]],
                         ids=lambda r: f"{r.granularity}")
def test_two_replayed_forwards_then_one_backward(single_process, recompute):
    """Two forwards under different replayed routings, one backward: autograd recomputes the
    later forward first, so each recompute must still replay its own forward's routing."""
    preset = get_preset("tiny")
    first, second = batch(preset.vocab_size), batch(preset.vocab_size, seed=8)

    def forwards(policy):
        losses = []
        for shift, (tokens_BT, valid_BT, readout_BTV) in ((1, first), (2, second)):
            _, live = current_routing(policy, tokens_BT, valid_BT)
            ids = (live.ids_NLK.long() + shift) % preset.num_experts
            forced = RoutingReplayCache(ids.to(torch.uint8), live.valid_BT, live.num_experts)
            with replay_routing(policy, forced):
                losses.append(loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT,
                                      readout_BTV))
        return losses

    ref, _ = grads_after(Recompute(), forwards)
    got, _ = grads_after(recompute, forwards)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("granularity,modules", [("partial", ("moe",)), (None, ("mlp",)),
                                                 ("selective", ())])
def test_bad_recompute_settings_raise(granularity, modules):
    """An unknown granularity, a module this model lacks, or 'selective' with nothing to
    recompute are refused."""
    with pytest.raises(ValueError, match="recompute"):
        Recompute(granularity, modules)


def test_recompute_config_fields_and_whether_routers_rerun():
    """Each setting's TransformerConfig fields ('full': every layer, one per unit), and
    `routing` (the routers run again in the backward) only where the MoE layer is recomputed."""
    assert Recompute().config_kwargs() == {} and not Recompute().routing
    full = Recompute("full", ())
    assert full.routing and full.config_kwargs() == dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    attn = Recompute("selective", ("core_attn",))
    both = Recompute("selective", ("core_attn", "moe"))
    assert not attn.routing and both.routing
    assert attn.config_kwargs() == dict(recompute_granularity="selective",
                                        recompute_modules=["core_attn"])
    assert both.config_kwargs()["recompute_modules"] == ["core_attn", "moe"]
