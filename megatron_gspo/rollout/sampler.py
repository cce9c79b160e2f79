"""The sampler seam: one protocol between the RL loop and whatever generates the rollouts.

Shape legend: B sequences, T columns (prompt then response), L MoE layers, K top-k.

A `Sampler` takes prompt token ids (chat template and <bos> already applied) and sampling
parameters, and returns `Samples` in the trainer's layout: prompts left-padded so that every
row's prompt ends in the same column, responses after it (with their stop token), right
padding; the sampler's own log-probs of each response token (under the temperature-scaled
distribution the token was drawn from, before top-p, as vLLM reports them); and, where the
backend can record it and `record_routing` asks, every valid token's top-k experts per MoE
layer (`moe.replay.RoutingReplayCache`): the routing R3 replays (arXiv 2510.11370).

Backends register by name (`register_sampler`); `rollout.backend` picks one and
`megatron_gspo.rollout.backends.build_sampler` builds it. Built in: "lean" and "megatron" (our
KV-cache decoders in the trainer process, `rollout.decoders`), "megatron_engine"
(megatron-core's dynamic inference engine on a GPU, `rollout.engine`). A sampler keeps its own
copy of the weights in sync itself (the decoders read the policy's; an engine with a separate
copy pushes before sampling when the policy has stepped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch."""

    max_new_tokens: int
    """Response tokens at most (the stop token included)."""
    temperature: float = 1.0
    """Softmax temperature (> 0); the returned log-probs are under it."""
    top_p: float = 1.0
    """Nucleus mass (0 < top_p <= 1); the log-probs are before this filter."""
    greedy: bool = False
    """Arg-max decoding (evaluation); temperature and top_p are then ignored for the draw."""
    record_routing: bool = False
    """Return every valid token's routing (R3), where the backend can."""


@dataclass
class Samples:
    """A sampled batch in the trainer's layout (CPU tensors)."""

    tokens_BT: torch.Tensor
    valid_BT: torch.Tensor
    """Real tokens (prompt and response)."""
    response_BT: torch.Tensor
    """Response tokens, the stop token included: what carries the policy loss."""
    logp_BT: torch.Tensor
    """The sampler's log-prob of each response token (0 elsewhere)."""
    routing: object = None
    """`moe.replay.RoutingReplayCache` of every valid token, or None."""


class Sampler(Protocol):
    """Generates responses to prompts; see the module docstring for the layout."""

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        ...


SamplerFactory = Callable[..., Sampler]
"""`factory(policy, tokenizer, cfg) -> Sampler`: the run's policy (`moe.policy.MoEPolicy`),
tokenizer (`pad_id`, `stop_ids`) and config (`megatron_gspo.config.schema.RunConfig`). A factory
may carry `unavailable() -> str | None`, checked before the run sets anything up (a backend
that needs a GPU or an optional package says so in one line)."""

SAMPLERS: dict[str, SamplerFactory] = {}

ENGINES = ("megatron_engine", "vllm")
"""Backends that are inference engines: their numerics differ from the trainer's, and their
routing comes with every batch (the trainer then always logs the per-layer mismatch)."""


def register_sampler(name: str):
    """Decorator registering a sampler factory under `name` (a `rollout.backend` value)."""
    def deco(factory: SamplerFactory) -> SamplerFactory:
        SAMPLERS[name] = factory
        return factory
    return deco


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """`<bos> prompt` token ids of each text (no <bos> when the tokenizer has none): what a
    sampler takes."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [bos + tokenizer.encode(p) for p in prompts]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids [B, P], left-padded to the longest, and their valid mask."""
    if not prompts or not all(prompts):
        raise ValueError("left_pad: every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    valid_BP = torch.zeros(len(prompts), P, dtype=torch.bool)
    for b, ids in enumerate(prompts):
        tokens_BP[b, P - len(ids):] = torch.tensor(ids)
        valid_BP[b, P - len(ids):] = True
    return tokens_BP, valid_BP
