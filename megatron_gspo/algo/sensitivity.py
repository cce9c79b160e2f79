"""Route sensitivity per MoE layer: how much the sampled tokens' log-probs move when tokens take
the next-best expert.

Shape legend: B sequences, T tokens, N routed valid tokens (this rank's shard), L MoE layers,
K top-k.

Expert flips (`megatron_gspo.algo.flips`) say how often routing changes and the router margin
(`megatron_gspo.algo.margins`) how close it is to changing; this says whether a change matters,
which decides whether Routing Replay has anything to remove. `moe/route_sensitivity/layer_XX`
(`route_sensitivity`): at one layer at a time, a random `fraction` of the loss positions (the
positions whose next-token logits score a response token, as for flips) route to their (K+1)-th
expert instead of their K-th (forced through megatron's replay, `moe.routing.replay.replay_routing`,
so it runs under expert parallelism like any replay), every other route as the router chose;
the value is the mean over response tokens of |log pi(swapped) - log pi(as routed)| of the
sampled tokens, in nats, a ratio of sums over ranks. L + 1 no-grad forwards of the batch (one
as routed, one per layer). It grows about linearly with `fraction` while swaps are sparse:
compare values measured at the same fraction.

With `lowest_margin=True` the swapped positions are instead, at each layer, the `fraction` of
loss positions with the smallest router margin there (`moe.routing.scores.RouterScores.
margins_NL`, p_(K) - p_(K+1); each rank its own under data parallelism): the near-ties a small
change of the router logits flips first. Beside the random draw it tests the claim that flips
cost little because they happen where the two experts nearly agree.
"""

from __future__ import annotations

import torch

from megatron_gspo.algo.flips import loss_positions
from megatron_gspo.dist import sum_over_ranks
from moe.routing.replay import replay_routing
from moe.routing.scores import RouterScores, record_router_scores


def margin_rows(policy, scores: RouterScores, response_BT: torch.Tensor) -> torch.Tensor:
    """bool [N]: which of `scores`' tokens (this rank's routed shard) are loss positions."""
    return policy.routed_valid(loss_positions(response_BT))[scores.valid_BT]


def _start(response_BT: torch.Tensor) -> int:
    """The first column holding a response token (at least 1)."""
    cols = response_BT.bool().any(0).nonzero()
    return max(1, int(cols[0])) if len(cols) else 1


@torch.no_grad()
def route_sensitivity(policy, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                      response_BT: torch.Tensor, fraction: float, generator: torch.Generator,
                      temperature: float = 1.0, lowest_margin: bool = False) -> list[float]:
    """Per MoE layer, the mean |change| (nats) of the sampled tokens' log-probs (`response_BT`)
    when a random `fraction` of the loss positions take their (K+1)-th expert in place of their
    K-th at that layer only (module docstring). `generator` (CPU) draws which positions, once,
    for every layer: seed it alike on ranks that route the same tokens (tensor parallel).
    `lowest_margin`: the fraction with the smallest margins at each layer instead (no draw).
    L + 1 no-grad forwards of the batch; collective under several ranks."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be in [0, 1]")
    start = _start(response_BT)
    with record_router_scores(policy) as recorded:
        base_BT = policy.token_logprobs(tokens_BT, valid_BT, temperature, start=start)
    scores = RouterScores.from_recorded(recorded, policy.routed_valid(valid_BT),
                                        policy.preset.num_experts, policy.router_rows)
    rows_N = margin_rows(policy, scores, response_BT)
    swap_N = rows_N & (torch.rand(rows_N.shape, generator=generator) < fraction)
    resp_BT = response_BT.bool().to(base_BT.device)
    sums = []
    for layer in range(scores.ids_NLJ.shape[1]):
        if lowest_margin:
            swap_N = lowest(scores.margins_NL()[:, layer], rows_N, fraction)
        with replay_routing(policy, scores.swapped(layer, swap_N)):
            logp_BT = policy.token_logprobs(tokens_BT, valid_BT, temperature, start=start)
        sums.append((logp_BT - base_BT).abs()[resp_BT].double().sum())
    totals = sum_over_ranks(torch.stack([*sums, resp_BT.sum().double()]).cpu())
    return (totals[:-1] / totals[-1]).tolist() if totals[-1] else [float("nan")] * len(sums)


def lowest(values_N: torch.Tensor, rows_N: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool [N]: the round(fraction x rows) rows of `rows_N` with the smallest `values_N`
    (ties to the earlier row)."""
    idx_n = rows_N.nonzero().flatten()
    keep = idx_n[values_N[idx_n].argsort(stable=True)[:round(fraction * len(idx_n))]]
    out_N = torch.zeros_like(rows_N)
    out_N[keep] = True
    return out_N


def sensitivity_metrics(per_layer: list[float]) -> dict:
    """`moe/route_sensitivity/layer_XX` and its `mean` over layers."""
    out = {f"moe/route_sensitivity/layer_{l:02d}": v for l, v in enumerate(per_layer)}
    out["moe/route_sensitivity/mean"] = sum(per_layer) / len(per_layer)
    return out
