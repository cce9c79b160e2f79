"""calibrate.measure on a tiny policy: std 0 measures nothing, noise flips experts and moves
log-probs, reproducibly (fixed draw seeds), and only response tokens count."""

import types

import pytest
import torch

from experiments.replay_dose_response import calibrate
from moe.model.gpt import ParallelLayout
from moe.model.presets import get_preset
from tests.moe.parallel_worker import batch

PRESET = get_preset("tiny")


def test_measure_zero_noise_and_large_noise(single_process):
    """std 0: no flips, no log-ratio; std 1: many flips, nonzero log-ratio, same on a rerun."""
    from moe.model.policy import MoEPolicy

    policy = MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=3,
                             optim=None)
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    resp_BT = valid_BT.clone()
    resp_BT[:, : tokens_BT.shape[1] // 2] = False  # second half of each row is the response
    b = types.SimpleNamespace(tokens_BT=tokens_BT, valid_BT=valid_BT, response_BT=resp_BT)
    assert calibrate.measure(policy, b, 0.0, 1.0) == {"std": 0.0, "flip_rate": 0.0,
                                                      "abs_log_ratio": 0.0}
    noisy = calibrate.measure(policy, b, 1.0, 1.0)
    assert 0.3 < noisy["flip_rate"] <= 1.0 and noisy["abs_log_ratio"] > 0
    assert calibrate.measure(policy, b, 1.0, 1.0) == noisy


def test_measure_log_ratio_is_the_draw_mean_over_response_tokens(single_process, monkeypatch):
    """abs_log_ratio = mean over draws (seeds 1000, 1001) of |log pi_noisy - log pi_clean|
    averaged over response tokens only."""
    from moe.model.policy import MoEPolicy
    from moe.routing.noise import router_noise

    policy = MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=3,
                             optim=None)
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    resp_BT = valid_BT.clone()
    resp_BT[:, : tokens_BT.shape[1] // 2] = False
    b = types.SimpleNamespace(tokens_BT=tokens_BT, valid_BT=valid_BT, response_BT=resp_BT)
    monkeypatch.setattr(calibrate, "DRAWS", 2)
    with torch.no_grad():
        clean_BT = policy.token_logprobs(tokens_BT, valid_BT, 1.0)
        want = []
        for seed in (1000, 1001):
            with router_noise(policy, 0.5, torch.Generator().manual_seed(seed)):
                noisy_BT = policy.token_logprobs(tokens_BT, valid_BT, 1.0)
            want.append(float((noisy_BT - clean_BT).abs()[resp_BT].mean()))
    assert want[0] != want[1]
    got = calibrate.measure(policy, b, 0.5, 1.0)
    assert got["abs_log_ratio"] == pytest.approx(sum(want) / 2, rel=1e-5)


def test_measure_flip_rate_is_the_draw_and_layer_mean_on_loss_positions(single_process,
                                                                        monkeypatch):
    """flip_rate = mean over draws of the layer-mean flip rate on the positions whose logits
    score a response token (t - 1 for response token t), not the response tokens themselves."""
    from megatron_gspo.algo.flips import flip_counts, token_rows
    from moe.model.policy import MoEPolicy
    from moe.routing.replay import RoutingReplayCache, current_routing, record_routing
    from moe.routing.noise import router_noise

    policy = MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=3,
                             optim=None)
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    half = tokens_BT.shape[1] // 2
    resp_BT = valid_BT.clone()
    resp_BT[:, :half] = False
    scoring_BT = torch.zeros_like(resp_BT)
    scoring_BT[:, half - 1:-1] = resp_BT[:, half:]  # one to the left of each response token
    b = types.SimpleNamespace(tokens_BT=tokens_BT, valid_BT=valid_BT, response_BT=resp_BT)
    monkeypatch.setattr(calibrate, "DRAWS", 2)
    _, clean = current_routing(policy, tokens_BT, valid_BT, 1.0)
    rows_N = token_rows(policy, clean, scoring_BT)
    want = []
    for seed in (1000, 1001):
        with torch.no_grad(), router_noise(policy, 0.3, torch.Generator().manual_seed(seed)), \
                record_routing(policy) as rec:
            policy.token_logprobs(tokens_BT, valid_BT, 1.0)
        noisy = RoutingReplayCache.from_recorded(rec, policy.routed_valid(valid_BT),
                                                 PRESET.num_experts)
        per_layer = flip_counts(clean, noisy, rows_N)["flip_rate"]
        want.append(sum(per_layer) / len(per_layer))
    assert want[0] != want[1]
    assert calibrate.measure(policy, b, 0.3, 1.0)["flip_rate"] == pytest.approx(sum(want) / 2)
