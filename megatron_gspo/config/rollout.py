"""The run config's `rollout` section: sampling G responses per prompt, and the settings of the
sampler backends, each in its own section nested in it (`rollout.decoders`,
`rollout.megatron_engine`, `rollout.vllm`: `megatron_gspo.config.vllm`; a backend declares its
section, `megatron_gspo.rollout.sampler.Backend.settings`). Conventions as in
`megatron_gspo.config.sections`: every field has a docstring, `__post_init__` only checks,
`_read_older` reads the older `decoder` key into `backend`. Keys that moved into
a backend's section still load under their older names (`RolloutConfig._renamed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_gspo.config.fields import check, may_change, validate
from megatron_gspo.config.parts import check_host, part_field
from megatron_gspo.config.vllm import VLLMConfig


@dataclass(frozen=True)
class DecodersConfig:
    """backend=lean|megatron: our KV-cache decoders in the trainer process."""
    _section: ClassVar[str] = "rollout.decoders"

    kv_cache: bool = True
    """Sample with megatron-core's static KV cache (one new column per step); False recomputes
    the full forward each step. Sequence parallelism always recomputes."""
    sampler_dtype: Literal["same", "bf16"] = "same"
    """Precision of the sampler's forwards: "same" as the trainer, or "bf16" (autocast) for a
    real train-inference mismatch with an fp32 trainer (`megatron_gspo.rollout.precision`):
    log-probs and MoE routing then differ between sampler and trainer; pi_old, loss and eval
    stay as trained."""
    router_noise_std: float = 0.0
    """The sampler's routing disagreement knob (0 = off): the sampler's routers pick their top-k
    experts from router logits + Gaussian noise of this std (gate weights from the clean
    logits), in every forward the sampler runs, rollouts and evaluations: an inference engine
    whose routing differs from the trainer's (as a bf16 engine's does at scale) at a chosen
    rate. R3 replays the noisy routing it recorded; R2 and no replay route cleanly in the
    trainer. Refused with another backend (`moe.routing.noise`)."""
    router_noise: Literal["fixed", "fresh"] = "fixed"
    """How router_noise_std draws: "fixed", a fixed function of each router's input for the
    whole run (the same token in the same context always routes the same way: an engine whose
    kernels compute other router logits, as bf16 ones do), or "fresh", a new Gaussian draw in
    every rollout (an engine whose routing is not even reproducible)."""

    def __post_init__(self):
        validate(self, ge={"router_noise_std": 0})


@dataclass(frozen=True)
class MegatronEngineConfig:
    """backend=megatron_engine: megatron-core's dynamic inference engine."""
    _section: ClassVar[str] = "rollout.megatron_engine"

    cuda_graphs: bool = True
    """Replay the engine's decode steps as CUDA graphs (megatron's own, `cuda_graph_impl=local`
    at block scope; training forwards stay eager)."""

    def __post_init__(self):
        validate(self)


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of G responses per prompt."""
    _section: ClassVar[str] = "rollout"
    _renamed: ClassVar[dict] = {
        "kv_cache": "decoders.kv_cache", "sampler_dtype": "decoders.sampler_dtype",
        "router_noise_std": "decoders.router_noise_std", "router_noise": "decoders.router_noise",
        "cuda_graphs": "megatron_engine.cuda_graphs", "engine_dtype": "vllm.dtype",
        "engine_kv_cache_gb": "vllm.kv_cache_gb", "push_check_tol": "vllm.push_check_tol"}
    _older_keys: ClassVar[tuple] = ("decoder",)
    _parts: ClassVar[tuple] = ("backend", "backend", True)

    prompts_per_batch: int = 8
    """Prompts per rollout batch (over all data-parallel ranks)."""
    group_size: int = 8
    """G: responses sampled per prompt (>= 2, advantages are group-normalised)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (0 < top_p <= 1)."""
    max_new_tokens: int = 8
    """Maximum response length in tokens."""
    max_batch_rows: int = may_change(0)
    """Most rows (responses) one sampler call decodes at once: a rank's rollout rows are
    sampled in consecutive calls of whole groups of at most this many rows (one group at
    least), merged into one batch; 0 = all of a rank's rows in one call. Bounds the KV-cache
    sampler's cache (rows x (prompt + max_new_tokens) x layers x 2 x KV heads x head dim;
    `megatron-gspo plan` sizes it). Reproducible (the calls draw from the same seeded stream in
    turn), but another value samples other tokens. A memory knob: may change on resume."""
    use_sampler_logprobs: bool = False
    """Use the sampler's log-probs as pi_old instead of a recompute forward (the GSPO paper's
    claim that inference-engine likelihoods can be used directly, sec. 4.3)."""
    max_staleness: int = 0
    """k: rollout batches are sampled beside the trainer, by weights at most k versions (rollout
    batches trained) old: batch j by the weights the trainer had at the start of batch j - k
    (`megatron_gspo.rollout.overlap`). 0: the synchronous loop (sample, then train). k > 0
    needs a backend that can sample beside the trainer (`lean`, `megatron`, `vllm` with
    `rollout.vllm.mode=server`) and one trainer process; pi_old stays the trainer's recompute at
    the start of each batch's training, and the loss's TIS / masked IS / IcePop settings correct
    for the sampler being older (docs/staleness.md)."""
    backend: str = "lean"
    """The rollout backend (`megatron_gspo.rollout.sampler`): "lean" (our KV-cache decoder in the
    trainer process: walks megatron's layers itself, caches rotated keys, attends per K/V group;
    `moe.inference.decode`), "megatron" (`GPTModel.forward` with megatron-core's static inference context:
    the same routing and logits to fp32 rounding, slower), "megatron_engine" (megatron-core's
    dynamic inference engine over the same weights: paged KV cache, CUDA graphs; GPU and
    megatron-core >= 0.19 only), or any name registered with `register_backend`. Formerly
    also `rollout.decoder` (lean | megatron, read while backend is lean; still read)."""
    decoders: DecodersConfig = field(default_factory=DecodersConfig)
    """backend=lean|megatron: the KV-cache decoders' settings."""
    megatron_engine: MegatronEngineConfig = field(default_factory=MegatronEngineConfig)
    """backend=megatron_engine: the engine's settings."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """backend=vllm: the engine's precision and cache, and where it runs (in this process or as
    engine servers)."""
    settings: dict = part_field(nested=True)
    """{backend: its settings} of the sections `rollout.<backend>:` of backends that declare
    their own settings (a plugin's, `megatron_gspo.config.parts`), as given (missing: the
    defaults; `parts.settings_of`)."""

    def __post_init__(self):
        validate(self, nonempty=("backend",),
                 ge={"prompts_per_batch": 1, "group_size": 2, "max_new_tokens": 1,
                     "max_batch_rows": 0, "max_staleness": 0},
                 gt={"temperature": 0})
        check(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        check_host(self)

    @staticmethod
    def _read_older(data: dict) -> dict:
        """`data` (this section's mapping) with the older `decoder` key folded into `backend`:
        it chose lean or megatron while backend was lean, and every config saved before the
        fold holds it (`decoder: lean` beside `backend: vllm` too)."""
        if "decoder" not in data:
            return data
        data = dict(data)
        decoder = data.pop("decoder")
        if data.get("backend", "lean") == "lean":
            data["backend"] = decoder
        return data
