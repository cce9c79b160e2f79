"""Test samplers: the lean decoder with each sampled batch passed through an edit (a shifted
routing, shifted log-probs, a spy), registered under a name (`rollout.backend=NAME`)."""

from megatron_gspo.rollout.backends import BACKENDS
from megatron_gspo.rollout.decoders import DecoderSampler
from megatron_gspo.rollout.sampler import SAMPLERS, register_sampler


class Edited:
    """`inner`'s samples after `edit(samples, prompts, params)` (which changes them in place)."""

    def __init__(self, inner, edit):
        self.inner, self.edit = inner, edit

    def sample(self, prompts, params, generator=None):
        s = self.inner.sample(prompts, params, generator)
        self.edit(s, prompts, params)
        return s


def backend(name: str, edit) -> str:
    """Register the lean decoder with `edit` applied to each batch as `name` (with the lean
    backend's capabilities), replacing the one an earlier test registered under `name`;
    returns the override that selects it."""
    SAMPLERS.pop(name, None)  # a registry refuses a name it holds
    @register_sampler(name, BACKENDS["lean"])
    def factory(policy, tokenizer, cfg):
        inner = DecoderSampler(policy, tokenizer, "lean", cfg.rollout.decoders.kv_cache,
                               cfg.rollout.decoders.sampler_dtype)
        return Edited(inner, edit)
    return f"rollout.backend={name}"


def shift_routing(s, prompts=None, params=None) -> None:
    """Another valid routing: every id + 1 mod E (still K distinct experts per token)."""
    if s.routing is not None:
        r = s.routing
        r.ids_NLK = ((r.ids_NLK.long() + 1) % r.num_experts).to(r.ids_NLK.dtype)
