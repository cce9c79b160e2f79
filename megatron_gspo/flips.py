"""Expert-flip instrumentation: how much one optimizer step changes each token's experts.

Shape legend: B sequences, T tokens, N routed tokens, L MoE layers, K top-k.

The GSPO paper (arXiv 2507.18071, sec. 5.3) reports that after one gradient step about 10% of
the experts activated for the same tokens change (Qwen3-30B-A3B, 48 layers, 128 experts top-8);
this is what makes GRPO's token ratios noisy on MoE and what Routing Replay removes. Per
measured optimizer step `StepFlips` compares the top-k sets of the minibatch's tokens just
before the step with those just after it (`moe/flip_rate/layer_XX`, `moe/flip_rate/mean`, load
statistics), and the live routing after the step with pi_old's (`moe/drift_vs_old/...`).

Cost: at most one no-grad forward per measured step. The "before" routing is recorded from the
training forward itself unless that forward replays a cached routing (R2/R3); then it is the live
routing at the step's starting weights from elsewhere: pi_old's pass for an iteration's first
step (the same weights), else the previous measured step's "after" forward, which then runs over
both minibatches' rows (`next_mb`: one call, twice the rows), else one extra forward. The "after"
routing is one no-grad forward. Departure from the paper: it does not say which tokens it
counts; here every valid token of the minibatch (prompt and response).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from moe.replay import RoutingReplayCache, current_routing, record_routing
from moe.routing_stats import routing_metrics


class StepFlips:
    """Flip measurement around one optimizer step on minibatch `mb` (a no-op unless `active`).

        flips = StepFlips(policy, mb, active=True)
        with flips.watch(), replay_routing(policy, mb.replay):   # watch first: see below
            loss = ...policy forward...
        ...backward, optimizer step...
        metrics.update(flips.after_step())

    `before`: the live routing of `mb` at the current weights when already known (pi_old's for
    an iteration's first step). `next_mb`: the next step's minibatch when that step measures
    too; `after_step` then also routes its rows and leaves them in `next_before`.
    """

    def __init__(self, policy, mb, active: bool, before: RoutingReplayCache | None = None,
                 next_mb=None):
        self.policy, self.mb, self.active = policy, mb, active
        self.before, self.next_mb = before, next_mb
        self.next_before: RoutingReplayCache | None = None

    @contextmanager
    def watch(self):
        """Wrap the training forward to capture the routing the step starts from. Enter it
        before `replay_routing`: a replayed forward's routing is the cache's, not the router's,
        so then the live routing comes from one extra no-grad forward run here."""
        policy, mb = self.policy, self.mb
        if not self.active:
            yield
            return
        if mb.replay is not None:
            if self.before is None:
                _, self.before = current_routing(policy, mb.tokens_BT, mb.valid_BT)
            yield
            return
        with record_routing(policy) as recorded:
            yield
        self.before = RoutingReplayCache.from_recorded(recorded, policy.routed_valid(mb.valid_BT),
                                                       policy.preset.num_experts)

    def after_step(self) -> dict:
        """Flip rates of this step and drift from pi_old (call once the optimizer stepped)."""
        if not self.active:
            return {}
        after = self._after_routing()
        L = after.num_layers
        out = routing_metrics([self.before.layer_ids(l) for l in range(L)],
                              [after.layer_ids(l) for l in range(L)], after.num_experts)
        out.update(layer_flips(self.mb.old_routing, after, "moe/drift_vs_old/"))
        return out


    def _after_routing(self) -> RoutingReplayCache:
        """The live routing of `mb` now (and of `next_mb`'s rows into `next_before`)."""
        mb, nxt = self.mb, self.next_mb
        if nxt is None:
            return current_routing(self.policy, mb.tokens_BT, mb.valid_BT)[1]
        _, both = current_routing(self.policy, torch.cat([mb.tokens_BT, nxt.tokens_BT]),
                                  torch.cat([mb.valid_BT, nxt.valid_BT]))
        n = len(mb)
        self.next_before = both.select(slice(n, None))
        return both.select(slice(0, n))


def layer_flips(old: RoutingReplayCache, new: RoutingReplayCache, prefix: str) -> dict:
    """Per-layer flip rate of `new` vs `old` (same tokens) as `{prefix}layer_XX` and `mean`."""
    L = new.num_layers
    stats = routing_metrics([old.layer_ids(l) for l in range(L)],
                            [new.layer_ids(l) for l in range(L)], new.num_experts)
    return {k.replace("moe/flip_rate/", prefix): v for k, v in stats.items()
            if k.startswith("moe/flip_rate/")}
