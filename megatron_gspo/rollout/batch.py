"""A rollout batch: G sampled responses per prompt with their rewards, in the trainer's layout.

Shape legend: B sequences (prompts x G, group-major), T tokens.

Sequences are laid out as [left padding][<bos> prompt][response ... <eos>][right padding]; every
row's prompt ends in the same column. `valid_BT` marks real tokens, `response_BT` the response
tokens (including <eos>) that carry the policy loss.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class RolloutBatch:
    """One rollout batch; `select(rows)` gives a minibatch."""

    tokens_BT: torch.Tensor
    valid_BT: torch.Tensor
    response_BT: torch.Tensor
    sampler_logp_BT: torch.Tensor
    rewards_B: torch.Tensor
    group_B: torch.Tensor
    """Index of the prompt each row answers (rows of a group are contiguous)."""
    completions: list
    examples: list
    routing: object = None
    """Rollout-time routing (`moe.routing.replay.RoutingReplayCache`) when recorded for R3, else None."""
    truncated_B: torch.Tensor | None = None
    """True where the response hit max_new_tokens without a stop token."""
    reward_status_B: torch.Tensor | None = None
    """`rewards.compute_rewards` status per row: 0 ok, 1 the reward raised, 2 it timed out."""
    version_B: torch.Tensor | None = None
    """The version of the weights that sampled each row (the rollout batches they had trained
    on) where rows are sampled beside the trainer (`rollout.max_staleness`, `rollout.overlap`);
    None: the trainer's weights of the batch's own iteration."""

    def __len__(self) -> int:
        return self.tokens_BT.shape[0]

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                out[f.name] = value[rows]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows.tolist()]
            else:  # the routing cache, or None
                out[f.name] = None if value is None else value.select(rows)
        return RolloutBatch(**out)

    @property
    def response_lengths_B(self) -> torch.Tensor:
        return self.response_BT.sum(1)

    @property
    def response_start(self) -> int:
        """The first column holding a response token of any row (>= 1): where log-probs must
        begin. One sampling round left-pads its prompts, so its responses share this column;
        dynamic sampling's concatenated rounds may start later in some rows, which then get
        (unused) log-probs of a few prompt columns too."""
        cols = self.response_BT.any(0).nonzero()
        return max(1, int(cols[0])) if len(cols) else 1


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids [B, P], left-padded to the longest, and their valid mask: the prompt columns
    of a sampled batch (`megatron_gspo.rollout.sampler.Samples`)."""
    if not prompts or not all(prompts):
        raise ValueError("left_pad: every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid_BP = torch.zeros(len(prompts), P, dtype=torch.bool)
    for b, ids in enumerate(prompts):
        tokens_BP[b, P - len(ids):] = torch.tensor(ids)
        valid_BP[b, P - len(ids):] = True
    return tokens_BP, valid_BP
