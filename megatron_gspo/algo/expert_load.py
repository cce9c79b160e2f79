"""Per-expert load: how many tokens each expert of each MoE layer receives.

Shape legend: N routed tokens, L MoE layers, K top-k, E experts.

Users of MoE RL frameworks ask for it on their dashboards (verl, Megatron-LM): a router that
sends most tokens to a few experts wastes the others' capacity and, under expert parallelism,
makes one rank the step's straggler. `expert_load` counts activations (each token counts once
for each of its K experts) of a routing cache's tokens, which are the real tokens of the
forward that recorded it, packed or padded (a routing cache holds no padding), summed over
ranks; `load_metrics` reduces each layer to two numbers: max / mean and the coefficient of
variation (population std / mean), both 1 and 0 for a perfectly balanced layer and scale-free
(they do not depend on how many tokens were counted).
"""

from __future__ import annotations

import torch

from megatron_gspo.dist import sum_over_ranks


def expert_load(cache, copies: int = 1) -> torch.Tensor:
    """float64 [L, E]: activations per expert and layer of `cache`'s tokens
    (`moe.routing.replay.RoutingReplayCache`) summed over every rank (collective), divided by
    `copies`, the ranks holding each token (`cache_copies`)."""
    ids_NLK = cache.ids_NLK.long()
    L, E = ids_NLK.shape[1], cache.num_experts
    load_LE = torch.stack([torch.bincount(ids_NLK[:, layer].reshape(-1), minlength=E)
                           for layer in range(L)]).double()
    return sum_over_ranks(load_LE) / copies


def cache_copies(cache, rows_valid_BT: torch.Tensor, tp: int) -> int:
    """How many ranks hold each token of `cache`, a routing of the rows `rows_valid_BT` [B, T]:
    a cache of whole rows (packed forwards gather their sequence-parallel shards; a sampler's
    routing) is on each of the `tp` tensor-parallel ranks of the rows' replica; a padded
    sequence-parallel forward's holds this rank's column shard (fewer columns): one."""
    return tp if tuple(cache.valid_BT.shape) == tuple(rows_valid_BT.shape) else 1


def load_metrics(load_LE: torch.Tensor, prefix: str = "moe/expert_load/") -> dict:
    """`{prefix}layer_XX/max_over_mean` and `{prefix}layer_XX/cv` of each layer's load (NaN
    for a layer without a token), and their means over the layers with tokens,
    `{prefix}mean/...`."""
    mean_L = load_LE.mean(1)
    mean_L = torch.where(mean_L > 0, mean_L, torch.full_like(mean_L, float("nan")))
    max_over_mean_L = load_LE.max(1).values / mean_L
    cv_L = load_LE.std(1, unbiased=False) / mean_L
    out = {}
    for layer, (peak, cv) in enumerate(zip(max_over_mean_L.tolist(), cv_L.tolist())):
        out[f"{prefix}layer_{layer:02d}/max_over_mean"] = peak
        out[f"{prefix}layer_{layer:02d}/cv"] = cv
    out[f"{prefix}mean/max_over_mean"] = float(max_over_mean_L.nanmean())
    out[f"{prefix}mean/cv"] = float(cv_L.nanmean())
    return out
