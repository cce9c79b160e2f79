"""Routing Replay under packed forwards (moe.routing.tokens): a cache recorded in any packing
replays in any other, token for token; a route shifted by one token or landing on the
neighbouring sequence is caught (the misalignments verl PRs #7106 and #7805 shipped)."""

import pytest
import torch

from moe.routing.replay import (RoutingReplayCache, current_routing, record_routing,
                                replay_routing)
from moe.routing.tokens import RouterRows, filler
from tests.moe.grads import dense_cache
from tests.moe.model.test_experts import build

START = 4


def batch(vocab: int, seed: int = 0):
    """5 ragged rows; rows 1 and 2 have the same length (a neighbour swap keeps the shapes)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 24
    tokens_BT = torch.randint(0, vocab, (B, T), generator=g)
    valid_BT = torch.zeros(B, T, dtype=torch.bool)
    for b, (left, n) in enumerate(((0, 24), (3, 15), (1, 15), (5, 10), (2, 20))):
        valid_BT[b, left:left + n] = True
    return tokens_BT, valid_BT


def forced_cache(policy, valid_BT, seed=11) -> RoutingReplayCache:
    """A distinct random top-k for every (token, layer): any misplaced route changes logits."""
    p = policy.preset
    B, T = valid_BT.shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(p.num_experts, generator=g)[:p.topk]
                       for _ in range(B * T * p.num_layers)]).reshape(B, T, p.num_layers, p.topk)
    return dense_cache(ids, valid_BT, p.num_experts)


def replayed_logprobs(policy, tokens_BT, valid_BT, cache, chunks):
    """Log-probs under `cache`, one forward per chunk of rows (each replaying its rows)."""
    out = torch.zeros(tokens_BT.shape)
    with torch.no_grad():
        for rows in chunks:
            with replay_routing(policy, cache.select(rows)):
                out[rows] = policy.token_logprobs(tokens_BT[rows], valid_BT[rows], start=START)
    return out


PACKINGS = {"one pack": [torch.arange(5)], "bins": [torch.tensor([4, 0]), torch.tensor([2, 1, 3])],
            "one row each": [torch.tensor([b]) for b in (3, 1, 4, 0, 2)]}


@pytest.fixture(scope="module")
def forced(single_process):
    policy = build("qwen3-moe-tiny")
    tokens_BT, valid_BT = batch(policy.preset.vocab_size)
    cache = forced_cache(policy, valid_BT)
    want = replayed_logprobs(policy, tokens_BT, valid_BT, cache, [torch.arange(5)])  # padded
    scored_BT = valid_BT.clone()
    scored_BT[:, :START] = False
    scored_BT[:, 1:] &= valid_BT[:, :-1]
    policy.pack = True
    return policy, tokens_BT, valid_BT, cache, want, scored_BT


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_packed_replay_applies_each_route_to_its_own_token(forced, packing):
    """The forced routing replayed in packed forwards of any packing gives the padded
    forward's replayed log-probs (whose sequence-first layout is tested on its own)."""
    policy, tokens_BT, valid_BT, cache, want, scored_BT = forced
    got = replayed_logprobs(policy, tokens_BT, valid_BT, cache, PACKINGS[packing])
    torch.testing.assert_close(got[scored_BT], want[scored_BT], atol=1e-5, rtol=1e-5)


def test_a_route_shifted_by_one_token_or_on_the_neighbouring_sequence_is_caught(forced):
    """The comparison above has the power to see both misalignments: the same forced routing
    shifted by one token within the pack, or rows 1 and 2 (same length) trading routes, moves
    the log-probs of the tokens it misplaces far beyond the tolerance."""
    policy, tokens_BT, valid_BT, cache, want, scored_BT = forced
    shifted = RoutingReplayCache(cache.ids_NLK.roll(1, dims=0), cache.valid_BT, cache.num_experts)
    swapped = cache.select(torch.tensor([0, 2, 1, 3, 4]))
    swapped = RoutingReplayCache(swapped.ids_NLK, cache.valid_BT, cache.num_experts)
    for wrong in (shifted, swapped):
        got = replayed_logprobs(policy, tokens_BT, valid_BT, wrong, [torch.arange(5)])
        assert (got - want)[scored_BT].abs().max() > 1e-2
    got = replayed_logprobs(policy, tokens_BT, valid_BT, swapped, [torch.arange(5)])
    kept = scored_BT.clone()
    kept[1:3] = False
    torch.testing.assert_close(got[kept], want[kept], atol=1e-5, rtol=1e-5)  # rows 1, 2 moved


def test_packed_recording_is_the_padded_routing_and_replays_in_another_packing(forced):
    """pi_old's cache recorded over one packing (bins) holds the padded forward's routes for
    every token; replayed in another packing, megatron uses exactly those routes."""
    policy, tokens_BT, valid_BT, _, _, scored_BT = forced
    policy.pack = False
    want_logp, want = current_routing(policy, tokens_BT, valid_BT, start=START)
    policy.pack = True
    logp, cache = current_routing(policy, tokens_BT, valid_BT, start=START,
                                  chunks=PACKINGS["bins"])
    assert torch.equal(cache.valid_BT, valid_BT)
    assert torch.equal(cache.ids_NLK.sort(-1).values, want.ids_NLK.sort(-1).values)
    torch.testing.assert_close(logp[scored_BT], want_logp[scored_BT], atol=1e-6, rtol=0)
    check = {}
    with torch.no_grad():
        for rows in PACKINGS["one row each"]:
            with replay_routing(policy, cache.select(rows), check):
                policy.token_logprobs(tokens_BT[rows], valid_BT[rows], start=START)
    assert int(check["differ"]) == 0
    assert int(check["routes"]) == int(valid_BT.sum()) * policy.preset.num_layers


def test_router_rows_by_hand():
    """Padded: sequence-first with filler; packed: the cache's order, filler on the alignment
    tail, each sequence-parallel rank its slice."""
    valid_BT = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ids_NK = torch.tensor([[10, 11], [12, 13], [14, 15], [16, 17]])
    padded = RouterRows().to_router(ids_NK, valid_BT, 20)
    assert padded.tolist() == [[0, 1], [14, 15], [10, 11], [16, 17], [12, 13], [10, 11]]
    assert filler(torch.tensor([0, 5]), 2, 20).tolist() == [[0, 1], [10, 11]]
    packed = [RouterRows(packed=True, shards=3, shard=r).to_router(ids_NK, valid_BT, 20)
              for r in range(3)]
    assert torch.cat(packed).tolist() == [*ids_NK.tolist(), [8, 9], [10, 11]]
    assert RouterRows(packed=True).to_tokens(ids_NK, valid_BT).tolist() == ids_NK.tolist()
    x_RJ = torch.arange(6)[:, None]  # sequence-first (t, b): b0t0 b1t0 b0t1 b1t1 b0t2 b1t2
    assert RouterRows().to_tokens(x_RJ, valid_BT).flatten().tolist() == [2, 4, 1, 3]
    with pytest.raises(ValueError, match="recorded 5 tokens of a pack of 4"):
        RouterRows(packed=True, shards=2).to_tokens(torch.zeros(5, 2), valid_BT)
    assert RouterRows(packed=True, shards=2).routed_valid(valid_BT).tolist() == \
        valid_BT.tolist()
    assert RouterRows(shards=2, shard=1).routed_valid(valid_BT).tolist() == [[1, 0], [0, 0]]


def test_recording_a_packed_forward_needs_the_packed_order(forced):
    """A packed recording read in the padded order is refused by its size, not misread."""
    policy, tokens_BT, valid_BT, *_ = forced
    with torch.no_grad(), record_routing(policy) as recorded:
        policy.token_logprobs(tokens_BT, valid_BT, start=START)
    with pytest.raises(ValueError, match="expected T\\*B"):
        RoutingReplayCache.from_recorded(recorded, valid_BT, policy.preset.num_experts)
