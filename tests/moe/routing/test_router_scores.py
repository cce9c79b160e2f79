"""Router scores past the top-k (moe.routing.scores): the K + 1 best experts' router
probabilities equal a float64 softmax of the router logits recomputed from the router's input,
the wrapper changes nothing the forward computes and leaves no trace, and a swapped cache moves
exactly the K-th choice of the chosen tokens at one layer."""

import dataclasses

import pytest
import torch

from moe.model.policy import MoEPolicy
from moe.model.presets import get_preset
from moe.routing.scores import RouterScores, record_router_scores
from moe.model.settings import ParallelLayout
from tests.moe.parallel_worker import batch

PRESET = get_preset("tiny")


def build(norm_topk_prob=True, seed=3):
    preset = dataclasses.replace(PRESET, norm_topk_prob=norm_topk_prob)
    return MoEPolicy.build(preset, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=seed,
                           optim=None)


def routers(policy):
    """The policy's router modules, in layer order."""
    return [m for m in policy.model.module.modules() if hasattr(m, "router_replay")]


def reference_probs(policy, tokens_BT, valid_BT):
    """Per layer float64 [T*B, E] softmax of the router logits, recomputed from each router's
    input and weight (megatron's rows: sequence-first)."""
    inputs = []
    hooks = [r.register_forward_pre_hook(lambda m, args: inputs.append((m, args[0])))
             for r in routers(policy)]
    with torch.no_grad():
        policy.logits(tokens_BT, valid_BT)
    for h in hooks:
        h.remove()
    out = []
    for module, x in inputs:
        x_RH = x.reshape(-1, x.shape[-1]).double()
        out.append(torch.softmax(x_RH @ module.weight.double().T, dim=-1))
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalising", "pre_softmax"])
def test_scores_are_the_float64_router_softmax(single_process, norm_topk_prob):
    policy = build(norm_topk_prob)
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    K = PRESET.topk
    ref_L = reference_probs(policy, tokens_BT, valid_BT)
    with torch.no_grad(), record_router_scores(policy) as recorded:
        policy.logits(tokens_BT, valid_BT)
    scores = RouterScores.from_recorded(recorded, policy.routed_valid(valid_BT),
                                        PRESET.num_experts)
    # megatron's row of each valid token (sequence-first), in packed (sequence, position) order
    order = torch.arange(valid_BT.numel()).reshape(valid_BT.shape[1], -1).T[valid_BT]
    assert scores.probs_NLJ.shape == (int(valid_BT.sum()), PRESET.num_layers, K + 1)
    for layer, p_RE in enumerate(ref_L):
        p_NE = p_RE[order]
        top_NJ, ids_NJ = torch.sort(p_NE, dim=1, descending=True)
        assert torch.equal(scores.ids_NLJ[:, layer].long(), ids_NJ[:, :K + 1])
        torch.testing.assert_close(scores.probs_NLJ[:, layer].double(), top_NJ[:, :K + 1],
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(scores.margins_NL()[:, layer].double(),
                                   top_NJ[:, K - 1] - top_NJ[:, K], rtol=0, atol=1e-6)
    torch.testing.assert_close(scores.routing().ids_NLK.long(), scores.ids_NLJ[:, :, :K].long())


def test_recording_changes_nothing_and_leaves_no_trace(single_process):
    policy = build()
    tokens_BT, valid_BT, _ = batch(PRESET.vocab_size)
    with torch.no_grad():
        plain = policy.logits(tokens_BT, valid_BT)
        with record_router_scores(policy):
            scored = policy.logits(tokens_BT, valid_BT)
    assert torch.equal(plain, scored)
    assert all("get_replay_topk" not in r.__dict__ for r in policy.router_replays)
    with pytest.raises(RuntimeError, match="scored nothing"):
        with record_router_scores(policy):
            pass
    assert all("get_replay_topk" not in r.__dict__ for r in policy.router_replays)


def test_swapped_moves_the_kth_choice_of_the_chosen_tokens_at_one_layer():
    """3 tokens, 2 layers, top-2 of 4 (+ the 3rd best): at layer 1, tokens 0 and 2 take their
    3rd best in place of their 2nd; everything else stays the top-2 in order."""
    ids_NLJ = torch.tensor([[[0, 1, 2], [3, 2, 1]],
                            [[1, 2, 3], [0, 3, 2]],
                            [[2, 3, 0], [1, 0, 3]]], dtype=torch.uint8)
    probs_NLJ = torch.tensor([0.5, 0.3, 0.1]).expand(3, 2, 3).clone()
    scores = RouterScores(probs_NLJ, ids_NLJ, torch.ones(1, 3, dtype=torch.bool), 4)
    swapped = scores.swapped(1, torch.tensor([True, False, True]))
    assert swapped.ids_NLK.tolist() == [[[0, 1], [3, 1]], [[1, 2], [0, 3]], [[2, 3], [1, 3]]]
    assert scores.routing().ids_NLK.tolist() == [[[0, 1], [3, 2]], [[1, 2], [0, 3]],
                                                  [[2, 3], [1, 0]]]
    swapped.validate()
    torch.testing.assert_close(scores.margins_NL(), torch.full((3, 2), 0.2))
    with pytest.raises(ValueError, match="rows_N must be bool"):
        scores.swapped(0, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="layer=2"):
        scores.swapped(2, torch.ones(3, dtype=torch.bool))
    assert scores.select(torch.tensor([0])).ids_NLJ.shape == (3, 2, 3)
