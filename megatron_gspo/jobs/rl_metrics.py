"""RL's metrics of one rollout batch and of one optimizer step (GSPO paper, sec. 5: the reward,
response length, clipping and entropy curves; here also the sampler-vs-trainer log-prob gap
Routing Replay is about, sec. 5.3), computed from tensors the trainer already has: no forward,
except the route sensitivity's where `train.route_sensitivity_every` asks for it and the
routing log-ratio's (`routing_log_ratio`, one no-grad forward per measured step).

Shape legend: B sequences, T tokens.
"""

from __future__ import annotations

import torch

from megatron_gspo.algo.packing import microbatches
from megatron_gspo.algo.sensitivity import route_sensitivity, sensitivity_metrics
from megatron_gspo.dist import sum_over_ranks
from megatron_gspo.jobs.rl_step import forward_logprobs
from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.run import seeds
from megatron_gspo.run.metrics import Timer

GRPO_CLIP = 0.2
"""The |token log-ratio| `policy/routing_log_ratio/past_clip` counts beyond: GRPO's clip
(eps_low of the paper's sec. 5.1), whatever the run's loss, so that arms compare."""


def rollout_metrics(batch: RolloutBatch, recompute_logp_BT: torch.Tensor,
                    mismatch: str | None = None) -> dict:
    """Reward and length statistics, and `rollout/logprob_mismatch/{mean,max}`: |sampler's
    log-prob - the trainer's recompute| over response tokens. With `mismatch` (a key prefix),
    only that mismatch, under the prefix."""
    resp_BT = batch.response_BT
    lengths_B = batch.response_lengths_B.float()
    diff_BT = (batch.sampler_logp_BT - recompute_logp_BT.cpu()).abs() * resp_BT
    if mismatch is not None:
        return {f"{mismatch}mean": float(diff_BT.sum() / resp_BT.sum()),
                f"{mismatch}max": float(diff_BT.max())}
    return {"reward/mean": float(batch.rewards_B.mean()),
            "reward/std": float(batch.rewards_B.std(unbiased=False)),
            "reward/accuracy": float((batch.rewards_B >= 1.0).float().mean()),
            "response/length/mean": float(lengths_B.mean()),
            "response/length/max": float(lengths_B.max()),
            "rollout/logprob_mismatch/mean": float(diff_BT.sum() / resp_BT.sum()),
            "rollout/logprob_mismatch/max": float(diff_BT.max())}


def response_metrics(mb, logp_BT: torch.Tensor, entropy_BT: torch.Tensor) -> dict:
    """Token-mean entropy and |log pi - log pi_old| over the response tokens. On a rollout
    batch's first minibatch pi == pi_old, so a log-ratio there comes from the router noise (or
    the sampler, with `rollout.use_sampler_logprobs`)."""
    resp_BT = mb.response_BT.to(entropy_BT.device)
    abs_lr_BT = (logp_BT.detach() - mb.old_logp_BT.to(logp_BT.device)).abs() * resp_BT
    return {"policy/entropy": float((entropy_BT.detach() * resp_BT).sum() / resp_BT.sum()),
            "policy/log_ratio/abs_mean": float(abs_lr_BT.sum() / resp_BT.sum())}


@torch.no_grad()
def routing_log_ratio(policy, mb, logp_BT: torch.Tensor, cfg) -> dict:
    """The routing share of the loss's token log-ratio on minibatch `mb`, at the weights its
    loss just used (before the optimizer step): |log pi_theta(y) as the loss computed it
    (`logp_BT`: its routing, live, noisy under `train.router_noise_std`, replayed under R2 / R3)
    - log pi_theta(y) with pi_old's routing replayed| over the response tokens, one no-grad
    forward (packed or padded forwards of `train.logprob_max_tokens`). `policy/routing_log_ratio/abs_mean` is its
    token mean, `.../past_clip` the share of tokens beyond `GRPO_CLIP`. The token log-ratio
    log pi_theta - log pi_old splits into this term and the one the weights make under one
    routing: this is what Routing Replay (R2) removes (GSPO paper, sec. 5.3), and under R2 / R3
    it is 0, the loss having replayed pi_old's routing (under R3 pi_old's is the sampler's)."""
    chunks = microbatches(mb.valid_BT, cfg.train.logprob_max_tokens, policy.pack)
    replayed_BT = forward_logprobs(policy, mb.tokens_BT, mb.valid_BT, chunks,
                                   cfg.rollout.temperature, mb.rollout.response_start,
                                   mb.old_routing)
    resp_BT = mb.response_BT.to(replayed_BT.device).bool()
    diff_N = (logp_BT.detach().to(replayed_BT.device) - replayed_BT)[resp_BT].abs().double()
    return {"policy/routing_log_ratio/abs_mean": float(diff_N.mean()),
            "policy/routing_log_ratio/past_clip": float((diff_N > GRPO_CLIP).double().mean())}


def throughput(batch: RolloutBatch, timer: Timer) -> dict:
    """Response tokens per second of sampling and valid tokens per second of training; the
    share of the batch's sampling the trainer did not wait for (0 when it sampled the batch
    itself: it waits for all of it)."""
    t = timer.as_metrics()
    gen_tokens = float(batch.response_BT.sum())
    train_tokens = float(batch.valid_BT.sum())
    rollout_s = max(t.get("time/rollout", 0.0), 1e-9)
    return {"perf/rollout_tokens_per_s": gen_tokens / rollout_s,
            "perf/train_tokens_per_s": train_tokens / max(t.get("time/train", 0.0), 1e-9),
            "perf/overlap_frac": min(1.0, max(0.0, 1 - t.get("time/rollout_wait", 0.0)
                                                / rollout_s))}


def route_sensitivity_row(cfg, policy, batch: RolloutBatch, iteration: int, dp_rank: int,
                          timer: Timer) -> dict:
    """`moe/route_sensitivity/...` of rollout batch `iteration` at the policy's weights now,
    every `train.route_sensitivity_every` rollout batches ({} otherwise), timed as
    `time/sensitivity` (L + 1 no-grad forwards, `megatron_gspo.algo.sensitivity`)."""
    every = cfg.train.route_sensitivity_every
    if not every or iteration % every:
        return {}
    with timer("sensitivity"):
        per_layer = route_sensitivity(policy, batch.tokens_BT, batch.valid_BT,
                                      batch.response_BT, cfg.train.route_sensitivity_fraction,
                                      seeds.route_sensitivity(cfg.seed, iteration, dp_rank),
                                      cfg.rollout.temperature)
    return sensitivity_metrics(per_layer)


def replay_diff(check: dict) -> float:
    """The fraction of routes (token, layer) the loss's forward used that were not the replay
    cache's, over all ranks (`moe.routing.replay.watch_replayed`; one collective)."""
    counts = torch.tensor([float(check.get("differ", 0)), float(check.get("routes", 0))],
                          dtype=torch.float64)
    differ, routes = sum_over_ranks(counts).tolist()
    return differ / routes if routes else 0.0
