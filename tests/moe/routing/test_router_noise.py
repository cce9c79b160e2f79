"""Router-logit noise on the top-k selection: changes which experts run (reproducibly), keeps
the gate weights clean, is ignored under replay, leaves no trace outside its context, and is
replayed by activation recompute."""

import dataclasses

import pytest
import torch

from tests.moe.grads import reduce_grads, reduced_grads
from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.routing.replay import assert_routing_idle, current_routing, record_routing, replay_routing
from moe.routing.noise import router_noise
from moe.routing.stats import flip_stats
from moe.model.settings import ParallelLayout, Recompute
from tests.moe.parallel_worker import batch, loss_fn

PRESET = get_preset("tiny")


def build(recompute=Recompute(), seed=3, norm_topk_prob=True):
    """A tiny policy; norm_topk_prob=False gives pre-softmax routers (scores are probs)."""
    preset = dataclasses.replace(PRESET, norm_topk_prob=norm_topk_prob)
    return MoEPolicy.build(preset, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=seed,
                           optim=None, recompute=recompute)


def noisy_routing(policy, std, seed):
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    with torch.no_grad(), router_noise(policy, std, torch.Generator().manual_seed(seed)), \
            record_routing(policy) as rec:
        logits = policy.logits(tokens_BT, valid_BT)
    return rec, logits


def mean_flip(old_L, new_L, valid_BT):
    valid_N = valid_BT.transpose(0, 1).reshape(-1)  # megatron's rows are sequence-first
    return sum(flip_stats(o[valid_N], n[valid_N], PRESET.num_experts)["flip_rate"]
               for o, n in zip(old_L, new_L)) / len(old_L)


def test_noise_flips_experts_reproducibly_and_only_inside(single_process):
    policy = build()
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    clean_logits = policy.logits(tokens_BT, valid_BT).detach()
    clean, _ = noisy_routing(policy, 0.0, seed=7)  # std 0: the plain routing
    flips = []
    for std in (0.05, 1.0):
        rec, _ = noisy_routing(policy, std, seed=7)
        again, _ = noisy_routing(policy, std, seed=7)
        assert all(torch.equal(a, b) for a, b in zip(rec, again))  # same seed, same routing
        flips.append(mean_flip(clean, rec, valid_BT))
    assert 0.0 < flips[0] < flips[1], flips
    assert flips[1] > 0.3, flips
    other, _ = noisy_routing(policy, 1.0, seed=8)
    assert not all(torch.equal(a, b) for a, b in zip(rec, other))  # the seed matters
    # nothing leaks: a plain forward afterwards is the clean one
    torch.testing.assert_close(policy.logits(tokens_BT, valid_BT).detach(), clean_logits,
                               rtol=0, atol=0)
    assert_routing_idle(policy)
    assert "get_replay_topk" not in vars(policy.router_replays[0])


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_gate_weights_come_from_the_clean_logits(single_process, norm_topk_prob):
    """Noise that cannot change any selection (tiny std) leaves the logits bit-identical, also
    for pre-softmax routers (their gates are the clean probs, not the log-probs noise used)."""
    policy = build(norm_topk_prob=norm_topk_prob)
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    clean = policy.logits(tokens_BT, valid_BT).detach()
    _, noisy = noisy_routing(policy, 1e-30, seed=1)
    torch.testing.assert_close(noisy, clean, rtol=0, atol=0)
    _, flipped = noisy_routing(policy, 1.0, seed=1)
    assert (flipped - clean).abs().max() > 1e-3  # the check can fail


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_noisy_selection_is_topk_of_clean_logits_plus_scaled_draws(single_process,
                                                                   norm_topk_prob):
    """Each router call picks the top-k of its clean logits + std * z, z one [N, E] draw per
    call from the generator, layer by layer; a pre-softmax router (norm_topk_prob=False) adds
    the noise to log-probs, which rank as logits + std * z (probs + std * z would not)."""
    policy, std = build(norm_topk_prob=norm_topk_prob), 0.7
    logits_L = []
    for layer in policy.model.module.decoder.layers:
        def routing(logits, *args, _real=layer.mlp.router.routing, **kwargs):
            logits_L.append(logits.detach().reshape(-1, PRESET.num_experts).float())
            return _real(logits, *args, **kwargs)
        layer.mlp.router.routing = routing
    rec, _ = noisy_routing(policy, std, seed=3)
    assert len(logits_L) == len(rec) == PRESET.num_layers
    g = torch.Generator().manual_seed(3)
    for logits_NE, ids_NK in zip(logits_L, rec):
        z_NE = torch.randn(logits_NE.shape, generator=g)
        want_NK = (logits_NE + std * z_NE).topk(PRESET.topk, dim=1).indices
        assert torch.equal(ids_NK.sort(1).values, want_NK.sort(1).values)
        clean_NK = logits_NE.topk(PRESET.topk, dim=1).indices
        assert not torch.equal(ids_NK.sort(1).values, clean_NK.sort(1).values)  # can fail


def test_noise_is_ignored_under_replay(single_process):
    policy = build()
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    _, cache = current_routing(policy, tokens_BT, valid_BT)
    with torch.no_grad(), replay_routing(policy, cache):
        replayed = policy.logits(tokens_BT, valid_BT)
    with torch.no_grad(), router_noise(policy, 1.0, torch.Generator().manual_seed(0)), \
            replay_routing(policy, cache):
        noisy_replayed = policy.logits(tokens_BT, valid_BT)
    torch.testing.assert_close(noisy_replayed, replayed, rtol=0, atol=0)


def grads(recompute, step):
    """Grads after `step(policy)` (its forwards and its backward) on a fresh policy."""
    policy = build(recompute)
    policy.zero_grad()
    step(policy)
    reduce_grads(policy)
    assert_routing_idle(policy)
    return reduced_grads(policy)


def assert_full_recompute_keeps_the_grads(step):
    ref, got = grads(Recompute(), step), grads(Recompute("full"), step)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_recompute_replays_the_noisy_selection(single_process):
    tokens_BT, valid_BT, readout_BTV = batch(PRESET.vocab_size)

    def step(policy):
        with router_noise(policy, 0.5, torch.Generator().manual_seed(11)):
            loss = loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)
        policy.backward(loss)

    assert_full_recompute_keeps_the_grads(step)


def test_bad_std_is_an_error(single_process):
    """A negative std, or noise without a generator, fails on entry (not at the first router
    call); std 0 is a no-op that needs no generator and patches no router."""
    policy = build()
    with pytest.raises(ValueError, match="std=-1"):
        with router_noise(policy, -1.0, torch.Generator()):
            pass
    with pytest.raises(ValueError, match="needs a generator"):
        with router_noise(policy, 0.5, None):
            pass
    with router_noise(policy, 0.0, None):
        assert not any("get_replay_topk" in vars(r) for r in policy.router_replays)


def test_a_no_grad_noisy_forward_queues_nothing_for_the_backward(single_process):
    """A noisy forward without grad has no backward to replay into: its selection must not be
    queued, or the next backward's recompute would route as that forward did."""
    tokens_BT, valid_BT, readout_BTV = batch(PRESET.vocab_size)

    def step(policy):
        with torch.no_grad(), router_noise(policy, 1.0, torch.Generator().manual_seed(2)):
            policy.logits(tokens_BT, valid_BT)
        assert policy.backward_replays == []
        policy.backward(loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV))

    assert_full_recompute_keeps_the_grads(step)


def test_noise_leaves_a_replayed_backward_alone(single_process):
    """A backward run inside `router_noise` (here after a replayed forward): the recomputed
    routers replay the cached routing (REPLAY_BACKWARD) and draw no noise."""
    tokens_BT, valid_BT, readout_BTV = batch(PRESET.vocab_size)

    def step(policy):
        _, cache = current_routing(policy, tokens_BT, valid_BT)
        cache.ids_NLK = ((cache.ids_NLK.long() + 1) % PRESET.num_experts).to(torch.uint8)
        with router_noise(policy, 1.0, torch.Generator().manual_seed(4)):
            with replay_routing(policy, cache):
                loss = loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV)
            policy.backward(loss)

    assert_full_recompute_keeps_the_grads(step)


def test_recompute_replays_each_of_several_noisy_forwards(single_process):
    """Two noisy forwards (two draws) inside one `router_noise`, one backward: each recomputed
    forward routes as it did (autograd recomputes the later one first)."""
    first, second = batch(PRESET.vocab_size), batch(PRESET.vocab_size, seed=8)

    def step(policy):
        with router_noise(policy, 1.0, torch.Generator().manual_seed(5)):
            loss = sum(loss_fn(policy.logits(t, v), v, r) for t, v, r in (first, second))
        assert len(policy.backward_replays) == (2 if policy.recompute.routing else 0)
        policy.backward(loss)

    assert_full_recompute_keeps_the_grads(step)


def test_fixed_noise_is_a_function_of_the_router_input(single_process):
    """fixed=True: two forwards of the same batch route the same way (fresh draws from one
    generator do not), the routing differs from the clean one, and another generator seed
    gives another function."""
    policy = build()
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)

    def routed(seed, fixed=True, std=2.0):
        with torch.no_grad(), router_noise(policy, std, torch.Generator().manual_seed(seed),
                                           fixed=fixed), record_routing(policy) as rec:
            policy.logits(tokens_BT, valid_BT)
        return [r.sort(-1).values for r in rec]

    clean = routed(0, std=0.0)
    first, second = routed(5), routed(5)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert mean_flip(clean, first, valid_BT) > 0.1
    assert mean_flip(first, routed(6), valid_BT) > 0.05  # another seed, another function
    # fresh draws from one generator differ between calls
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad(), router_noise(policy, 2.0, gen) as _, record_routing(policy) as a:
        policy.logits(tokens_BT, valid_BT)
    with torch.no_grad(), router_noise(policy, 2.0, gen) as _, record_routing(policy) as b:
        policy.logits(tokens_BT, valid_BT)
    assert mean_flip([x.sort(-1).values for x in a], [x.sort(-1).values for x in b],
                     valid_BT) > 0.05


def test_fixed_draws_depend_only_on_the_scores_row():
    """The same scores row gets the same z wherever it sits in the batch; z has unit variance."""
    from moe.routing.noise import fixed_draws

    draw = fixed_draws(torch.Generator().manual_seed(0), 16)
    rows_NE = torch.randn(2000, 16, generator=torch.Generator().manual_seed(1))
    z_NE = draw(rows_NE)
    torch.testing.assert_close(draw(rows_NE.flip(0)), z_NE.flip(0))
    torch.testing.assert_close(draw(3 * rows_NE + 1), z_NE)  # centred and scaled first
    assert 0.8 < float(z_NE.var()) < 1.2
