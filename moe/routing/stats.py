"""Expert-routing volatility: how much the top-k expert sets move between two policies.

Shape legend: N flat tokens, K top-k, E experts, L MoE layers.

GSPO paper (arXiv 2507.18071, sec. 5.3): after each gradient update of an MoE policy, a sizeable
fraction of the experts activated for the same tokens changes ("expert activation volatility";
~10% for a 48-layer Qwen3-30B-A3B). Here, for the same valid tokens under an old and a new routing:

- flip rate = sum_n |new_n \\ old_n| / sum_n K: the fraction of new (token, expert) activations
  that the old routing did not make;
- any-flip = fraction of tokens whose top-k set changed at all;
- Jaccard = mean_n |old_n & new_n| / |old_n | new_n|;
- load imbalance of one routing = max_e load_e / mean_e load_e (1.0 = balanced), and the
  coefficient of variation std_e / mean_e of the loads (population std).

Top-k rows are sets: order within a row never matters. Everything goes through an [N, E] boolean
mask built with `scatter_`, so there are no Python loops over tokens. Ids may be any integer dtype
(the replay cache stores uint8 / int16).
"""

from __future__ import annotations

from typing import Sequence

import torch

from moe.platform.checks import is_int

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_num_experts(num_experts) -> None:
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int")


def topk_mask(topk_ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [N, E], True where token n routes to expert e. Raises on out-of-range or repeated ids
    within a row (repeats would break megatron's dispatcher split sizes)."""
    _check_num_experts(num_experts)
    if topk_ids_NK.dim() != 2 or topk_ids_NK.dtype not in _INT_DTYPES:
        raise ValueError(f"topk ids must be a 2-D integer tensor [N, K], got shape "
                         f"{tuple(topk_ids_NK.shape)} dtype {topk_ids_NK.dtype}")
    N, K = topk_ids_NK.shape
    if K < 1 or K > num_experts:
        raise ValueError(f"top-k K={K} must be in [1, num_experts={num_experts}]")
    ids_NK = topk_ids_NK.long()
    if N == 0:
        return torch.zeros(0, num_experts, dtype=torch.bool, device=ids_NK.device)
    bad_NK = (ids_NK < 0) | (ids_NK >= num_experts)
    if bad_NK.any():
        n, k = (int(x) for x in bad_NK.nonzero()[0])
        raise ValueError(f"expert id {int(ids_NK[n, k])} at token {n}, slot {k} is outside "
                         f"[0, {num_experts})")
    mask_NE = torch.zeros(N, num_experts, dtype=torch.bool, device=ids_NK.device)
    mask_NE.scatter_(1, ids_NK, True)
    dup_N = mask_NE.sum(1) != K
    if dup_N.any():
        n = int(dup_N.nonzero()[0])
        raise ValueError(f"token {n} repeats an expert id in its top-k row {ids_NK[n].tolist()}")
    return mask_NE


def _valid_rows(valid_N: torch.Tensor | None, N: int, device) -> torch.Tensor:
    if valid_N is None:
        valid_N = torch.ones(N, dtype=torch.bool, device=device)
    if valid_N.dtype != torch.bool or tuple(valid_N.shape) != (N,):
        raise ValueError(f"valid_N must be a bool tensor of shape ({N},), got shape "
                         f"{tuple(valid_N.shape)} dtype {valid_N.dtype}")
    if not valid_N.any():
        raise ValueError("valid_N marks no valid token; routing statistics are undefined")
    return valid_N.to(device)


def flip_stats(old_ids_NK: torch.Tensor, new_ids_NK: torch.Tensor, num_experts: int,
               valid_N: torch.Tensor | None = None) -> dict[str, float]:
    """`flip_rate`, `any_flip`, `jaccard` of new vs old routing over the valid tokens."""
    if old_ids_NK.shape != new_ids_NK.shape:
        raise ValueError(f"old ids {tuple(old_ids_NK.shape)} and new ids "
                         f"{tuple(new_ids_NK.shape)} must have the same [N, K] shape")
    old_NE = topk_mask(old_ids_NK, num_experts)
    new_NE = topk_mask(new_ids_NK.to(old_NE.device), num_experts)
    N, K = old_ids_NK.shape
    valid_N = _valid_rows(valid_N, N, old_NE.device)
    inter_N = (old_NE & new_NE)[valid_N].sum(1).double()
    union_N = 2 * K - inter_N
    return {"flip_rate": float((K - inter_N).sum() / (K * inter_N.numel())),
            "any_flip": float((inter_N < K).double().mean()),
            "jaccard": float((inter_N / union_N).mean())}


def load_stats(ids_NK: torch.Tensor, num_experts: int,
               valid_N: torch.Tensor | None = None) -> dict[str, float]:
    """`load_imbalance` (max / mean tokens per expert) and `load_cv` (std / mean) of one routing."""
    mask_NE = topk_mask(ids_NK, num_experts)
    valid_N = _valid_rows(valid_N, ids_NK.shape[0], mask_NE.device)
    load_E = mask_NE[valid_N].sum(0).double()
    mean = load_E.mean()
    return {"load_imbalance": float(load_E.max() / mean),
            "load_cv": float(load_E.std(unbiased=False) / mean)}


def routing_metrics(old_LNK: Sequence[torch.Tensor], new_LNK: Sequence[torch.Tensor],
                    num_experts: int, valid_N: torch.Tensor | None = None) -> dict[str, float]:
    """Per-layer `moe/{flip_rate,any_flip,jaccard,load_imbalance}/layer_XX` (load of the new
    routing) plus their layer `mean`, and `moe/flip_rate/max`."""
    if len(old_LNK) != len(new_LNK):
        raise ValueError(f"old_LNK has {len(old_LNK)} layers but new_LNK has {len(new_LNK)}")
    if len(old_LNK) == 0:
        raise ValueError("routing_metrics needs at least one layer")
    out, per_key = {}, {"flip_rate": [], "any_flip": [], "jaccard": [], "load_imbalance": []}
    for layer, (old_NK, new_NK) in enumerate(zip(old_LNK, new_LNK)):
        stats = flip_stats(old_NK, new_NK, num_experts, valid_N)
        stats["load_imbalance"] = load_stats(new_NK, num_experts, valid_N)["load_imbalance"]
        for key, values in per_key.items():
            out[f"moe/{key}/layer_{layer:02d}"] = stats[key]
            values.append(stats[key])
    for key, values in per_key.items():
        out[f"moe/{key}/mean"] = sum(values) / len(values)
    out["moe/flip_rate/max"] = max(per_key["flip_rate"])
    return out
