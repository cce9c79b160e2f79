"""DAPO's rollout filters (arXiv 2503.14476): overlong filtering and dynamic sampling.

Shape legend: B sequences = P prompts x G responses (group-major), T tokens.

Overlong filtering (DAPO sec. 3.4): a response that hit `rollout.max_new_tokens` without a stop
token (`RolloutBatch.truncated_B`) is not penalised for being cut off; its loss is masked.
Departure: here its advantage is set to 0 instead of zeroing its loss mask (the losses need at
least one unmasked token per sequence). For the clipped surrogate min(r A, clip(r) A) both give
0 and zero gradient, and, as TRL's `mask_truncated_completions` with its per-sequence mean, the
row still counts in the mean over sequences; only the KL term (loss.kl_coef > 0) still sees it.

Dynamic sampling (DAPO sec. 3.2): a group whose G rewards are all equal has zero advantages and
no gradient. Draw further rollout rounds (up to `filter.max_rounds`), keep the first P groups
with reward variance, in draw order. Departure: when the rounds run out, equal-reward groups
fill the batch instead of training on fewer prompts (DAPO's verl recipe raises or goes on with
a smaller batch), so the batch shape, minibatch split and data-parallel symmetry never change.
All ranks run the same number of rounds (an all-reduce decides), since under EP the sampler's
forwards are collective. `time/rollout` covers every round while `perf/rollout_tokens_per_s`
counts the kept rows' tokens only.

Metrics: `response/truncated_frac`, `reward/errors` (responses whose reward raised or timed out)
and `reward/timeouts` for every batch; `filter/overlong_masked` when overlong filtering is on;
`filter/zero_std_frac/{before,after}` (all groups drawn / groups kept), `filter/rounds` and
`filter/prompts_drawn` under dynamic sampling.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch

from megatron_gspo.algo.advantages import ZERO_STD_TOL
from megatron_gspo.dist import max_over_ranks
from megatron_gspo.tasks.rewards import RAISED, TIMED_OUT
from megatron_gspo.rollout.batch import RolloutBatch
from moe.routing.replay import RoutingReplayCache


def rollout_health(batch: RolloutBatch) -> dict[str, float]:
    """response/truncated_frac, reward/errors and reward/timeouts (counts) of a batch."""
    out = {}
    if batch.truncated_B is not None:
        out["response/truncated_frac"] = float(batch.truncated_B.float().mean())
    if batch.reward_status_B is not None:
        status_B = batch.reward_status_B
        out["reward/errors"] = float(((status_B == RAISED) | (status_B == TIMED_OUT)).sum())
        out["reward/timeouts"] = float((status_B == TIMED_OUT).sum())
    return out


def overlong_filter(adv_B: torch.Tensor, batch: RolloutBatch, enabled: bool,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """adv_B with truncated rows set to 0 when `enabled` (see the module docstring)."""
    if not enabled:
        return adv_B, {}
    if batch.truncated_B is None:
        raise ValueError("filter.overlong needs RolloutBatch.truncated_B (set by "
                         "rollout.generate_rollouts)")
    trunc_B = batch.truncated_B.to(adv_B.device)
    return adv_B.masked_fill(trunc_B, 0.0), {"filter/overlong_masked": float(
        trunc_B.float().mean())}


def group_has_signal(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: the group's rewards are not all equal (population std >= ZERO_STD_TOL, the
    same test as `advantages.group_advantages`)."""
    r_PG = rewards_B.detach().to(torch.float64).reshape(-1, group_size)
    return r_PG.std(dim=1, unbiased=False) >= ZERO_STD_TOL


def concat_batches(batches: list[RolloutBatch], pad_id: int, align: bool = False) -> RolloutBatch:
    """Rows of all batches; [B, T] tensors right-padded to the longest T (tokens with pad_id,
    masks False, log-probs 0). Each row stays contiguous, and positions / attention follow
    valid_BT, so the policy sees every row as before. Group ids are renumbered. Rollout-time
    routing (R3) merges when every batch has it (a cache holds valid tokens only: its rows
    keep their ids, its mask is padded like valid_BT). `align`: each batch's rows are first
    shifted right so that every batch's first response column is the same (batches sampled
    apart, e.g. on other data-parallel ranks, with other prompt columns)."""
    routing = [b.routing for b in batches]
    if any(r is not None for r in routing) and any(r is None for r in routing):
        raise ValueError("concat_batches: rollout-time routing (R3) in some batches only")
    start = max(b.response_start for b in batches)
    shifts = [start - b.response_start if align else 0 for b in batches]
    T = max(b.tokens_BT.shape[1] + d for b, d in zip(batches, shifts))
    out, offset, groups = {}, 0, []
    for b in batches:
        groups.append(b.group_B + offset)
        offset += int(b.group_B.max()) + 1 if len(b) else 0
    for f in fields(RolloutBatch):
        values = [getattr(b, f.name) for b in batches]
        if f.name == "group_B":
            out[f.name] = torch.cat(groups)
        elif f.name == "routing" and routing[0] is not None:
            out[f.name] = RoutingReplayCache.cat([r.shifted(d, T)
                                                  for r, d in zip(routing, shifts)])
        elif all(v is None for v in values):
            out[f.name] = None
        elif isinstance(values[0], list):
            out[f.name] = [x for v in values for x in v]
        elif values[0].ndim == 2:
            fill = pad_id if f.name == "tokens_BT" else 0
            out[f.name] = torch.cat([torch.nn.functional.pad(v, (d, T - d - v.shape[1]),
                                                             value=fill)
                                     for v, d in zip(values, shifts)])
        else:
            out[f.name] = torch.cat(values)
    return RolloutBatch(**out)


def trim_columns(batch: RolloutBatch) -> RolloutBatch:
    """Drop leading and trailing columns where no row has a valid token."""
    cols = batch.valid_BT.any(0).nonzero().flatten()
    lo, hi = int(cols.min()), int(cols.max()) + 1
    if lo == 0 and hi == batch.valid_BT.shape[1]:
        return batch
    out = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}
    for name, value in out.items():
        if torch.is_tensor(value) and value.ndim == 2:
            out[name] = value[:, lo:hi]
    return RolloutBatch(**out)


def dynamic_sample(draw: Callable[[], RolloutBatch], n_prompts: int, group_size: int,
                   max_rounds: int, pad_id: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Call `draw()` (a batch of `n_prompts` groups) until `n_prompts` groups with reward
    variance are found on every rank or `max_rounds` is reached; return those groups (then
    equal-reward groups as filler) as one batch, and the filter/* metrics."""
    batches, varied, flat = [], [], []
    for _ in range(max_rounds):
        batch = draw()
        k = len(batches)
        batches.append(batch)
        for p, ok in enumerate(group_has_signal(batch.rewards_B, group_size).tolist()):
            (varied if ok else flat).append((k, p))
        if not max_over_ranks(len(varied) < n_prompts):  # any rank still short
            break
    drawn = len(varied) + len(flat)
    chosen = (varied + flat)[:n_prompts]
    starts, start = [], 0
    for b in batches:
        starts.append(start)
        start += len(b)
    rows = torch.tensor([starts[k] + p * group_size + g for k, p in chosen
                         for g in range(group_size)])
    merged = batches[0] if len(batches) == 1 else concat_batches(batches, pad_id)
    out = trim_columns(merged.select(rows))
    out.group_B = torch.arange(n_prompts).repeat_interleave(group_size)
    return out, {"filter/zero_std_frac/before": len(flat) / drawn,
                 "filter/zero_std_frac/after": max(0, n_prompts - len(varied)) / n_prompts,
                 "filter/rounds": float(len(batches)),
                 "filter/prompts_drawn": float(drawn)}


def sample_rollouts(draw: Callable[[], RolloutBatch], cfg, n_prompts: int, group_size: int,
                    pad_id: int) -> tuple[RolloutBatch, dict[str, float]]:
    """One `draw()` (no filter), or `dynamic_sample` when cfg.dynamic_sampling (cfg = the
    config's FilterConfig)."""
    if not cfg.dynamic_sampling:
        return draw(), {}
    return dynamic_sample(draw, n_prompts, group_size, cfg.max_rounds, pad_id)
