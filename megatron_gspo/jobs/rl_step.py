"""The forwards and backwards of one RL optimizer step, in microbatches (gradient accumulation).

Shape legend: B sequences of the minibatch (b of a microbatch), T tokens.

`accumulate(...)` runs the minibatch's rows in as few microbatches as keep each forward within
`train.micro_max_tokens` tokens (`megatron_gspo.algo.packing.microbatches`: packed, real tokens
binned first-fit decreasing; padded, consecutive rows x padded width; a row over the budget
alone; 0 or a budget the whole minibatch fits: one forward, the step as it always ran). Each
microbatch's loss is the loss's mean over its own sequences, weighted by its share b / B of the
minibatch's rows, and backpropagated before the next microbatch's forward, so megatron's grad
buffer sums to the gradient of the minibatch's mean over sequences and only one microbatch's
activations are alive at a time. Every loss here (gspo, gspo_token, grpo and the KL) is a mean
over sequences of a per-sequence term (docs/pitfalls.md#sequence-aggregation), so the update
equals the one-forward update to float rounding, packed or padded; the loss metrics are
computed once over the whole minibatch (no grad), so they are the one-forward ones too.

Per microbatch, the contexts a forward runs under follow its rows: the flip measurement's
recording (`StepFlips.forward`), Routing Replay of the microbatch's rows of the cache (with its
replayed-vs-used count summed over microbatches), and the router noise, drawn from the step's
one generator (the draws continue over the microbatches, so they are other draws than one
forward's). A NaN in a microbatch's log-probs or a non-finite microbatch loss ends the step on
every rank (one collective per microbatch): the optimizer skips it, as with one forward. The
step also counts the positions its forwards ran (`MoEPolicy.positions`) against the real tokens
among them: `train/pad_frac`, and `train/microbatches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.algo.packing import microbatches
from megatron_gspo.dist import all_ranks
from megatron_gspo.run import seeds
from moe.routing.replay import replay_routing, restore_order
from moe.routing.noise import router_noise


@dataclass
class Accumulated:
    """What the step's forwards leave for its metrics and its optimizer step."""

    logp_BT: torch.Tensor
    """Log-probs of the minibatch (detached; NaN rows of microbatches after one that ended the
    step)."""
    entropy_BT: torch.Tensor
    """Entropy per position (no grad), likewise."""
    metrics: dict
    """The loss's metrics over the whole minibatch ({"policy/loss": nan} when not finite),
    with `train/pad_frac` and `train/microbatches`."""
    finite: bool
    """Every microbatch's log-probs and loss were finite on every rank: the optimizer may
    step."""
    replayed: dict
    """Routes replayed vs used, summed over the microbatches
    (`moe.routing.replay.replay_routing`)."""


def accumulate(policy, mb, cfg, loss_fn, tis: dict, record, noise: tuple) -> Accumulated:
    """Forwards and backwards of minibatch `mb` (`megatron_gspo.jobs.rl.Minibatch`) into the
    policy's grad buffer. `tis`: the loss's correction inputs for `mb`'s rows; `record(rows)`:
    the context each forward runs in first (`StepFlips.forward`); `noise`: (std, generator) of
    the router noise, (0.0, None) for none."""
    chunks = microbatches(mb.valid_BT, cfg.train.micro_max_tokens, policy.pack)
    n, B, start = len(chunks), len(mb), mb.rollout.response_start
    replayed, finite, metrics = {}, True, {}
    logp_BT = torch.full(mb.tokens_BT.shape, float("nan"))
    entropy_BT = logp_BT.clone()
    forwarded = real = 0
    for rows in chunks:
        part, part_tis = mb, tis
        if n > 1:
            index = torch.arange(B)[rows]
            part, part_tis = mb.select(index), {k: v[rows] for k, v in tis.items()}
        forwarded += policy.positions(part.valid_BT)
        real += int(part.valid_BT.sum())
        with record(rows), replay_routing(policy, part.replay, replayed), \
                router_noise(policy, *noise):
            part_logp_BT, part_entropy_BT = policy.token_logprobs(
                part.tokens_BT, part.valid_BT, cfg.rollout.temperature, with_entropy=True,
                start=start)
            nan = part_logp_BT.detach()[part.response_BT.to(part_logp_BT.device).bool()
                                        ].isnan().any()
            if all_ranks(not bool(nan)):
                loss, metrics = loss_fn(part_logp_BT, part.old_logp_BT, part.adv_B,
                                        part.response_BT.float(), cfg.loss,
                                        ref_logp_BT=part.ref_logp_BT, **part_tis)
            else:  # NaN weights / activations: a skipped step (guard), not the loss's ValueError
                loss, metrics = part_logp_BT.new_tensor(float("nan")), \
                    {"policy/loss": float("nan")}
        logp_BT, entropy_BT = logp_BT.to(part_logp_BT.device), entropy_BT.to(part_logp_BT.device)
        logp_BT[rows], entropy_BT[rows] = part_logp_BT.detach(), part_entropy_BT
        # skip on every rank or none (docs/pitfalls.md#collectives)
        finite = all_ranks(bool(torch.isfinite(loss)))
        if not finite:
            break
        policy.backward(loss if n == 1 else loss * len(part) / B)
    if n > 1:
        metrics = _whole_metrics(mb, cfg, loss_fn, tis, logp_BT) if finite \
            else {"policy/loss": float("nan")}
    metrics = {**metrics, "train/pad_frac": 1 - real / forwarded, "train/microbatches": n}
    return Accumulated(logp_BT, entropy_BT, metrics, finite, replayed)


@torch.no_grad()
def _whole_metrics(mb, cfg, loss_fn, tis: dict, logp_BT: torch.Tensor) -> dict:
    """The loss's metrics over the whole minibatch, from the microbatches' log-probs."""
    return loss_fn(logp_BT, mb.old_logp_BT, mb.adv_B, mb.response_BT.float(), cfg.loss,
                   ref_logp_BT=mb.ref_logp_BT, **tis)[1]


def noise_inputs(cfg, mb, opt_step: int, device) -> tuple:
    """(std, generator) of `train.router_noise_std` for the loss's forwards of one optimizer
    step: one seeded generator per step (resumable); (0.0, None) when off or replayed."""
    std = cfg.train.router_noise_std
    if not std or mb.replay is not None:
        return 0.0, None
    return std, seeds.router_noise(cfg.seed, opt_step, device)


def forward_logprobs(policy, tokens_BT: torch.Tensor, valid_BT: torch.Tensor, chunks: list,
                     temperature: float, start: int, routing=None) -> torch.Tensor:
    """`policy`'s log-probs of a batch ([B, T]), one forward per row selector of `chunks`
    (`algo.packing.microbatches`: packed bins or padded slices), replaying `routing` (a
    `RoutingReplayCache` of the whole batch) where given, back in batch order."""
    out = []
    for rows in chunks:
        with replay_routing(policy, None if routing is None else routing.select(rows)):
            out.append(policy.token_logprobs(tokens_BT[rows], valid_BT[rows], temperature,
                                             start=start))
    logp_BT, back = torch.cat(out), restore_order(chunks, len(tokens_BT))
    return logp_BT if back is None else logp_BT[back.to(logp_BT.device)]
