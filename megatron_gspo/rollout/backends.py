"""`rollout.backend` -> a `Sampler`: the built-in backends registered, and the one lookup.

Importing this module registers "lean" and "megatron" (`rollout.decoders`), "megatron_engine"
(`rollout.engine`) and "vllm" (`rollout.vllm`); a backend defined elsewhere registers itself with
`megatron_gspo.rollout.sampler.register_sampler` and is found by the same name.
"""

from __future__ import annotations

from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout import decoders, engine, vllm  # noqa: F401  (they register backends)
from megatron_gspo.rollout.sampler import SAMPLERS, Sampler


def check_backend(cfg) -> None:
    """ConfigError naming `rollout.backend` unless a sampler of that name is registered and
    can run here (a factory's optional `unavailable()` says why not in one line)."""
    name = cfg.rollout.sampler
    if name not in SAMPLERS:
        key = "rollout.backend" if cfg.rollout.backend == name else "rollout.decoder"
        raise ConfigError(f"{key}={name!r}: no such sampler; registered: {sorted(SAMPLERS)}")
    why = getattr(SAMPLERS[name], "unavailable", lambda: None)()
    if why:
        raise ConfigError(why)


def build_sampler(cfg, policy, tokenizer) -> Sampler:
    """The run's sampler (`cfg.rollout.sampler`) over `policy`."""
    check_backend(cfg)
    return SAMPLERS[cfg.rollout.sampler](policy, tokenizer, cfg)
