"""The sampler seam: one protocol between the RL loop and whatever generates the rollouts, and
the registry of backends with what each can do.

Shape legend: B sequences, T columns (prompt then response), L MoE layers, K top-k.

A `Sampler` takes prompt token ids (chat template and <bos> already applied) and sampling
parameters, and returns `Samples` in the trainer's layout: prompts left-padded so that every
row's prompt ends in the same column (`megatron_gspo.rollout.batch.left_pad`), responses after
it (with their stop token), right padding; the sampler's own log-probs of each response token
(under the temperature-scaled distribution the token was drawn from, before top-p, as vLLM
reports them); and, where the backend can record it and `record_routing` asks, every valid
token's top-k experts per MoE layer (`moe.routing.replay.RoutingReplayCache`): the routing R3 replays
(arXiv 2510.11370).

Backends register by name with their capabilities (`register_backend(name, caps=Backend(...))`,
formerly `register_sampler`);
`rollout.backend` picks one, `megatron_gspo.rollout.backends` checks a config against its
capabilities and builds it, and the trainer, the run's set-up and `megatron-gspo plan` read the
capabilities, never a backend's name. The built-in backends are declared in
`megatron_gspo.rollout.backends`. A sampler keeps its own copy of the weights in sync itself
(the decoders read the policy's; an engine with a separate copy pushes before sampling when the
policy has stepped). A backend that can sample beside the trainer (`rollout.max_staleness`,
`Backend.beside`) gives a sampler of weights the trainer publishes (`rollout.overlap.Beside`).
No torch at import: the plan reads this registry in a process without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from megatron_gspo.config.parts import register_settings
from moe.platform.checks import refuse_duplicate

if TYPE_CHECKING:  # annotations only: the plan imports this registry without torch
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
    """`moe.routing.replay.RoutingReplayCache` of every valid token, or None."""


class Sampler(Protocol):
    """Generates responses to prompts; see the module docstring for the layout."""

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        ...


SamplerFactory = Callable[..., Sampler]
"""`factory(policy, tokenizer, cfg) -> Sampler`: the run's policy (`moe.model.policy.MoEPolicy`),
tokenizer (`pad_id`, `stop_ids`) and config (`megatron_gspo.config.schema.RunConfig`). A factory
may carry `unavailable() -> str | None`, checked before the run sets anything up (a backend
that needs a GPU or an optional package says so in one line)."""


def _no(cfg) -> bool:
    return False


def _fine(cfg) -> None:
    return None


def _nothing_counted(preset, cfg, rows: int, T: int) -> tuple[list, bool]:
    return [], False


def _no_figure(cfg) -> None:
    return None


@dataclass(frozen=True)
class Backend:
    """What a sampler backend is and can do, declared where it registers. The defaults describe
    a sampler in the trainer process that records no routing and needs nothing more; each hook
    takes the run's config (`megatron_gspo.config.schema.RunConfig`)."""

    engine: bool = False
    """An inference engine: its numerics differ from the trainer's and its routing comes with
    every batch, so the trainer records it (one rollout round) and logs the per-layer
    sampler-trainer mismatch."""
    records_routing: Callable[[Any], bool] = _no
    """`records_routing(cfg)`: whether it can record the routing it sampled with under this
    config (what R3 replays, and what the mismatch metrics compare)."""
    mismatched: Callable[[Any], bool] = _no
    """`mismatched(cfg)`: whether, not being an engine, its routing may still differ from the
    trainer's under this config (another precision, noisy routers): the trainer then records
    it where it can and logs the mismatch."""
    cuda_graphs: Callable[[Any], bool] = _no
    """`cuda_graphs(cfg)`: whether the policy is built with megatron's inference CUDA graphs for
    it (and the parallel state with their RNG tracker)."""
    beside: Callable[[Any], bool] = _no
    """`beside(cfg)`: whether it can sample beside the trainer (`rollout.max_staleness` > 0): its
    sampler's `beside(make_policy)` gives a sampler of weights of its own, which the trainer
    publishes between updates (`megatron_gspo.rollout.overlap.Beside`)."""
    needs_cuda: bool = False
    """Runs on a CUDA GPU only: refused in one line where none is visible."""
    settings: Optional[str | type] = None
    """Its config section (dotted, e.g. "rollout.vllm": a built-in section), or its own settings:
    a frozen dataclass (every field with a docstring; `megatron_gspo.config.parts`), which
    `register_backend` registers as the section `rollout.<name>` (read with
    `megatron_gspo.config.parts.settings_of(cfg.rollout)`), or None."""
    own_keys: tuple = ()
    """Dotted keys only the backends declaring them read: set away from their default while
    another backend runs, they are refused in one line (a knob that would do nothing)."""
    check: Callable[[Any], None] = _fine
    """`check(cfg)`: its own checks of a config; a one-line ConfigError naming the keys."""
    plan_memory: Callable[..., tuple[list, bool]] = _nothing_counted
    """`plan_memory(preset, cfg, rows, T) -> (items, whole_step)`: the per-GPU memory
    `megatron-gspo plan` counts for its rollouts (`moe.model.presets.MoEPreset` with the run's padded
    vocabulary, calls of `rows` sequences of T positions), [(label, bytes)], and whether it stays
    for the whole step (else only during the rollout phase)."""
    measured: Callable[[Any], Optional[str]] = _no_figure
    """`measured(cfg)`: the key of its measured decode speed in
    `megatron_gspo.jobs.plan_time.DECODE`, or None (the plan then says whose stands in)."""


SAMPLERS: dict[str, SamplerFactory | str] = {}
"""name -> its factory, or the "module:attribute" path of one, imported when a run builds it."""
BACKENDS: dict[str, Backend] = {}
"""name -> its capabilities."""


def register_backend(name: str, caps: Backend | None = None, factory: str | None = None):
    """Register backend `name` (a `rollout.backend` value) with its capabilities `caps`
    (default `Backend()`; its `settings` a class: registered as the backend's own, section
    `rollout.<name>`): as a decorator of its factory, or with `factory="module:attribute"`,
    imported only when a run builds the sampler (so reading `caps` imports no torch). A name
    already registered (a built-in one too) is refused naming both definitions."""
    def deco(f):
        if name in SAMPLERS:
            refuse_duplicate("sampler backend", name, SAMPLERS[name], f)
        own = caps or Backend()
        if isinstance(own.settings, type):  # its own settings: the section rollout.<name>
            register_settings("backend", name, own.settings)
            own = dataclasses.replace(own, settings=f"rollout.{name}")
        SAMPLERS[name], BACKENDS[name] = f, own
        return f
    return deco if factory is None else deco(factory)


register_sampler = register_backend
"""The older name of `register_backend` (still importable)."""


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """`<bos> prompt` token ids of each text (no <bos> when the tokenizer has none): what a
    sampler takes."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [bos + tokenizer.encode(p) for p in prompts]
