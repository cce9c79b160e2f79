"""The "megatron_engine" sampler: megatron-core's dynamic inference engine on a GPU.

Shape legend: B sequences, T columns.

`moe.inference.engine.EngineSampler` runs the policy's own GPTModel (no weight copy, nothing to push: the
optimizer updates the weights the engine reads, in place, so its CUDA graphs stay valid) with a
paged KV cache, in-flight batching and, with `rollout.megatron_engine.cuda_graphs`, its decode
steps replayed as CUDA graphs. It records every MoE layer's top-k per token, which R3 replays: the engine's
routing, not a recompute. One engine per rank (data parallelism); expert parallelism needs
megatron's inference coordinator and is refused in one line, as are CPUs and megatron-core
older than 0.19 (`moe.inference.engine.unavailable`).

Departures from the decoder samplers: the engine draws with its own generator (seeded from the
run's), so its tokens are not the decoders' for a seed; one stop id ends a request inside the
engine (the tokenizer's eos), other stop ids cut the response afterwards; the log-probs are the
engine's "processed" ones: after temperature and, with top_p < 1, renormalised over the nucleus
(the decoders report them before top-p).
"""

from __future__ import annotations

import torch

from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.sampler import Samples, SamplingParams
from moe.inference import engine as moe_engine


class MegatronEngineSampler:
    """`Sampler` over `moe.inference.engine.EngineSampler` (see the module docstring)."""

    def __init__(self, policy, tokenizer, max_requests: int, cuda_graphs: bool):
        why = moe_engine.unavailable()
        if why:
            raise ConfigError(why)
        if policy.layout.ep > 1 or policy.layout.tp > 1:
            raise ConfigError(f"rollout.backend=megatron_engine runs one engine per rank: "
                              f"model.tp={policy.layout.tp} model.ep={policy.layout.ep} needs "
                              "megatron's inference coordinator (not wired); use "
                              "rollout.backend=lean")
        self.policy, self.tokenizer = policy, tokenizer
        try:
            self.engine = moe_engine.EngineSampler(
                policy, max_requests=-(-max_requests // 4) * 4,
                max_seq_len=policy.preset.max_seq_len, cuda_graphs=cuda_graphs,
                eod=tokenizer.eos_id)
        except ValueError as e:  # a model the engine cannot serve: one line naming why
            raise ConfigError(str(e)) from None

    def sample(self, prompts: list[list[int]], params: SamplingParams,
               generator: torch.Generator | None = None) -> Samples:
        if generator is not None:  # the engine's draws: seeded from the run's stream
            torch.cuda.manual_seed(int(torch.randint(2 ** 63 - 1, (1,), generator=generator)))
        reqs = self.engine.generate(
            prompts, max_new_tokens=params.max_new_tokens,
            temperature=1.0 if params.greedy else params.temperature,
            top_p=0.0 if params.greedy or params.top_p >= 1 else params.top_p,
            top_k=1 if params.greedy else 0, termination_id=self.tokenizer.eos_id)
        reqs = [moe_engine.cut_at_stop(r, self.tokenizer.stop_ids) for r in reqs]
        tokens_BT, valid_BT, response_BT, logp_BT, routing = moe_engine.to_batch(
            reqs, self.tokenizer.pad_id, self.policy.preset.num_experts)
        return Samples(tokens_BT, valid_BT, response_BT, logp_BT,
                       routing if params.record_routing else None)


def factory(policy, tokenizer, cfg) -> MegatronEngineSampler:
    """Backend "megatron_engine"'s factory (registered in `megatron_gspo.rollout.backends`)."""
    rows = cfg.rollout.prompts_per_batch * cfg.rollout.group_size
    return MegatronEngineSampler(policy, tokenizer, max_requests=max(rows, 4),
                                 cuda_graphs=cfg.rollout.megatron_engine.cuda_graphs)


factory.unavailable = moe_engine.unavailable  # checked before any set-up
