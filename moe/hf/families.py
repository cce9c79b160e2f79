"""The Hugging Face MoE families this project maps, one registry entry each.

A family is what differs between two config.json dialects of the same megatron-core model:
which keys carry the experts' size and count, the attention's extras (QK norm, QKV bias), the
shared expert, whether the top-k weights are renormalised, and what to refuse. `moe.hf.config`
reads and writes the keys every family shares (sizes, heads, RoPE, norms, vocabulary) and asks
the family for the rest:

    register_hf_family(HFFamily(
        model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
        read=lambda cfg, where: {...MoEPreset fields...},
        write=lambda preset: {...config.json keys...}))

Names and fused-tensor formats come from mbridge's bridge of the same `model_type`
(`moe.hf.mapping`); a family mbridge lacks also needs a bridge registered there
(`mbridge.core.register_model`). A plugin registers a family the same way as the built-in ones
below (docs/extending.md registers Mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe.model.presets import MoEPreset
from moe.platform.checks import refuse_duplicate


def _no_refusal(cfg: dict, where: str) -> None:
    return None


def _any_preset(preset: MoEPreset) -> None:
    return None


@dataclass(frozen=True)
class HFFamily:
    """One config.json dialect (`model_type`) of the megatron-core MoE model."""

    model_type: str
    """config.json's `model_type`, the key of the registry."""
    architecture: str
    """config.json's `architectures[0]` on export (the transformers class)."""
    read: Callable[[dict, str], dict]
    """(config.json dict, where) -> the `MoEPreset` fields only this family's keys give:
    num_experts, moe_ffn_hidden_size, qk_layernorm, qkv_bias, norm_topk_prob, the shared
    expert's; ValueError naming a missing key (`where` names the file)."""
    write: Callable[[MoEPreset], dict]
    """preset -> the config.json keys only this family writes (the counterpart of `read`)."""
    refuse: Callable[[dict, str], None] = _no_refusal
    """(config.json dict, where) -> ValueError naming a key the megatron-core model would get
    wrong in this family (beyond what every family refuses, `moe.hf.config`)."""
    check_preset: Callable[[MoEPreset], None] = _any_preset
    """preset -> ValueError when this family has no config.json for it (export)."""


HF_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily) -> HFFamily:
    """Add `family` under its `model_type`; a `model_type` already registered is refused naming
    both families (their `read` functions)."""
    if family.model_type in HF_FAMILIES:
        refuse_duplicate("Hugging Face family", family.model_type,
                         HF_FAMILIES[family.model_type].read, family.read)
    HF_FAMILIES[family.model_type] = family
    return family


def hf_family(model_type, where: str) -> HFFamily:
    """The family of `model_type`; ValueError naming it and the registered ones otherwise."""
    if model_type not in HF_FAMILIES:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; supported: "
                         f"{sorted(HF_FAMILIES)}")
    return HF_FAMILIES[model_type]


def required(cfg: dict, key: str, where: str):
    """`cfg[key]`; ValueError naming the key and the file when it is absent."""
    if key not in cfg:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return cfg[key]


def _qwen_experts(cfg: dict, where: str) -> dict:
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ValueError(f"{where}: config.json has neither 'num_experts' nor "
                         "'num_local_experts'")
    return {"num_experts": experts,
            "moe_ffn_hidden_size": required(cfg, "moe_intermediate_size", where),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}


def _qwen_write(preset: MoEPreset) -> dict:
    return {"num_experts": preset.num_experts, "moe_intermediate_size": preset.moe_ffn_hidden_size,
            "norm_topk_prob": preset.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False}


def _qwen3_refuse(cfg: dict, where: str) -> None:
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported (it biases o_proj too)")


def _qwen2_read(cfg: dict, where: str) -> dict:
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return {**_qwen_experts(cfg, where), "qkv_bias": bool(cfg.get("qkv_bias", True)),
            "shared_expert_ffn_hidden_size": shared, "shared_expert_gate": shared > 0}


def _qwen2_check(preset: MoEPreset) -> None:
    if preset.kv_channels * preset.num_attention_heads != preset.hidden_size:
        raise ValueError(f"preset {preset.name!r}: qwen2_moe needs head_dim * heads == hidden")


QWEN3_MOE = register_hf_family(HFFamily(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    read=lambda cfg, where: {**_qwen_experts(cfg, where), "qk_layernorm": True},
    write=lambda preset: {**_qwen_write(preset), "attention_bias": False},
    refuse=_qwen3_refuse))
"""Qwen3-MoE (Qwen3-30B-A3B and its smaller cousins): QK RMSNorm, no biases."""

QWEN2_MOE = register_hf_family(HFFamily(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", read=_qwen2_read,
    write=lambda preset: {**_qwen_write(preset), "qkv_bias": preset.qkv_bias,
                          "shared_expert_intermediate_size":
                              preset.shared_expert_ffn_hidden_size},
    check_preset=_qwen2_check))
"""Qwen2-MoE: a shared expert with a sigmoid gate, QKV bias, top-k not renormalised."""
