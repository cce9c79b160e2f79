"""Expert-flip instrumentation: how much one optimizer step changes each token's experts.

Shape legend: B sequences, T tokens, N routed tokens, L MoE layers, K top-k, E experts.

The GSPO paper (arXiv 2507.18071, sec. 5.3) reports that after one gradient step about 10% of
the experts activated for the same tokens change (Qwen3-30B-A3B, 48 layers, 128 experts top-8);
this is what makes GRPO's token ratios noisy on MoE and what Routing Replay removes. Per
measured optimizer step `StepFlips` compares the top-k sets of the minibatch's tokens just
before the step with those just after it (`moe/flip_rate/layer_XX`, `moe/flip_rate/mean`,
`moe/any_flip`, `moe/jaccard`, `moe/load_imbalance`), the live routing after the step with
pi_old's (`moe/drift_vs_old/...`), and the routing the loss's forward used with pi_old's
(`moe/loss_routing_vs_old/...`: the replayed cache under R2 / R3, so 0 under R2).

Which tokens: the headline keys count the *loss positions*, the positions whose next-token
logits the loss scores: for a response token at t, the position t-1 that predicts it (the last
prompt token through the second-to-last response token). Their routing is the MoE path of the
log-probs in the importance ratio; prompt positions before them only reach the loss through
attention, and the last response token's own routing reaches nothing. The same statistics over
every valid token (prompt and response, what these keys meant before) are kept as
`moe/flip_rate_all/...`, `moe/drift_vs_old_all/...` and `rollout/routing_mismatch_all/...`.
The paper does not say which tokens it counts.

Counts, not per-rank rates: every statistic is a ratio of sums (flipped activations over
activations, flipped tokens over tokens, per-expert loads) summed over all ranks before
dividing, so it is token-weighted over the whole minibatch under DP / SP (a sequence-parallel
shard holding only prompt positions contributes nothing to the loss-position keys). Each rank
routes distinct tokens (its DP rows, its SP shard), so the world sum counts each token once.

Cost: at most one no-grad forward per measured step. The "before" routing is recorded from the
training forward itself unless that forward replays a cached routing (R2/R3); then it is the live
routing at the step's starting weights from elsewhere: pi_old's pass for an iteration's first
step under R2 (the same weights; under R3 pi_old's pass replays the sampler's routing, so not
there), else the previous measured step's "after" forward, which then runs over both
minibatches' rows (`next_mb`: one call, twice the rows), else one extra forward. The "after"
routing is one no-grad forward; its router scores also give the router margin
(`megatron_gspo.algo.margins`: `moe/router_margin/...`) at no forward's cost. Under router noise (`moe.routing.noise`,
`train.router_noise_std`) the recorded "before" of an unreplayed step is the noisy routing its
loss actually used, so `moe/flip_rate` counts the noise's flips too.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_gspo.algo.margins import margin_metrics
from megatron_gspo.dist import sum_over_ranks
from moe.routing.replay import (RoutingReplayCache, current_routing, record_routing,
                                restore_order)
from moe.routing.scores import RouterScores, record_router_scores
from moe.routing.stats import topk_mask


def loss_positions(response_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: positions whose next-token logits score a response token (t-1 for t)."""
    out_BT = torch.zeros_like(response_BT, dtype=torch.bool)
    out_BT[:, :-1] = response_BT[:, 1:].bool()
    return out_BT


def token_rows(policy, cache: RoutingReplayCache, mask_BT: torch.Tensor) -> torch.Tensor:
    """bool [N]: which of `cache`'s tokens (this rank's routed shard) lie in `mask_BT`."""
    return policy.routed_valid(mask_BT.bool())[cache.valid_BT]


def _layer_counts(old: RoutingReplayCache, new: RoutingReplayCache,
                  row_sets: list[torch.Tensor]) -> torch.Tensor:
    """float64 [R, L, 4 + E], for each row set: flipped activations, tokens, tokens with any
    flip, sum of per-token Jaccard, then the new routing's load per expert (each layer's top-k
    masks are built once for all row sets)."""
    K, E = new.topk, new.num_experts
    out = [[] for _ in row_sets]
    for layer in range(new.num_layers):
        old_all_NE = topk_mask(old.layer_ids(layer), E)
        new_all_NE = topk_mask(new.layer_ids(layer).to(old_all_NE.device), E)
        for r, rows_N in enumerate(row_sets):
            old_NE, new_NE = old_all_NE[rows_N], new_all_NE[rows_N]
            inter_N = (old_NE & new_NE).sum(1).double()
            head = torch.stack([(K - inter_N).sum(), torch.tensor(float(inter_N.numel()),
                                dtype=torch.float64), (inter_N < K).double().sum(),
                                (inter_N / (2 * K - inter_N)).sum()])
            out[r].append(torch.cat([head, new_NE.sum(0).double()]))
    return torch.stack([torch.stack(layers) for layers in out])


def flip_counts_over(old: RoutingReplayCache, new: RoutingReplayCache,
                     row_sets: list[torch.Tensor]) -> list[dict[str, list[float]]]:
    """`flip_counts` for several row sets of the same pair of routings, with one collective."""
    for rows_N in row_sets:
        if old.ids_NLK.shape != new.ids_NLK.shape or rows_N.shape != (new.ids_NLK.shape[0],):
            raise ValueError(f"routings {tuple(old.ids_NLK.shape)} / "
                             f"{tuple(new.ids_NLK.shape)} and rows {tuple(rows_N.shape)} must "
                             "cover the same [N] tokens")
    counts_RLC = sum_over_ranks(_layer_counts(old, new, [r.bool() for r in row_sets]))
    out = []
    for counts_LC in counts_RLC:
        flipped_L, tokens_L, any_L, jaccard_L = counts_LC[:, :4].T
        tokens_L = torch.where(tokens_L > 0, tokens_L, torch.full_like(tokens_L, float("nan")))
        load_LE = counts_LC[:, 4:]
        out.append({"flip_rate": (flipped_L / (new.topk * tokens_L)).tolist(),
                    "any_flip": (any_L / tokens_L).tolist(),
                    "jaccard": (jaccard_L / tokens_L).tolist(),
                    "load_imbalance": (load_LE.max(1).values / load_LE.mean(1)).tolist()})
    return out


def flip_counts(old: RoutingReplayCache, new: RoutingReplayCache, rows_N: torch.Tensor
                ) -> dict[str, list[float]]:
    """Per-layer `flip_rate`, `any_flip`, `jaccard` of `new` vs `old` and `load_imbalance`
    (max / mean load) of `new`, over the rows `rows_N` of every rank (collective). NaN where
    no rank has a row."""
    return flip_counts_over(old, new, [rows_N])[0]


def _keyed(per_layer: dict[str, list[float]], stats: dict[str, str]) -> dict[str, float]:
    """{stat: prefix} -> `{prefix}layer_XX`, `{prefix}mean` (and `{prefix}max` for flips)."""
    out = {}
    for stat, prefix in stats.items():
        values = per_layer[stat]
        out.update({f"{prefix}layer_{l:02d}": v for l, v in enumerate(values)})
        out[f"{prefix}mean"] = sum(values) / len(values)
        if stat == "flip_rate":
            out[f"{prefix}max"] = max(values)
    return out


def sampler_mismatch(live: RoutingReplayCache, sampler: RoutingReplayCache,
                     rows_N: torch.Tensor) -> dict:
    """The sampler's routing vs the trainer's live recompute of the same tokens at the same
    weights, on the loss rows `rows_N` (collective), as the R3 paper (arXiv 2510.11370) counts:
    `rollout/routing_mismatch/layer_XX|mean|max`, the fraction of routers (token, layer) whose
    top-k sets differ; `rollout/routing_any_diff`, the fraction of tokens whose top-k differs in
    at least one layer; `rollout/routing_mismatch_experts/...`, the fraction of (token, expert)
    activations that differ (the flip rate); `rollout/routing_mismatch_all/...`, that flip rate
    on every valid token."""
    every_N = torch.ones_like(rows_N, dtype=torch.bool)
    on_rows, on_all = flip_counts_over(live, sampler, [rows_N, every_N])
    out = _keyed(on_rows, {"any_flip": "rollout/routing_mismatch/",
                           "flip_rate": "rollout/routing_mismatch_experts/"})
    out["rollout/routing_mismatch/max"] = max(on_rows["any_flip"])
    out.update(_keyed(on_all, {"flip_rate": "rollout/routing_mismatch_all/"}))
    differs_N = torch.zeros(rows_N.shape, dtype=torch.bool)
    for layer in range(live.num_layers):
        a_NE = topk_mask(live.layer_ids(layer), live.num_experts)
        b_NE = topk_mask(sampler.layer_ids(layer).to(a_NE.device), live.num_experts)
        differs_N |= (a_NE != b_NE).any(1).cpu()
    rows_N = rows_N.bool().cpu()
    n, total = sum_over_ranks(torch.tensor([float((differs_N & rows_N).sum()),
                                            float(rows_N.sum())], dtype=torch.float64)).tolist()
    out["rollout/routing_any_diff"] = n / total if total else float("nan")
    return out


def layer_flips(old: RoutingReplayCache, new: RoutingReplayCache, prefix: str,
                rows_N: torch.Tensor) -> dict:
    """Flip rate of `new` vs `old` per layer, `mean` and `max`: on the rows `rows_N` (the loss
    positions) as `{prefix}...`, on every token as `{prefix without /}_all/...` (collective)."""
    every_N = torch.ones_like(rows_N, dtype=torch.bool)
    on_rows, on_all = flip_counts_over(old, new, [rows_N, every_N])
    out = _keyed(on_rows, {"flip_rate": prefix})
    out.update(_keyed(on_all, {"flip_rate": prefix.rstrip("/") + "_all/"}))
    return out


class StepFlips:
    """Flip measurement around one optimizer step on minibatch `mb` (a no-op unless `active`).

        flips = StepFlips(policy, mb, active=True)
        with flips.watch():
            for rows in chunks:   # one, or the microbatches of train.micro_max_tokens
                with flips.forward(rows), replay_routing(policy, ...):  # forward first: below
                    loss = ...policy forward of those rows...
                ...backward...
        ...optimizer step...
        metrics.update(flips.after_step())

    `before`: the live routing of `mb` at the current weights when already known (pi_old's for
    an iteration's first step). `next_mb`: the next step's minibatch when that step measures
    too; `after_step` then also routes its rows and leaves them in `next_before`.
    `margin_small`: also the router margin of the "after" forward's scores
    (`megatron_gspo.algo.margins`, with this threshold); None = not measured.
    """

    def __init__(self, policy, mb, active: bool, before: RoutingReplayCache | None = None,
                 next_mb=None, margin_small: float | None = None):
        self.policy, self.mb, self.active = policy, mb, active
        self.margin_small = margin_small
        self.before, self.next_mb = before, next_mb
        self.next_before: RoutingReplayCache | None = None
        self.used: RoutingReplayCache | None = None  # the routing the loss's forward used

    @contextmanager
    def watch(self):
        """Wrap the step's training forwards (each under `forward`) to capture the routing the
        step starts from. Under replay a forward's routing is the cache's, not the router's, so
        then the live routing comes from one extra no-grad forward run here."""
        policy, mb = self.policy, self.mb
        self._parts: list[tuple] = []  # (rows, their recorded routing) per forward
        if not self.active:
            yield
            return
        if mb.replay is not None:
            if self.before is None:
                self.before = routing_of(policy, mb.tokens_BT, mb.valid_BT)
            self.used = mb.replay
            yield
            return
        yield
        chunks = [rows for rows, _ in self._parts]
        B = mb.valid_BT.shape[0]
        if sum(len(torch.arange(B)[rows]) for rows in chunks) < B:
            return  # a microbatch ended the step (NaN): it is skipped, nothing is measured
        self.before = RoutingReplayCache.cat([cache for _, cache in self._parts])
        back = restore_order(chunks, B)
        if back is not None:  # packed microbatches: their rows back in the minibatch's order
            self.before = self.before.select(back)
        self.used = self.before

    @contextmanager
    def forward(self, rows: slice | torch.Tensor = slice(None)):
        """Around each training forward inside `watch`, over the minibatch's rows `rows` (all
        of them in one forward, or the microbatches of `megatron_gspo.algo.packing`, each row
        once): records its live routing. Enter it before `replay_routing`."""
        policy = self.policy
        if not self.active or self.mb.replay is not None:
            yield
            return
        with record_routing(policy) as recorded:
            yield
        self._parts.append((rows, RoutingReplayCache.from_recorded(
            recorded, policy.routed_valid(self.mb.valid_BT[rows]), policy.preset.num_experts,
            policy.router_rows)))

    def after_step(self) -> dict:
        """Flip rates of this step and drift from pi_old (call once the optimizer stepped)."""
        if not self.active:
            return {}
        mb = self.mb
        after, scores = self._after_routing()
        rows_N = token_rows(self.policy, after, loss_positions(mb.response_BT))
        on_rows, on_all = flip_counts_over(self.before, after, [rows_N, torch.ones_like(rows_N)])
        out = _keyed(on_rows, {s: f"moe/{s}/" for s in ("flip_rate", "any_flip", "jaccard",
                                                          "load_imbalance")})
        out.update(_keyed(on_all, {"flip_rate": "moe/flip_rate_all/"}))
        out.update(layer_flips(mb.old_routing, after, "moe/drift_vs_old/", rows_N))
        out.update(_keyed(flip_counts(mb.old_routing, self.used, rows_N),
                          {"flip_rate": "moe/loss_routing_vs_old/"}))
        if scores is not None:
            out.update(margin_metrics(scores, rows_N, self.margin_small))
        return out

    def _after_routing(self) -> tuple[RoutingReplayCache, RouterScores | None]:
        """The live routing of `mb` now and its router scores (None without `margin_small`),
        and `next_mb`'s routing into `next_before`."""
        mb, nxt = self.mb, self.next_mb
        tokens_BT, valid_BT = mb.tokens_BT, mb.valid_BT
        if nxt is not None:
            tokens_BT, valid_BT = torch.cat([tokens_BT, nxt.tokens_BT]), \
                torch.cat([valid_BT, nxt.valid_BT])
        if self.margin_small is None:
            both, scores = routing_of(self.policy, tokens_BT, valid_BT), None
        else:
            with record_router_scores(self.policy) as recorded:
                both = routing_of(self.policy, tokens_BT, valid_BT)
            scores = RouterScores.from_recorded(recorded, both.valid_BT, both.num_experts,
                                                self.policy.router_rows)
        if nxt is None:
            return both, scores
        n = len(mb)
        self.next_before = both.select(slice(n, None))
        return both.select(slice(0, n)), scores and scores.select(slice(0, n))


class FlipSchedule:
    """Which steps measure flips (`every`-th optimizer step; 0 = never) and which routing each
    measured step can reuse instead of a forward of its own (`StepFlips`' `before`/`next_mb`):

    - an iteration's first step starts from pi_old's weights, so pi_old's routing is the live
      "before", unless pi_old's pass replayed another routing (`old_is_live=False`: R3, where it
      is the sampler's);
    - a measured step whose successor is measured too and replays (R2/R3: its forward records
      nothing live) routes the successor's rows in its own "after" pass and hands them over.

        schedule = FlipSchedule(every=1, old_is_live=True)
        flips = schedule.start(policy, mb, step, next_mb=..., first=...)
        ...forward under flips.watch(), backward, optimizer step...
        metrics.update(schedule.finish(flips, stepped))
    """

    def __init__(self, every: int, old_is_live: bool, margin_small: float | None = None):
        self.every, self.old_is_live, self.margin_small = every, old_is_live, margin_small
        self._carried: RoutingReplayCache | None = None  # next minibatch's live routing

    def measures(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def start(self, policy, mb, step: int, next_mb=None, first: bool = False) -> StepFlips:
        """The `StepFlips` of optimizer step `step` on `mb` (`next_mb`: the iteration's next
        minibatch or None; `first`: no optimizer step since pi_old's pass)."""
        before = mb.old_routing if first and self.old_is_live else self._carried
        self._carried = None
        hand_over = next_mb is not None and next_mb.replay is not None \
            and self.measures(step + 1)
        return StepFlips(policy, mb, active=self.measures(step), before=before,
                         next_mb=next_mb if hand_over else None, margin_small=self.margin_small)

    def finish(self, flips: StepFlips, stepped: bool) -> dict:
        """The step's flip metrics (none if the optimizer skipped the step)."""
        if not stepped:
            return {}
        out = flips.after_step()
        self._carried = flips.next_before
        return out


def routing_of(policy, tokens_BT: torch.Tensor, valid_BT: torch.Tensor) -> RoutingReplayCache:
    """The live routing of every token, from a no-grad forward whose output layer runs on the
    last two positions only (the flip statistics need no log-probs)."""
    return current_routing(policy, tokens_BT, valid_BT, start=tokens_BT.shape[1] - 1)[1]
