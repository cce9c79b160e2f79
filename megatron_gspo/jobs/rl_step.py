"""The forwards and backwards of one RL optimizer step, in row chunks (gradient accumulation).

Shape legend: B sequences of the minibatch (b of a chunk), T tokens.

`accumulate(...)` runs the minibatch's rows in as few consecutive chunks as keep each forward
within `train.micro_max_tokens` tokens (sequences x padded width, at least one sequence; 0 or a
budget the whole minibatch fits: one forward, the step as it always ran). Each chunk's loss is
the loss's mean over its own sequences, weighted by its share b / B of the minibatch's rows, and
backpropagated before the next chunk's forward, so megatron's grad buffer sums to the gradient
of the minibatch's mean over sequences and only one chunk's activations are alive at a time.
Every loss here (gspo, gspo_token, grpo and the KL) is a mean over sequences of a per-sequence
term, so the update equals the one-forward update to float rounding; the loss metrics are
computed once over the whole minibatch (no grad), so they are the one-forward ones too.

Per chunk, the contexts a forward runs under follow its rows: the flip measurement's recording
(`StepFlips.forward`), Routing Replay of the chunk's rows of the cache (with its
replayed-vs-used count summed over chunks), and the router noise, drawn from the step's one
generator (the draws continue over the chunks, so they are other draws than one forward's). A
NaN in a chunk's log-probs or a non-finite chunk loss ends the step on every rank (one
collective per chunk): the optimizer skips it, as with one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.dist import all_ranks, max_over_ranks
from megatron_gspo.run import seeds
from moe.routing.replay import chunk_count, replay_routing, row_chunks
from moe.routing.noise import router_noise


@dataclass
class Accumulated:
    """What the step's forwards leave for its metrics and its optimizer step."""

    logp_BT: torch.Tensor
    """Log-probs of the minibatch (detached; NaN rows after a chunk that ended the step)."""
    entropy_BT: torch.Tensor
    """Entropy per position (no grad), likewise."""
    metrics: dict
    """The loss's metrics over the whole minibatch ({"policy/loss": nan} when not finite)."""
    finite: bool
    """Every chunk's log-probs and loss were finite on every rank: the optimizer may step."""
    replayed: dict
    """Routes replayed vs used, summed over the chunks (`moe.routing.replay.replay_routing`)."""


def accumulate(policy, mb, cfg, loss_fn, tis: dict, record, noise: tuple) -> Accumulated:
    """Forwards and backwards of minibatch `mb` (`megatron_gspo.jobs.rl.Minibatch`) into the
    policy's grad buffer. `tis`: the loss's correction inputs for `mb`'s rows; `record(rows)`:
    the context each forward runs in first (`StepFlips.forward`); `noise`: (std, generator) of
    the router noise, (0.0, None) for none."""
    n = max_over_ranks(chunk_count(*mb.tokens_BT.shape, cfg.train.micro_max_tokens))
    chunks = row_chunks(len(mb), n)
    start, replayed, finite = mb.rollout.response_start, {}, True
    logps, entropies, metrics = [], [], {}
    for rows in chunks:
        part, part_tis = mb, tis
        if n > 1:
            index = torch.arange(len(mb))[rows]
            part, part_tis = mb.select(index), {k: v[rows] for k, v in tis.items()}
        with record(rows), replay_routing(policy, part.replay, replayed), \
                router_noise(policy, *noise):
            logp_BT, entropy_BT = policy.token_logprobs(
                part.tokens_BT, part.valid_BT, cfg.rollout.temperature, with_entropy=True,
                start=start)
            nan = logp_BT.detach()[part.response_BT.to(logp_BT.device).bool()].isnan().any()
            if all_ranks(not bool(nan)):
                loss, metrics = loss_fn(logp_BT, part.old_logp_BT, part.adv_B,
                                        part.response_BT.float(), cfg.loss,
                                        ref_logp_BT=part.ref_logp_BT, **part_tis)
            else:  # NaN weights / activations: a skipped step (guard), not the loss's ValueError
                loss, metrics = logp_BT.new_tensor(float("nan")), {"policy/loss": float("nan")}
        logps.append(logp_BT.detach())
        entropies.append(entropy_BT)
        # skip on every rank or none (docs/pitfalls.md#collectives)
        finite = all_ranks(bool(torch.isfinite(loss)))
        if not finite:
            break
        policy.backward(loss if n == 1 else loss * (rows.stop - rows.start) / len(mb))
    logp_BT, entropy_BT = _padded(logps, len(mb)), _padded(entropies, len(mb))
    if n > 1:
        metrics = _whole_metrics(mb, cfg, loss_fn, tis, logp_BT) if finite \
            else {"policy/loss": float("nan")}
    return Accumulated(logp_BT, entropy_BT, metrics, finite, replayed)


def _padded(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The chunks' [b, T] tensors as one [B, T], NaN rows for chunks that never ran."""
    out = torch.cat(parts)
    if out.shape[0] < rows:
        out = torch.cat([out, out.new_full((rows - out.shape[0], out.shape[1]), float("nan"))])
    return out


@torch.no_grad()
def _whole_metrics(mb, cfg, loss_fn, tis: dict, logp_BT: torch.Tensor) -> dict:
    """The loss's metrics over the whole minibatch, from the chunks' log-probs."""
    return loss_fn(logp_BT, mb.old_logp_BT, mb.adv_B, mb.response_BT.float(), cfg.loss,
                   ref_logp_BT=mb.ref_logp_BT, **tis)[1]


def noise_inputs(cfg, mb, opt_step: int, device) -> tuple:
    """(std, generator) of `train.router_noise_std` for the loss's forwards of one optimizer
    step: one seeded generator per step (resumable); (0.0, None) when off or replayed."""
    std = cfg.train.router_noise_std
    if not std or mb.replay is not None:
        return 0.0, None
    return std, seeds.router_noise(cfg.seed, opt_step, device)
