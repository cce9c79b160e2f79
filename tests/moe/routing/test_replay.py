"""Routing Replay cache: record/replay round trip, forced routing, layout, padding, validation."""

import pytest
import torch

from tests.moe.grads import dense_cache
from moe.model.presets import get_preset
from moe.model.settings import ParallelLayout
from moe.routing.replay import (RoutingReplayCache, assert_routing_idle, ids_dtype, record_routing,
                                replay_routing)

PRESET = get_preset("tiny")


@pytest.fixture()
def policy(single_process):
    from moe.model.policy import MoEPolicy, OptimSettings

    return MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=1,
                           optim=OptimSettings(lr=1e-2))


def make_batch(B=3, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, PRESET.vocab_size, (B, T), generator=g)
    valid_BT = torch.ones(B, T, dtype=torch.bool)
    valid_BT[0, :3] = False  # left padding
    valid_BT[2, -2:] = False  # right padding
    return tokens_BT, valid_BT


def routed_maps(policy):
    """Hook every router: returns a list that fills with each forward's [T*B, E] routing maps."""
    seen = []
    for layer in policy.model.module.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda m, i, out: seen.append(out[1].detach()))
    return seen


def record(policy, tokens_BT, valid_BT):
    with torch.no_grad(), record_routing(policy) as recorded:
        logits = policy.logits(tokens_BT, valid_BT)
    cache = RoutingReplayCache.from_recorded(recorded, policy.routed_valid(valid_BT),
                                             PRESET.num_experts)
    return cache, logits


def test_replay_reproduces_recorded_routing_and_logits(policy):
    tokens_BT, valid_BT = make_batch()
    cache, logits = record(policy, tokens_BT, valid_BT)
    maps = routed_maps(policy)
    with torch.no_grad(), replay_routing(policy, cache):
        replayed = policy.logits(tokens_BT, valid_BT)
    # padding positions get filler routes; real tokens are unchanged up to matmul blocking noise
    torch.testing.assert_close(replayed[valid_BT], logits[valid_BT], atol=1e-6, rtol=1e-6)
    assert (replayed[~valid_BT] - logits[~valid_BT]).abs().max() > 1e-4  # the check can fail
    # and the routing megatron used is the cached one at every valid token
    for layer, map_NE in enumerate(maps):
        B, T = valid_BT.shape
        map_BTE = map_NE.reshape(T, B, -1).transpose(0, 1)[valid_BT]
        want = torch.zeros_like(map_BTE).scatter_(1, cache.layer_ids(layer).long(), True)
        assert torch.equal(map_BTE, want), f"layer {layer}"
    assert_routing_idle(policy)


def test_forced_distinct_routes_follow_token_layout(policy):
    """B>1, S>1, a different route for every token: megatron must see (b, t) at row t*B+b."""
    tokens_BT, valid_BT = make_batch(B=3, T=6)
    B, T, L, K, E = 3, 6, PRESET.num_layers, PRESET.topk, PRESET.num_experts
    g = torch.Generator().manual_seed(5)
    ids_BTLK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)])
    ids_BTLK = ids_BTLK.reshape(B, T, L, K)
    cache = dense_cache(ids_BTLK, valid_BT, E)
    maps = routed_maps(policy)
    with torch.no_grad(), replay_routing(policy, cache):
        policy.logits(tokens_BT, valid_BT)
    for layer, map_NE in enumerate(maps):
        for b in range(B):
            for t in range(T):
                if valid_BT[b, t]:
                    chosen = set(torch.nonzero(map_NE[t * B + b]).flatten().tolist())
                    assert chosen == set(ids_BTLK[b, t, layer].tolist()), (layer, b, t)


def test_replay_gradients_reach_router_for_unchosen_experts(policy):
    """Gate probs are gathered from the dense logits, so a replayed expert that live routing
    would not pick still gets router gradient (docs/pitfalls.md#replay-gradients)."""
    tokens_BT, valid_BT = make_batch()
    live, _ = record(policy, tokens_BT, valid_BT)
    # replay the complement of the live choice: experts live routing did NOT pick
    E, K = PRESET.num_experts, PRESET.topk
    forced = []
    for layer in range(live.num_layers):
        ids_NK = live.layer_ids(layer).long()
        mask_NE = torch.ones(ids_NK.shape[0], E, dtype=torch.bool).scatter_(1, ids_NK, False)
        forced.append(torch.nonzero(mask_NE)[:, 1].reshape(ids_NK.shape[0], -1)[:, :K])
    cache = RoutingReplayCache(torch.stack(forced, 1).to(torch.uint8), live.valid_BT, E)
    policy.zero_grad()
    with replay_routing(policy, cache):
        logits = policy.logits(tokens_BT, valid_BT)
    (logits * valid_BT[..., None]).square().mean().backward()
    for layer in policy.model.module.decoder.layers:
        grad = layer.mlp.router.weight.main_grad
        assert grad.abs().sum(dim=1).gt(0).sum() >= K, "router got no gradient for forced experts"


def test_select_then_replay_matches_subbatch(policy):
    tokens_BT, valid_BT = make_batch(B=4)
    cache, logits = record(policy, tokens_BT, valid_BT)
    rows = torch.tensor([3, 1])
    sub = cache.select(rows)
    assert sub.ids_NLK.shape[0] == int(valid_BT[rows].sum())
    with torch.no_grad(), replay_routing(policy, sub):
        sub_logits = policy.logits(tokens_BT[rows], valid_BT[rows])
    v = valid_BT[rows]
    torch.testing.assert_close(sub_logits[v], logits[rows][v], atol=1e-6, rtol=1e-6)


def test_cache_bytes_dtype_and_padding_excluded(policy):
    tokens_BT, valid_BT = make_batch()
    cache, _ = record(policy, tokens_BT, valid_BT)
    n_valid = int(valid_BT.sum())
    assert cache.ids_NLK.dtype == torch.uint8
    assert cache.nbytes == n_valid * PRESET.num_layers * PRESET.topk * 1
    assert ids_dtype(256) == torch.uint8 and ids_dtype(257) == torch.int16
    assert ids_dtype(32768) == torch.int16  # ids 0..32767 fit
    with pytest.raises(ValueError, match="too large"):
        ids_dtype(32769)
    # padding rows get a balanced, duplicate-free filler, never all expert 0
    dense = cache.dense_layers()[0]
    B, T = valid_BT.shape
    pad_rows = dense.reshape(T, B, -1).transpose(0, 1)[~valid_BT]
    assert pad_rows.unique().numel() > 1
    assert all(len(set(r.tolist())) == PRESET.topk for r in pad_rows)


def test_filler_spreads_padding_over_all_experts():
    """An all-padding cache: every row is filler, so the filler alone sets the loads; megatron
    row n gets experts (n*K + j) mod E, i.e. every expert equally often (here 5 times), not
    experts 0..K-1 for every pad row."""
    B, T, L, K, E = 2, 5, 2, 2, 4
    cache = RoutingReplayCache(torch.zeros(0, L, K, dtype=torch.uint8),
                               torch.zeros(B, T, dtype=torch.bool), E)
    for ids_NK in cache.dense_layers():
        assert ids_NK.shape == (T * B, K)
        assert torch.bincount(ids_NK.flatten(), minlength=E).tolist() == [5] * E
        assert ids_NK.tolist() == [[(n * K + j) % E for j in range(K)] for n in range(T * B)]


def test_cache_shapes_are_checked():
    """ids must cover exactly the valid tokens; megatron's recording must hold T*B rows (a
    multiple of them would otherwise reshape silently into a wider K)."""
    valid_BT = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"N=6"):
        RoutingReplayCache(torch.zeros(5, 1, 2, dtype=torch.uint8), valid_BT, 4)
    with pytest.raises(ValueError, match=r"N=6"):  # [N, K]: the layer axis is missing
        RoutingReplayCache(torch.zeros(6, 2, dtype=torch.uint8), valid_BT, 4)
    two_rows = torch.tensor([[0, 1], [2, 3]]).repeat(6, 1)  # [2*T*B, K]
    with pytest.raises(ValueError, match="recorded 12 tokens"):
        RoutingReplayCache.from_recorded([two_rows], valid_BT, 4)
    with pytest.raises(RuntimeError, match="recorded nothing"):
        RoutingReplayCache.from_recorded([two_rows[:6], None], valid_BT, 4)


def test_replay_cache_must_cover_every_layer(policy):
    tokens_BT, valid_BT = make_batch()
    cache, _ = record(policy, tokens_BT, valid_BT)
    short = RoutingReplayCache(cache.ids_NLK[:, :-1].clone(), cache.valid_BT, cache.num_experts)
    with pytest.raises(ValueError, match="layers"):
        with replay_routing(policy, short):
            pass
    assert_routing_idle(policy)


def test_current_routing_log_probs_use_the_temperature(policy):
    """pi_old's pass (`current_routing`) scores at the sampling temperature."""
    from moe.routing.replay import current_routing

    tokens_BT, valid_BT = make_batch()
    logp, _ = current_routing(policy, tokens_BT, valid_BT, temperature=0.7, start=2)
    with torch.no_grad():
        want = policy.token_logprobs(tokens_BT, valid_BT, temperature=0.7, start=2)
    torch.testing.assert_close(logp, want, atol=1e-6, rtol=1e-6)
    assert (logp - current_routing(policy, tokens_BT, valid_BT, start=2)[0]).abs().max() > 1e-3


def test_invalid_replay_ids_raise_and_state_is_cleared(policy):
    tokens_BT, valid_BT = make_batch()
    cache, _ = record(policy, tokens_BT, valid_BT)
    bad = RoutingReplayCache(cache.ids_NLK.clone(), cache.valid_BT, cache.num_experts)
    bad.ids_NLK[0, 0, 1] = bad.ids_NLK[0, 0, 0]  # a duplicate expert (docs/pitfalls.md#replay-ids)
    with pytest.raises(ValueError, match="repeats an expert id"):
        with replay_routing(policy, bad):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with replay_routing(policy, cache):
            raise RuntimeError("boom")
    assert_routing_idle(policy)


def test_second_model_does_not_break_first_models_replay(policy):
    """megatron's RouterReplay list is global (docs/pitfalls.md#global-replay-list): each policy
    keeps its own routers."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from moe.model.policy import MoEPolicy

    tokens_BT, valid_BT = make_batch()
    cache, logits = record(policy, tokens_BT, valid_BT)
    other = MoEPolicy.build(PRESET, ParallelLayout(), real_vocab=PRESET.vocab_size, seed=9,
                            optim=None)
    assert len(RouterReplay.global_router_replay_instances) == PRESET.num_layers
    assert other.router_replays[0] is not policy.router_replays[0]
    with torch.no_grad(), replay_routing(policy, cache):
        replayed = policy.logits(tokens_BT, valid_BT)
    torch.testing.assert_close(replayed[valid_BT], logits[valid_BT], atol=1e-6, rtol=1e-6)


def test_token_budgeted_pass_equals_one_pass(policy):
    """`current_routing(n_chunks=3)` over 7 sequences (chunks of 3, 2, 2, padding in the first
    and last): the same log-probs and routing cache as one forward, from 3 forwards;
    `RoutingReplayCache.cat` undoes `select` over consecutive blocks."""
    from moe.routing.replay import chunk_count, current_routing, row_chunks

    tokens_BT, valid_BT = make_batch(B=7, T=10, seed=4)
    valid_BT[6, :2] = False
    logp_one, cache_one = current_routing(policy, tokens_BT, valid_BT, start=2)
    seen = routed_maps(policy)
    logp, cache = current_routing(policy, tokens_BT, valid_BT, start=2, n_chunks=3)
    assert len(seen) == 3 * PRESET.num_layers
    torch.testing.assert_close(logp, logp_one, atol=1e-6, rtol=1e-6)
    assert torch.equal(cache.valid_BT, cache_one.valid_BT)
    assert torch.equal(cache.ids_NLK, cache_one.ids_NLK)
    blocks = [cache_one.select(rows) for rows in row_chunks(7, 3)]
    assert [b.valid_BT.shape[0] for b in blocks] == [3, 2, 2]
    again = RoutingReplayCache.cat(blocks)
    assert torch.equal(again.ids_NLK, cache_one.ids_NLK)
    # token budget -> forwards: 35 tokens of 10-token rows = 3 rows each; at least one row each
    assert (chunk_count(7, 10, 35), chunk_count(7, 10, 0), chunk_count(2, 10, 4)) == (3, 1, 2)
    with pytest.raises(ValueError, match="n_chunks=8"):
        row_chunks(7, 8)


def test_select_keeps_each_rows_padding_in_the_given_order():
    """`select` with rows out of order, a slice, or none: each row brings its own valid mask and
    ids, as if the cache had been built from those rows alone."""
    B, T, L, K, E = 3, 4, 2, 2, 64
    ids_BTLK = torch.arange(B * T * L * K).reshape(B, T, L, K)  # every id distinct
    valid_BT = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    cache = dense_cache(ids_BTLK, valid_BT, E)
    for rows in (torch.tensor([2, 0]), torch.tensor([1, 2, 0]), slice(1, 3)):
        want = dense_cache(ids_BTLK[rows], valid_BT[rows], E)
        got = cache.select(rows)
        assert torch.equal(got.valid_BT, want.valid_BT), rows
        assert torch.equal(got.ids_NLK, want.ids_NLK), rows
    empty = cache.select(torch.tensor([], dtype=torch.long))
    assert empty.ids_NLK.shape == (0, L, K) and empty.valid_BT.shape == (0, T)


def test_validate_checks_every_layer():
    """A repeated or out-of-range expert id in the last layer is caught, not only in layer 0."""
    ids_NLK = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], dtype=torch.uint8)
    valid_BT = torch.ones(1, 2, dtype=torch.bool)
    RoutingReplayCache(ids_NLK, valid_BT, 4).validate()
    dup = ids_NLK.clone()
    dup[1, 1, 1] = 3
    with pytest.raises(ValueError, match="repeats an expert id"):
        RoutingReplayCache(dup, valid_BT, 4).validate()
    out = ids_NLK.clone()
    out[1, 1, 0] = 4
    with pytest.raises(ValueError, match="outside"):
        RoutingReplayCache(out, valid_BT, 4).validate()


def test_a_policy_without_replay_or_with_a_busy_router_is_refused():
    """No routers (built without moe_enable_routing_replay) or one still set to an action: the
    contexts raise instead of recording / replaying nothing or on top of another action."""
    from types import SimpleNamespace

    with pytest.raises(RuntimeError, match="moe_enable_routing_replay"):
        with record_routing(SimpleNamespace(router_replays=[])):
            pass
    busy = SimpleNamespace(router_replays=[SimpleNamespace(router_replay_action=None),
                                           SimpleNamespace(router_replay_action="record")])
    with pytest.raises(RuntimeError, match=r"layers \[1\] still have an action"):
        assert_routing_idle(busy)


def test_nested_routing_contexts_raise_and_exits_drop_the_targets(policy):
    """Recording inside a replay (or any context inside another) is refused; leaving a context
    drops megatron's targets, recordings and backward queue, not only the action."""
    from moe.routing.replay import replay_backward

    tokens_BT, valid_BT = make_batch()
    cache, _ = record(policy, tokens_BT, valid_BT)
    contexts = [lambda: record_routing(policy), lambda: replay_routing(policy, cache),
                lambda: replay_backward(policy, [cache.dense_layers()])]
    for i, outer in enumerate(contexts):
        for inner in contexts:
            with pytest.raises(RuntimeError, match="leaked"):
                with outer(), inner():
                    pass
            for r in policy.router_replays:
                assert r.router_replay_action is None, i
                assert r.target_topk_idx is None and r.recorded_topk_idx is None, i
                assert r.replay_backward_list == [], i


def test_chunking_edge_cases():
    """No rows still take one forward (ranks agree on a count >= 1) over one empty slice;
    n_chunks=0 is a ValueError, not a division by zero."""
    from moe.routing.replay import chunk_count, row_chunks

    assert chunk_count(0, 10, 35) == 1
    assert row_chunks(0, 1) == [slice(0, 0)]
    assert row_chunks(5, 5) == [slice(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError, match="n_chunks=0"):
        row_chunks(7, 0)


def test_the_replay_check_counts_routes_the_routers_did_not_replay(policy, monkeypatch):
    """`replay_routing(..., check)`: 0 routes differ when replay works; where a router ignores
    its replay target (megatron's replay broken here on purpose) the routes it chose itself
    are counted, so the trainer's `replay/route_diff` can fail."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tokens_BT, valid_BT = make_batch()
    cache, _ = record(policy, tokens_BT, valid_BT)
    g = torch.Generator().manual_seed(3)
    E, K = PRESET.num_experts, PRESET.topk
    other = dense_cache(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(
        tokens_BT.numel() * PRESET.num_layers)]).reshape(*tokens_BT.shape, PRESET.num_layers, K),
        valid_BT, E)
    check: dict = {}
    with torch.no_grad(), replay_routing(policy, other, check):
        policy.logits(tokens_BT, valid_BT)
    routes = tokens_BT.numel() * PRESET.num_layers
    assert int(check["differ"]) == 0 and int(check["routes"]) == routes
    real = RouterReplay.get_replay_topk

    def ignores_the_target(self, scores, topk, *args, **kwargs):
        self.router_replay_action = None  # route by its own top-k
        return real(self, scores, topk, *args, **kwargs)

    monkeypatch.setattr(RouterReplay, "get_replay_topk", ignores_the_target)
    broken: dict = {}
    with torch.no_grad(), replay_routing(policy, other, broken):
        policy.logits(tokens_BT, valid_BT)
    assert int(broken["differ"]) > routes // 2  # random targets: the live top-k differs
