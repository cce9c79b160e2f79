"""Routing sensitivity (megatron_gspo.algo.margins, .sensitivity): the margin statistics equal
numpy's float64 median and fraction, and the route sensitivity equals a float64 mean of |log-prob
change| under an independent swap (a router patched to take its (K+1)-th expert), not through
the replay cache."""

from functools import partial

import numpy as np
import pytest
import torch

from megatron_gspo.algo.flips import loss_positions
from megatron_gspo.algo.margins import margin_metrics
from megatron_gspo.algo.sensitivity import route_sensitivity, sensitivity_metrics
from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.routing.scores import RouterScores
from moe.model.settings import ParallelLayout
from tests.moe.parallel_worker import batch

PRESET = get_preset("tiny")


def test_margin_metrics_are_numpys_median_and_fraction_over_the_rows():
    g = torch.Generator().manual_seed(0)
    N, L, K = 9, 3, 2
    probs_NLJ = torch.rand(N, L, K + 1, generator=g).sort(dim=2, descending=True).values / 3
    ids_NLJ = torch.arange(K + 1).expand(N, L, K + 1).to(torch.uint8)
    scores = RouterScores(probs_NLJ, ids_NLJ, torch.ones(1, N, dtype=torch.bool), 4)
    rows_N = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)  # 6 rows: even count
    out = margin_metrics(scores, rows_N, small=0.05)
    m_NL = (probs_NLJ[:, :, K - 1] - probs_NLJ[:, :, K]).double().numpy()[rows_N.numpy()]
    for layer in range(L):
        assert out[f"moe/router_margin/layer_{layer:02d}"] == pytest.approx(
            float(np.median(m_NL[:, layer])), abs=1e-12)
        assert out[f"moe/router_margin_small/layer_{layer:02d}"] == pytest.approx(
            float((m_NL[:, layer] < 0.05).mean()), abs=1e-12)
    assert out["moe/router_margin/mean"] == pytest.approx(float(np.median(m_NL, 0).mean()))
    none = margin_metrics(scores, torch.zeros(N, dtype=torch.bool), small=0.05)
    assert np.isnan(none["moe/router_margin/layer_00"])


def build(seed=3):
    return MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=seed,
                           optim=None)


def rollout(B=4, T=12, prompt=6):
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size, B=B, T=T)
    response_BT = torch.zeros(B, T, dtype=torch.bool)
    response_BT[:, prompt:] = True
    return tokens_BT, valid_BT, response_BT


def _take_next_best(router, swap_R, scores, topk, num_groups=None, group_topk=None,
                    default_compute_topk=None):
    """A plain top-k, except that rows `swap_R` take their (K+1)-th expert for their K-th."""
    _, ids_RJ = torch.topk(scores, topk + 1, dim=1)
    ids_RK = ids_RJ[:, :topk].clone()
    ids_RK[swap_R, topk - 1] = ids_RJ[swap_R, topk]
    return scores.gather(1, ids_RK), ids_RK


def reference(policy, tokens_BT, valid_BT, response_BT, layer, swap_BT=None):
    """float64 mean over response tokens of |log p(swapped) - log p| with every loss position
    of `layer` (or the positions `swap_BT`) on its (K+1)-th expert, the swap made inside the
    router (no replay)."""
    if swap_BT is None:
        swap_BT = loss_positions(response_BT) & valid_BT
    with torch.no_grad():
        base = policy.token_logprobs(tokens_BT, valid_BT, start=1).double()
        router = policy.router_replays[layer]
        swap_R = swap_BT.T.reshape(-1)  # sequence-first rows
        router.get_replay_topk = partial(_take_next_best, router, swap_R)
        try:
            swapped = policy.token_logprobs(tokens_BT, valid_BT, start=1).double()
        finally:
            del router.get_replay_topk
    return float((swapped - base).abs()[response_BT].mean())


def test_route_sensitivity_equals_a_float64_reference_swap(single_process):
    policy = build()
    tokens_BT, valid_BT, response_BT = rollout()
    got = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 1.0,
                            torch.Generator().manual_seed(0))
    want = [reference(policy, tokens_BT, valid_BT, response_BT, l)
            for l in range(PRESET.num_layers)]
    assert min(want) > 1e-5  # the swap moves the log-probs
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    zero = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.0,
                             torch.Generator().manual_seed(0))
    assert zero == [0.0] * PRESET.num_layers  # replaying the router's own top-k changes nothing
    some = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.3,
                             torch.Generator().manual_seed(0))
    assert 0 < sum(some) < sum(got)
    assert some == route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.3,
                                     torch.Generator().manual_seed(0))  # seeded
    metrics = sensitivity_metrics(got)
    assert metrics["moe/route_sensitivity/layer_01"] == got[1]
    assert metrics["moe/route_sensitivity/mean"] == pytest.approx(sum(got) / len(got))
    with pytest.raises(ValueError, match="fraction=1.5"):
        route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 1.5, torch.Generator())


def test_packed_sensitivity_and_margins_are_the_padded_ones(single_process):
    """Route sensitivity (L + 1 forwards, the swaps replayed in packed order) and the router
    margins of a packed forward equal the padded forward's, right padding included."""
    from megatron_gspo.algo.sensitivity import margin_rows
    from moe.routing.scores import record_router_scores

    policy = build()
    tokens_BT, valid_BT, response_BT = rollout(B=5, T=14)
    valid_BT[1, -3:] = valid_BT[3, -1:] = False  # shorter responses
    response_BT &= valid_BT
    out = {}
    for pack in (False, True):
        policy.pack = pack
        sens = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.5,
                                 torch.Generator().manual_seed(0))
        with torch.no_grad(), record_router_scores(policy) as recorded:
            policy.token_logprobs(tokens_BT, valid_BT)
        scores = RouterScores.from_recorded(recorded, policy.routed_valid(valid_BT),
                                            PRESET.num_experts, policy.router_rows)
        out[pack] = sens, margin_metrics(scores, margin_rows(policy, scores, response_BT), 0.05)
    assert min(out[False][0]) > 1e-4
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-4, atol=1e-7)
    for key, value in out[False][1].items():
        assert out[True][1][key] == pytest.approx(value, abs=1e-6), key


def test_lowest_margin_swaps_the_near_ties_of_each_layer(single_process):
    """`lowest_margin=True`: at each layer the quarter of loss positions with the smallest
    margin p_(K) - p_(K+1) there take their (K+1)-th expert; equal to a float64 reference swap of
    those positions inside the router, whatever the generator."""
    from moe.routing.scores import record_router_scores

    policy = build()
    tokens_BT, valid_BT, response_BT = rollout()
    got = route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.25,
                            torch.Generator().manual_seed(0), lowest_margin=True)
    assert got == route_sensitivity(policy, tokens_BT, valid_BT, response_BT, 0.25,
                                    torch.Generator().manual_seed(9), lowest_margin=True)
    with torch.no_grad(), record_router_scores(policy) as recorded:
        policy.token_logprobs(tokens_BT, valid_BT)
    scores = RouterScores.from_recorded(recorded, valid_BT, PRESET.num_experts)
    loss_BT = loss_positions(response_BT) & valid_BT
    rows_N = loss_BT[valid_BT]
    for layer in range(PRESET.num_layers):
        margins_N = scores.margins_NL()[:, layer]
        n = round(0.25 * int(rows_N.sum()))
        cut = margins_N[rows_N].sort().values[n - 1]
        mask_BT = torch.zeros_like(valid_BT)
        mask_BT[valid_BT] = rows_N & (margins_N <= cut)
        assert int(mask_BT.sum()) == n  # no tie at the cut in this batch
        want = reference(policy, tokens_BT, valid_BT, response_BT, layer, swap_BT=mask_BT)
        assert got[layer] == pytest.approx(want, rel=1e-4, abs=1e-7)
