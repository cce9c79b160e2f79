"""The "vllm" backend, a room of `megatron_gspo.rollout`: vLLM as the sampler, in the trainer's
process or as engine servers of its own.

- `sampler`: the backend's factory and `VLLMSampler` (weight pushes, the push guard, R3 routes);
- `engine`: an in-process `vllm.LLM` over the policy's config; `capture`: routing capture inside
  vLLM's fused-MoE layers;
- `server` (`python -m megatron_gspo.rollout.vllm.server`), `launch`, `remote`, `wire`,
  `worker`: engine server processes, how the trainer starts and drives them, their wire format
  and the weight push into their workers.

May import: the rest of `megatron_gspo.rollout` and what it may import. Nothing outside this
folder imports it: `megatron_gspo.rollout.backends` registers the backend by the path of its
factory, imported when a run builds the sampler.
"""

import importlib


def __getattr__(name: str):
    """`from megatron_gspo.rollout.vllm import factory, VLLMSampler, ...`: the names of the
    module this package was before it became a room (its `sampler`), imported on first use so
    that importing the package imports no vLLM."""
    if name.startswith("__"):  # the import system's own questions (__path__, __all__, ...)
        raise AttributeError(name)
    try:
        return getattr(importlib.import_module(f"{__name__}.sampler"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
