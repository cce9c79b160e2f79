"""The router margin per MoE layer: how close the loss positions' tokens are to another expert.

Shape legend: N routed valid tokens (this rank's shard), L MoE layers, K top-k.

`moe/router_margin/layer_XX` is the median over the loss positions (the positions whose
next-token logits score a response token, as for expert flips, `megatron_gspo.algo.flips`) of
p_(K) - p_(K+1): the router probability (softmax over all E experts of the router logits, in
float32; `moe.routing.scores`) of a token's K-th expert minus that of the best expert left out.
`moe/router_margin_small/layer_XX` is the fraction of those margins below a threshold
(`train.router_margin_small`): the tokens a small change of the router logits flips. Both come
from the router scores of the no-grad forward the flip measurement runs after each measured
step (`train.flip_every`): a top-(K+1) and a softmax per layer, no forward of their own. The
median and the fraction are over the loss positions of every rank (`dist.gather_rows`).
"""

from __future__ import annotations

import torch

from megatron_gspo.dist import gather_rows
from moe.routing.scores import RouterScores


def margin_metrics(scores: RouterScores, rows_N: torch.Tensor, small: float) -> dict:
    """`moe/router_margin/layer_XX|mean` (median margin of each layer over the rows `rows_N`
    of every rank; mean = over layers) and `moe/router_margin_small/layer_XX|mean` (the
    fraction of those margins < `small`). Collective; NaN where no rank has a row."""
    margins_NL = gather_rows(scores.margins_NL()[rows_N.bool()])
    L = scores.ids_NLJ.shape[1]
    if margins_NL.shape[0]:
        median_L = torch.quantile(margins_NL, 0.5, dim=0)
        small_L = (margins_NL < small).double().mean(0)
    else:
        median_L = small_L = torch.full((L,), float("nan"), dtype=torch.float64)
    out = {}
    for prefix, values_L in (("moe/router_margin/", median_L),
                             ("moe/router_margin_small/", small_L)):
        out.update({f"{prefix}layer_{l:02d}": float(v) for l, v in enumerate(values_L)})
        out[f"{prefix}mean"] = float(values_L.mean())
    return out
