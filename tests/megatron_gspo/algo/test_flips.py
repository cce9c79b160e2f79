"""Flip statistics on the loss positions vs all tokens: a constructed routing whose prompt and
response flips differ, checked against hand-computed values."""

import pytest
import torch

from megatron_gspo.algo.flips import flip_counts, layer_flips, loss_positions, token_rows
from moe.routing.replay import RoutingReplayCache
from moe.routing.tokens import RouterRows
from tests.moe.grads import dense_cache

E = 4


class OneRank:
    """The part of MoEPolicy that `token_rows` reads (no sequence parallelism)."""

    router_rows = RouterRows()
    routed_valid = staticmethod(lambda mask_BT: mask_BT.cpu())


def constructed():
    """2 sequences x 5 columns, 2 layers, top-2 of 4. Every token routes to {0, 1} in the old
    routing; the new one flips only prompt tokens in layer 0 (3 activations) and one loss
    position in layer 1 (1 activation)."""
    valid_BT = torch.ones(2, 5, dtype=torch.bool)
    valid_BT[1, 4] = False  # right padding
    response_BT = torch.zeros(2, 5, dtype=torch.bool)
    response_BT[0, 3:] = True
    response_BT[1, 2:4] = True
    old_BTLK = torch.tensor([0, 1]).expand(2, 5, 2, 2).clone()
    new_BTLK = old_BTLK.clone()
    new_BTLK[0, 0, 0] = torch.tensor([2, 3])  # prompt token, 2 flips, layer 0
    new_BTLK[1, 0, 0] = torch.tensor([0, 2])  # prompt token, 1 flip, layer 0
    new_BTLK[0, 2, 1] = torch.tensor([0, 3])  # predicts response token (0, 3): 1 flip, layer 1
    old = dense_cache(old_BTLK, valid_BT, E)
    new = dense_cache(new_BTLK, valid_BT, E)
    return old, new, valid_BT, response_BT


def test_loss_positions_are_the_positions_predicting_response_tokens():
    _, _, _, response_BT = constructed()
    assert loss_positions(response_BT).nonzero().tolist() == [[0, 2], [0, 3], [1, 1], [1, 2]]


def test_response_and_all_token_flips_differ_as_constructed():
    old, new, _, response_BT = constructed()
    rows_N = token_rows(OneRank(), new, loss_positions(response_BT))
    assert int(rows_N.sum()) == 4 and rows_N.numel() == 9
    out = layer_flips(old, new, "moe/drift_vs_old/", rows_N)
    want = {"moe/drift_vs_old/layer_00": 0.0, "moe/drift_vs_old/layer_01": 1 / 8,
            "moe/drift_vs_old/mean": 1 / 16, "moe/drift_vs_old/max": 1 / 8,
            "moe/drift_vs_old_all/layer_00": 3 / 18, "moe/drift_vs_old_all/layer_01": 1 / 18,
            "moe/drift_vs_old_all/mean": 1 / 9, "moe/drift_vs_old_all/max": 3 / 18}
    assert out == pytest.approx(want, abs=1e-15)
    assert sorted(out) == sorted(want)


def test_token_and_load_statistics_on_the_loss_positions():
    old, new, _, response_BT = constructed()
    rows_N = token_rows(OneRank(), new, loss_positions(response_BT))
    stats = flip_counts(old, new, rows_N)
    assert stats["any_flip"] == pytest.approx([0.0, 1 / 4], abs=1e-15)
    assert stats["jaccard"] == pytest.approx([1.0, (3 + 1 / 3) / 4], abs=1e-15)
    # layer 1 loads over the 4 rows: e0=4, e1=3, e2=0, e3=1 -> max / mean = 4 / 2
    assert stats["load_imbalance"] == pytest.approx([2.0, 2.0], abs=1e-15)
    none = flip_counts(old, new, torch.zeros_like(rows_N))
    assert all(v != v for v in none["flip_rate"])  # NaN: no token counted


def test_mismatched_shapes_are_an_error():
    old, new, _, _ = constructed()
    with pytest.raises(ValueError, match="same"):
        flip_counts(old, new, torch.ones(3, dtype=torch.bool))
    # same tokens, fewer layers in `new`: not silently compared over new's layers only
    one_layer = RoutingReplayCache(new.ids_NLK[:, :1].clone(), new.valid_BT, E)
    with pytest.raises(ValueError, match="same"):
        flip_counts(old, one_layer, torch.ones(9, dtype=torch.bool))


def test_load_imbalance_is_the_new_routings():
    """Loads are counted on `new` (the routing after the step), not on `old`: old routes
    every token to {0, 1} (max / mean 2), new alternates {0, 1} / {2, 3} (balanced, 1)."""
    valid_BT = torch.ones(1, 4, dtype=torch.bool)
    old_BTLK = torch.tensor([0, 1]).expand(1, 4, 1, 2).clone()
    new_BTLK = torch.tensor([[0, 1], [2, 3]]).repeat(2, 1).reshape(1, 4, 1, 2)
    old = dense_cache(old_BTLK, valid_BT, E)
    new = dense_cache(new_BTLK, valid_BT, E)
    every_N = torch.ones(4, dtype=torch.bool)
    assert flip_counts(old, new, every_N)["load_imbalance"] == [1.0]
    assert flip_counts(new, old, every_N)["load_imbalance"] == [2.0]


def step_flips_case(monkeypatch):
    """A replayed step (R2: "before" is pi_old's routing, handed in) whose "after" routing is
    served by a stubbed `routing_of`. 2 sequences x 4 columns, 1 layer, top-2 of 4; loss
    positions (0, 1), (0, 2), (1, 2). Before: every token on {0, 1}. After: loss positions
    (0, 1) and (1, 2) move to {2, 3}, prompt token (1, 0) to {0, 2}."""
    from types import SimpleNamespace

    from megatron_gspo.algo import flips

    valid_BT = torch.ones(2, 4, dtype=torch.bool)
    response_BT = torch.zeros(2, 4, dtype=torch.bool)
    response_BT[0, 2:] = True
    response_BT[1, 3] = True
    before_BTLK = torch.tensor([0, 1]).expand(2, 4, 1, 2).clone()
    after_BTLK = before_BTLK.clone()
    after_BTLK[0, 1, 0] = torch.tensor([2, 3])
    after_BTLK[1, 2, 0] = torch.tensor([3, 2])
    after_BTLK[1, 0, 0] = torch.tensor([0, 2])
    before = dense_cache(before_BTLK, valid_BT, E)
    after = dense_cache(after_BTLK, valid_BT, E)
    monkeypatch.setattr(flips, "routing_of", lambda policy, tokens_BT, valid_BT: after)
    mb = SimpleNamespace(replay=before, old_routing=before, valid_BT=valid_BT,
                         tokens_BT=torch.zeros(2, 4, dtype=torch.long), response_BT=response_BT)
    return flips.StepFlips(OneRank(), mb, active=True, before=before)


def test_step_flips_count_the_loss_positions_and_the_after_routings_load(monkeypatch):
    """`StepFlips.after_step` on the constructed step: headline keys over the loss positions
    (not the response tokens themselves), `_all` over every token, loads of the routing after
    the step (after: loads 1, 1, 2, 2 on the loss positions -> 4 / 3; before's would be 2)."""
    step = step_flips_case(monkeypatch)
    with step.watch():
        pass
    out = step.after_step()
    want = {"moe/flip_rate/layer_00": 4 / 6, "moe/any_flip/layer_00": 2 / 3,
            "moe/jaccard/layer_00": 1 / 3, "moe/load_imbalance/layer_00": 4 / 3,
            "moe/flip_rate_all/layer_00": 5 / 16, "moe/drift_vs_old/layer_00": 4 / 6,
            "moe/drift_vs_old_all/layer_00": 5 / 16, "moe/loss_routing_vs_old/layer_00": 0.0}
    for key, value in want.items():
        assert out[key] == pytest.approx(value, abs=1e-15), key


def test_a_skipped_step_measures_and_carries_nothing(monkeypatch):
    """`FlipSchedule.finish(stepped=False)`: no metrics (the weights did not move) and no
    routing handed to the next step, even from an active measurement."""
    from megatron_gspo.algo.flips import FlipSchedule

    schedule = FlipSchedule(every=1, old_is_live=True)
    step = step_flips_case(monkeypatch)
    with step.watch():
        pass
    step.next_before = object()
    assert step.active and step.after_step()  # it would measure
    assert schedule.finish(step, stepped=False) == {}
    assert schedule._carried is None


@pytest.mark.parametrize("old_is_live", [True, False])
def test_flip_schedule_reuses_pi_old_and_hands_over_only_where_valid(old_is_live):
    """every=2: steps 0, 2 measure; step 0 starts from pi_old's routing only if that routing is
    live (R2, not R3); a measured step's successor is routed in its pass only if the successor
    is measured and replays (its own forward records nothing live then)."""
    from types import SimpleNamespace

    from megatron_gspo.algo.flips import FlipSchedule

    old = object()
    replayed = SimpleNamespace(replay=object(), old_routing=old)
    unreplayed = SimpleNamespace(replay=None, old_routing=old)
    schedule = FlipSchedule(every=2, old_is_live=old_is_live)
    first = schedule.start(None, replayed, step=0, next_mb=replayed, first=True)
    assert first.active and first.next_mb is None  # step 1 is not measured
    assert first.before is (old if old_is_live else None)
    carried = object()
    first.next_before = carried  # what after_step of a hand-over pass leaves
    first.after_step = lambda: {"moe/flip_rate/mean": 0.5}
    assert schedule.finish(first, stepped=True) == {"moe/flip_rate/mean": 0.5}
    second = schedule.start(None, replayed, step=1, next_mb=replayed)
    assert not second.active and second.before is carried  # handed over, then dropped
    assert schedule.finish(second, stepped=False) == {}
    third = schedule.start(None, replayed, step=1, next_mb=replayed)
    assert third.before is None and third.next_mb is replayed  # step 2 measured + replays
    fourth = schedule.start(None, replayed, step=1, next_mb=unreplayed)
    assert fourth.next_mb is None  # the unreplayed step records its own "before"
    assert not FlipSchedule(every=0, old_is_live=True).start(None, replayed, 0).active


def test_rows_given_as_zero_one_ints_are_a_mask():
    """`flip_counts` reads integer 0/1 rows as a mask, not as token indices."""
    old, new, _, response_BT = constructed()
    rows_N = token_rows(OneRank(), new, loss_positions(response_BT))
    assert flip_counts(old, new, rows_N.long()) == flip_counts(old, new, rows_N)


def test_load_imbalance_is_per_layer():
    """Each layer's max load over that layer's mean: layer 0 of `new` is balanced (1.0), layer
    1 puts every token on {0, 1} (max 4 / mean 2); not one max shared by all layers."""
    valid_BT = torch.ones(1, 4, dtype=torch.bool)
    new_BTLK = torch.tensor([0, 1]).expand(1, 4, 2, 2).clone()
    new_BTLK[0, 1::2, 0] = torch.tensor([2, 3])
    new = dense_cache(new_BTLK, valid_BT, E)
    assert flip_counts(new, new, torch.ones(4, dtype=torch.bool))["load_imbalance"] == [1.0, 2.0]


def test_step_flips_keys_are_exactly_the_documented_ones(monkeypatch):
    """`after_step` logs per layer + mean for flip_rate / any_flip / jaccard / load_imbalance
    and the drift keys, `max` for flip rates only."""
    step = step_flips_case(monkeypatch)
    with step.watch():
        pass
    got = set(step.after_step())
    want = {f"moe/{s}/{k}" for s in ("any_flip", "jaccard", "load_imbalance")
            for k in ("layer_00", "mean")}
    want |= {f"{p}/{k}" for p in ("moe/flip_rate", "moe/flip_rate_all", "moe/drift_vs_old",
                                  "moe/drift_vs_old_all", "moe/loss_routing_vs_old")
             for k in ("layer_00", "mean", "max")}
    assert got == want


def test_an_inactive_step_routes_nothing_and_logs_nothing(monkeypatch):
    """A step off the flip schedule neither runs a routing forward (watch / after_step) nor
    keeps a routing, and returns no metrics."""
    from megatron_gspo.algo import flips

    case = step_flips_case(monkeypatch)

    def no_forward(*args, **kwargs):
        raise AssertionError("an inactive step ran a routing forward")

    monkeypatch.setattr(flips, "routing_of", no_forward)
    monkeypatch.setattr(flips, "record_routing", no_forward)
    step = flips.StepFlips(case.policy, case.mb, active=False)
    with step.watch():
        pass
    assert step.before is None and step.used is None
    assert step.after_step() == {}
    case.mb.replay = None  # the unreplayed path records nothing either
    with step.watch():
        pass
    assert step.before is None and step.used is None


def dense(BTK_rows, valid_BT):
    """A 1-layer cache from per-token top-2 rows [B][T][2]."""
    return dense_cache(torch.tensor(BTK_rows)[:, :, None], valid_BT, E)


def test_replayed_step_compares_each_routing_with_the_right_one(monkeypatch):
    """R3-like step where the four routings differ: pi_old's `old`, the handed-over live
    `before`, the sampler's `replay` the loss used, and `after`. Loss positions (0, 1), (0, 2),
    (1, 2) (6 activations): flip_rate is before -> after (1/6), drift_vs_old old -> after
    (2/6), loss_routing_vs_old old -> replay (3/6)."""
    from types import SimpleNamespace

    from megatron_gspo.algo import flips

    valid_BT = torch.ones(2, 4, dtype=torch.bool)
    response_BT = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    a, b, c, d, e = [0, 1], [0, 2], [1, 3], [2, 3], [0, 3]
    old = dense([[a, a, a, a], [a, a, a, a]], valid_BT)
    before = dense([[a, b, a, a], [a, a, a, a]], valid_BT)
    replay = dense([[a, a, e, a], [a, a, d, a]], valid_BT)
    after = dense([[a, b, c, a], [b, a, a, a]], valid_BT)  # + prompt token (1, 0)
    monkeypatch.setattr(flips, "routing_of", lambda policy, tokens_BT, valid_BT: after)
    mb = SimpleNamespace(replay=replay, old_routing=old, valid_BT=valid_BT,
                         tokens_BT=torch.zeros(2, 4, dtype=torch.long), response_BT=response_BT)
    step = flips.StepFlips(OneRank(), mb, active=True, before=before)
    with step.watch():
        pass
    assert step.before is before and step.used is replay
    out = step.after_step()
    want = {"moe/flip_rate/layer_00": 1 / 6, "moe/flip_rate_all/layer_00": 2 / 16,
            "moe/drift_vs_old/layer_00": 2 / 6, "moe/drift_vs_old_all/layer_00": 3 / 16,
            "moe/loss_routing_vs_old/layer_00": 3 / 6, "moe/any_flip/layer_00": 1 / 3,
            "moe/jaccard/layer_00": (1 + 1 / 3 + 1) / 3,
            "moe/load_imbalance/layer_00": 2 / 1.5}  # after on the loss rows: 2, 2, 1, 1
    for key, value in want.items():
        assert out[key] == pytest.approx(value, abs=1e-15), key


class SecondHalfShard:
    """A rank whose routers see columns 2, 3 of every row (its sequence-parallel shard)."""

    preset = type("Preset", (), {"num_experts": E})
    router_rows = RouterRows()  # padded: its recordings are [T*B] of its shard

    def routed_valid(self, mask_BT):
        return mask_BT[:, 2:].cpu()


def test_unreplayed_step_records_its_own_before_over_the_routed_shard(monkeypatch):
    """No replay: "before" is the training forward's recorded routing over this rank's shard
    (columns 2, 3: 4 tokens, loss positions (0, 2) and (1, 2)), and it is also the routing
    the loss used. flip_rate before -> after 2/4, loss_routing_vs_old old -> before 1/4,
    drift_vs_old old -> after 3/4; over every shard token 3/8 and 4/8."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from megatron_gspo.algo import flips

    valid_BT = torch.ones(2, 4, dtype=torch.bool)
    shard_BT = valid_BT[:, 2:]
    response_BT = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    a, b, d, e, f = [0, 1], [0, 2], [2, 3], [0, 3], [1, 2]
    old = dense([[a, a], [a, a]], shard_BT)
    live_BTK = torch.tensor([[b, a], [a, a]])  # (0, 2) -> {0, 2}
    after = dense([[d, a], [e, f]], shard_BT)

    @contextmanager
    def record(policy):
        recorded = []
        yield recorded
        recorded.append(live_BTK.transpose(0, 1).reshape(-1, 2))  # sequence-first [T*B, K]

    monkeypatch.setattr(flips, "record_routing", record)
    monkeypatch.setattr(flips, "routing_of", lambda policy, tokens_BT, valid_BT: after)
    mb = SimpleNamespace(replay=None, old_routing=old, valid_BT=valid_BT,
                         tokens_BT=torch.zeros(2, 4, dtype=torch.long), response_BT=response_BT)
    step = flips.StepFlips(SecondHalfShard(), mb, active=True)
    with step.watch(), step.forward():  # the step's one training forward
        pass
    assert step.used is step.before
    assert step.before.ids_NLK[:, 0].tolist() == [b, a, a, a]
    out = step.after_step()
    want = {"moe/flip_rate/layer_00": 2 / 4, "moe/loss_routing_vs_old/layer_00": 1 / 4,
            "moe/drift_vs_old/layer_00": 3 / 4, "moe/flip_rate_all/layer_00": 3 / 8,
            "moe/drift_vs_old_all/layer_00": 4 / 8}
    for key, value in want.items():
        assert out[key] == pytest.approx(value, abs=1e-15), key


class Rows:
    """A minibatch as `StepFlips` reads it: tokens, masks, routings; len = its rows."""

    def __init__(self, tokens_BT, replay=None, old_routing=None, response_BT=None):
        self.tokens_BT, self.replay, self.old_routing = tokens_BT, replay, old_routing
        self.valid_BT = tokens_BT >= 0
        self.response_BT = torch.ones_like(self.valid_BT) if response_BT is None else response_BT

    def __len__(self):
        return self.tokens_BT.shape[0]


def test_hand_over_pass_splits_the_rows_between_the_two_minibatches(monkeypatch):
    """With `next_mb`, one routing pass covers both minibatches (2 rows, then 1 row with a
    padded token): `mb`'s part is its "after", the rest becomes `next_before`, each equal to
    routing that minibatch alone."""
    from megatron_gspo.algo import flips

    def by_token(policy, tokens_BT, valid_BT):  # expert set of a token: {t, t + 1} mod 4
        calls.append(tokens_BT.shape[0])
        t = tokens_BT.clamp(min=0)
        return dense_cache(torch.stack([t % E, (t + 1) % E], -1)[:, :, None],
                                             valid_BT, E)

    calls = []
    monkeypatch.setattr(flips, "routing_of", by_token)
    tokens = torch.tensor([[0, 1, 2], [3, 0, 1]])
    nxt = Rows(torch.tensor([[2, 3, -1]]), replay=object())
    mb = Rows(tokens, old_routing=by_token(None, tokens, tokens >= 0))
    step = flips.StepFlips(OneRank(), mb, active=True, before=mb.old_routing, next_mb=nxt)
    mb.replay = mb.old_routing
    with step.watch():
        pass
    calls.clear()
    out = step.after_step()
    assert calls == [3]  # one pass over both minibatches' rows
    want_next = by_token(None, nxt.tokens_BT, nxt.valid_BT)
    assert torch.equal(step.next_before.ids_NLK, want_next.ids_NLK)
    assert torch.equal(step.next_before.valid_BT, want_next.valid_BT)
    assert out["moe/flip_rate_all/mean"] == 0.0  # mb's own rows, unchanged routing


def test_replayed_step_without_a_known_before_routes_it_live(monkeypatch):
    """Replay and no handed-over "before" (R3's first step): `watch` runs one live routing
    forward for it; neither the replayed cache nor pi_old's routing stands in."""
    from megatron_gspo.algo import flips

    step = step_flips_case(monkeypatch)
    live = object()
    monkeypatch.setattr(flips, "routing_of", lambda policy, tokens_BT, valid_BT: live)
    step.before = None
    with step.watch():
        pass
    assert step.before is live and step.used is step.mb.replay


def test_sampler_mismatch_counts_routers_tokens_and_activations(single_process):
    """3 loss-row tokens, 2 layers, K=2 of E=4: token 0 differs in layer 0 by one expert, token
    1 in both layers (sets disjoint in layer 1), token 2 nowhere; a 4th token off the loss
    rows differs in both layers and counts only in the `_all` keys."""
    from megatron_gspo.algo.flips import sampler_mismatch

    E = 4
    valid_BT = torch.ones(1, 4, dtype=torch.bool)
    live = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[1, 2], [0, 3]], [[0, 1], [0, 1]]])
    samp = torch.tensor([[[0, 2], [2, 3]], [[1, 0], [2, 3]], [[2, 1], [3, 0]], [[2, 3], [2, 3]]])
    samp[1, 0] = torch.tensor([0, 3])  # token 1, layer 0: one expert differs
    rows_N = torch.tensor([True, True, True, False])
    m = sampler_mismatch(RoutingReplayCache(live, valid_BT, E),
                         RoutingReplayCache(samp, valid_BT, E), rows_N)
    assert m["rollout/routing_mismatch/layer_00"] == pytest.approx(2 / 3)  # tokens 0, 1
    assert m["rollout/routing_mismatch/layer_01"] == pytest.approx(1 / 3)  # token 1
    assert m["rollout/routing_mismatch/max"] == pytest.approx(2 / 3)
    assert m["rollout/routing_any_diff"] == pytest.approx(2 / 3)
    assert m["rollout/routing_mismatch_experts/layer_01"] == pytest.approx(2 / 6)
    assert m["rollout/routing_mismatch_all/layer_01"] == pytest.approx(4 / 8)
