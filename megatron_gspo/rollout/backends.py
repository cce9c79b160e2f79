"""`rollout.backend` -> a `Sampler`: the built-in backends declared, a config checked against
its backend's capabilities, and the one lookup.

The built-in backends register here with their capabilities (`sampler.Backend`) and the path
of their factory, imported when a run builds the sampler: "lean" and "megatron" (our KV-cache
decoders in the trainer process, `rollout.decoders`), "megatron_engine" (megatron-core's
dynamic inference engine on a GPU, `rollout.engine`) and "vllm" (`rollout.vllm`). So the
trainer, the run's set-up and `megatron-gspo plan` ask a backend what it can do without
importing it (the plan runs without torch). A backend defined elsewhere registers itself with
`megatron_gspo.rollout.sampler.register_backend` and is found by the same name.
"""

from __future__ import annotations

import functools
import importlib

from megatron_gspo.config.schema import COMMAND_LINE, RunConfig, value_at
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.sampler import BACKENDS, SAMPLERS, Backend, Sampler, register_backend
from moe.model import memory as mem

ENGINE_BUFFER_GIB = 4.0  # megatron_engine's KV buffer (moe.inference.engine's buffer_size_gb default)


def _always(cfg) -> bool:
    return True


# ----------------------------------------------------------------------------- our decoders


def _decoders_record(cfg) -> bool:
    """The KV-cache decoder records routing; the recomputing one (no KV cache, or sequence
    parallelism, which megatron-core requires for MoE with TP > 1) cannot."""
    return cfg.rollout.decoders.kv_cache and not cfg.model.sequence_parallel


def _decoders_mismatched(cfg) -> bool:
    d = cfg.rollout.decoders
    return d.sampler_dtype != "same" or d.router_noise_std > 0


def _decoders_check(cfg) -> None:
    if cfg.train.routing_replay == "r3" and not _decoders_record(cfg):
        raise ConfigError(
            "train.routing_replay=r3 records routing through the KV-cache sampler: it needs "
            f"rollout.decoders.kv_cache=true (got {cfg.rollout.decoders.kv_cache}) and "
            f"model.sequence_parallel=false (got {cfg.model.sequence_parallel})")


def _rows(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def _decoders_memory(q, cfg, rows: int, T: int, lean: bool) -> tuple[list, bool]:
    """The KV cache (or a recomputed forward) of one call's rows, and the expert weights the
    decoder stacks: the lean decoder's own MoE path keeps every layer's stacked at TP = EP = 1.
    Sampling beside the trainer (`rollout.max_staleness`), a weight copy too, and all of it for
    the whole step (the sampler runs while the trainer trains)."""
    m, a = cfg.model, mem.ITEMSIZE[cfg.model.dtype]
    if _decoders_record(cfg):
        out = [(f"KV cache ({cfg.rollout.backend}: {_rows(rows)} x {T})",
                mem.kv_cache_bytes(q, rows, T, a, m.tp))]
    else:  # full recompute each step: one no-grad forward of the call's rows
        out = [(f"recomputed forward ({_rows(rows)} x {T}, no KV cache)",
                mem.forward_memory(q, rows, T, 1, a, m.tp, m.ep, m.sequence_parallel))]
    stack = mem.expert_stack_bytes(q, m.ep, a)
    if lean and m.tp == 1 and m.ep == 1:
        out.append(("stacked expert weights (lean decoder, for the rollout)",
                    q.num_layers * stack))
    else:  # megatron's MoE layer stacks one layer's experts per forward
        out.append(("one layer's expert weights stacked per forward", stack))
    if cfg.rollout.max_staleness:
        out.append(("the sampler's weight copy (rollout.max_staleness)",
                    mem.params_per_rank(q, m.tp, m.ep).total * a))
    return out, bool(cfg.rollout.max_staleness)


def _decoders(name: str) -> Backend:
    return Backend(records_routing=_decoders_record, mismatched=_decoders_mismatched,
                   beside=_always,  # a copy of the weights, sampled in a thread
                   settings="rollout.decoders", own_keys=("rollout.decoders.router_noise_std",),
                   check=_decoders_check,
                   plan_memory=functools.partial(_decoders_memory, lean=name == "lean"),
                   measured=lambda cfg: name)


register_backend("lean", _decoders("lean"), factory="megatron_gspo.rollout.decoders:lean_sampler")
register_backend("megatron", _decoders("megatron"),
                 factory="megatron_gspo.rollout.decoders:megatron_sampler")


# ----------------------------------------------------------------------------- the engines


def _graphs(cfg) -> bool:
    return cfg.rollout.megatron_engine.cuda_graphs


def _megatron_engine_memory(q, cfg, rows: int, T: int) -> tuple[list, bool]:
    return [("megatron_engine KV buffer", ENGINE_BUFFER_GIB * mem.GIB)], False


register_backend("megatron_engine", Backend(
    engine=True, records_routing=_always, needs_cuda=True,
    settings="rollout.megatron_engine", cuda_graphs=_graphs, plan_memory=_megatron_engine_memory,
    measured=lambda cfg: "megatron_engine_graphs" if _graphs(cfg) else "megatron_engine"),
    factory="megatron_gspo.rollout.engine:factory")


def _vllm_memory(q, cfg, rows: int, T: int) -> tuple[list, bool]:
    """In this process: the engine's whole model and KV cache, for the whole step. As engine
    servers: on the trainer's GPUs only a push's largest gathered parameter and one bucket."""
    r, a = cfg.rollout, mem.ITEMSIZE[cfg.model.dtype]
    if r.vllm.mode == "server":  # the engine on its own devices
        largest = max(q.num_experts * 2 * q.moe_ffn_hidden_size, q.vocab_size) \
            * q.hidden_size * a  # a stacked fc1 or the embedding, gathered whole
        return [("push: largest parameter gathered, parts + whole", 2 * largest),
                (f"push: one bucket (rollout.vllm.bucket_mb={r.vllm.bucket_mb:g})",
                 r.vllm.bucket_mb * 2**20)], False
    engine_a = a if r.vllm.dtype == "auto" else mem.ITEMSIZE[r.vllm.dtype]
    return [("vLLM engine weights (the whole model)", q.num_params()["total"] * engine_a),
            (f"vLLM KV cache (rollout.vllm.kv_cache_gb={r.vllm.kv_cache_gb:g})",
             r.vllm.kv_cache_gb * mem.GIB)], True


def _vllm_server(cfg) -> bool:
    return cfg.rollout.vllm.mode == "server"


def _vllm_check(cfg) -> None:
    if cfg.rollout.max_staleness and not _vllm_server(cfg):
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} with "
                          "rollout.backend=vllm needs rollout.vllm.mode=server (an engine in the "
                          f"trainer's process cannot sample beside it; got {cfg.rollout.vllm.mode})")


register_backend("vllm", Backend(engine=True, records_routing=_always, settings="rollout.vllm",
                                 plan_memory=_vllm_memory, beside=_vllm_server,
                                 check=_vllm_check),
                 factory="megatron_gspo.rollout.vllm.sampler:factory")


# ----------------------------------------------------------------------------- lookup, checks


def backend_of(cfg) -> Backend:
    """The capabilities of the run's sampler (`cfg.rollout.backend`); ConfigError naming
    `rollout.backend` unless one of that name is registered."""
    name = cfg.rollout.backend
    if name not in BACKENDS:
        raise ConfigError(f"rollout.backend={name!r}: no such backend; registered: "
                          f"{sorted(BACKENDS)}")
    return BACKENDS[name]


def check_config(cfg) -> Backend:
    """The backend's capabilities, once the config passes what they require (ConfigError in one
    line otherwise): its own checks, no other backend's own key set, and R3 only with a backend
    that records its routing. Imports no backend."""
    caps, name = backend_of(cfg), cfg.rollout.backend
    default = RunConfig()
    for key in dict.fromkeys(k for b in BACKENDS.values() for k in b.own_keys):
        value = value_at(cfg, key)
        if key not in caps.own_keys and value != value_at(default, key):
            owners = [n for n, b in BACKENDS.items() if key in b.own_keys]
            raise ConfigError(f"{key}={value}: needs rollout.backend={' or '.join(owners)}, "
                              f"not {name!r}")
    caps.check(cfg)
    if cfg.rollout.max_staleness and not caps.beside(cfg):
        can = sorted(n for n, b in BACKENDS.items() if b.beside(cfg))
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} samples beside the "
                          f"trainer: rollout.backend={name} cannot (its capability `beside`; "
                          f"{', '.join(can) or 'none'} can)")
    if cfg.train.routing_replay == "r3" and not caps.records_routing(cfg):
        raise ConfigError(f"train.routing_replay=r3 replays the sampler's routing: "
                          f"rollout.backend={name} does not record it")
    return caps


def unused_settings(cfg, origins: dict[str, str]) -> list[str]:
    """The settings `origins` gives (dotted key -> where: a config file, or COMMAND_LINE:
    `config.schema.load_config_origins`) away from their default in a part of the config the
    run does not use: the settings section of a backend (`Backend.settings`) other than the
    run's backend's. The first one given on the command line is a ConfigError; those a file
    gives (a `base:` file may set defaults for several backends) are returned, one warning line
    each."""
    used, default = backend_of(cfg).settings, RunConfig()
    owners: dict[str, list[str]] = {}
    for name, caps in BACKENDS.items():
        if caps.settings and caps.settings != used:
            owners.setdefault(caps.settings, []).append(name)
    warnings = []
    for key, where in origins.items():
        section = next((s for s in owners if key.startswith(s + ".")), None)
        if section is None or value_at(cfg, key) == value_at(default, key):
            continue
        line = (f"{key}={value_at(cfg, key)!r} is a setting of rollout.backend="
                f"{' or '.join(owners[section])}; this run samples with "
                f"{cfg.rollout.backend!r}, which never reads it")
        if where == COMMAND_LINE:
            raise ConfigError(f"{line}: drop it, or set rollout.backend")
        warnings.append(f"{where}: {line} (ignored)")
    return warnings


def sampler_factory(name: str):
    """The factory registered as `name`, imported if it was registered by path."""
    factory = SAMPLERS[name]
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = getattr(importlib.import_module(module), attribute)
    return factory


def check_backend(cfg) -> None:
    """`check_config`, then whether the backend can run here: its factory's optional
    `unavailable()` (a reason in one line), then a CUDA GPU where it needs one. Imports the
    backend's module."""
    caps = check_config(cfg)
    why = getattr(sampler_factory(cfg.rollout.backend), "unavailable", lambda: None)()
    if why:
        raise ConfigError(why)
    if caps.needs_cuda:
        import torch  # only when a run starts: the plan reads this module without torch

        if not torch.cuda.is_available():
            raise ConfigError(f"rollout.backend={cfg.rollout.backend} needs a CUDA GPU; none "
                              "is visible here")


def build_sampler(cfg, policy, tokenizer) -> Sampler:
    """The run's sampler (`cfg.rollout.backend`) over `policy`."""
    check_backend(cfg)
    return sampler_factory(cfg.rollout.backend)(policy, tokenizer, cfg)

