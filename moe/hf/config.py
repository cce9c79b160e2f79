"""config.json <-> `MoEPreset` for the Hugging Face MoE families this project maps.

The keys every family shares are read and written here; the rest comes from the config's
family (`moe.hf.families`: Qwen3-MoE and Qwen2-MoE built in, more through
`register_hf_family`).

`preset_from_hf` reads a local folder's config.json (nothing is downloaded) and refuses, naming
the key, what the megatron-core model would get wrong: dense MLP layers (`mlp_only_layers`,
`decoder_sparse_step`), sliding-window attention, RoPE scaling, an activation other than SiLU,
a quantized checkpoint (`quantization_config`) and Qwen3's `attention_bias` (which also biases
the output projection; megatron's `add_qkv_bias` does not). `hf_config_dict` writes the
config.json of an export.

Key spellings differ across transformers versions: `num_experts` (Qwen's released configs) or
`num_local_experts` (what transformers 5 writes); `rope_theta` or `rope_parameters.rope_theta`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from moe.hf.families import hf_family, required
from moe.model.presets import MoEPreset


def check_local_folder(path: str, what: str) -> None:
    """A clear error for a missing folder or a hub name (nothing is downloaded)."""
    if os.path.isdir(path):
        return
    hint = (" (it looks like a hub name: download the model yourself and pass its local folder; "
            "megatron-gspo never downloads)" if path.count("/") == 1 and not
            path.startswith((".", "/", "~")) else "")
    raise FileNotFoundError(f"{what} folder {path!r} does not exist{hint}")


def read_hf_config(path: str) -> dict:
    """The config.json of local model folder `path`."""
    check_local_folder(path, "model")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
    with open(file) as f:
        return json.load(f)


def _rope_theta(cfg: dict, where: str) -> float:
    params = cfg.get("rope_parameters") or {}
    for key in ("rope_parameters", "rope_scaling"):  # transformers applies either
        rope = cfg.get(key) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"{where}: RoPE scaling {key}={rope} is not supported "
                             "(plain RoPE only)")
    return float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))


def _refuse(cfg: dict, where: str) -> None:
    family = hf_family(cfg.get("model_type"), where)
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{where}: dense MLP layers (mlp_only_layers="
                         f"{cfg.get('mlp_only_layers')}, decoder_sparse_step="
                         f"{cfg.get('decoder_sparse_step')}) are not supported: every layer "
                         "must be MoE")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("quantization_config"):  # e.g. Qwen3-30B-A3B-FP8: scales next to the weights
        method = (cfg["quantization_config"] or {}).get("quant_method")
        raise ValueError(f"{where}: quantization_config (quant_method={method!r}) is not "
                         "supported: use the unquantized (bf16) release")
    family.refuse(cfg, where)


def preset_from_hf_config(cfg: dict, where: str = "config.json") -> MoEPreset:
    """The preset of a Hugging Face MoE config dict (see module docstring for what is refused)."""
    _refuse(cfg, where)
    model_type = cfg["model_type"]
    heads = required(cfg, "num_attention_heads", where)
    hidden = required(cfg, "hidden_size", where)
    fields = dict(
        name=f"hf:{model_type}",
        num_layers=required(cfg, "num_hidden_layers", where),
        hidden_size=hidden,
        num_attention_heads=heads,
        # required: transformers reads a missing key as its class default (4, 16), not heads
        num_query_groups=required(cfg, "num_key_value_heads", where),
        kv_channels=cfg.get("head_dim") or hidden // heads,
        topk=required(cfg, "num_experts_per_tok", where),
        vocab_size=required(cfg, "vocab_size", where),
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        rotary_base=_rope_theta(cfg, where),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_layernorm=False, qkv_bias=False, norm_topk_prob=False,  # unless the family says
        shared_expert_ffn_hidden_size=0, shared_expert_gate=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_model_type=model_type,
    )
    fields.update(hf_family(model_type, where).read(cfg, where))
    return MoEPreset(**fields)


def preset_from_hf(path: str) -> MoEPreset:
    """The preset of local Hugging Face model folder `path` (its config.json)."""
    return preset_from_hf_config(read_hf_config(path), where=os.path.join(path, "config.json"))


def hf_config_dict(preset: MoEPreset, vocab_size: int, dtype: str = "float32",
                   base: dict | None = None) -> dict:
    """config.json for `preset` with `vocab_size` rows. `base` (the source model's config.json)
    keeps its other keys (token ids, ...); the architecture keys must agree with the preset."""
    family = hf_family(preset.hf_model_type, f"preset {preset.name!r}")
    family.check_preset(preset)
    out = dict(base or {})
    out.update(
        architectures=[family.architecture], model_type=preset.hf_model_type,
        vocab_size=vocab_size, hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_query_groups, head_dim=preset.kv_channels,
        num_experts_per_tok=preset.topk, rms_norm_eps=preset.norm_epsilon,
        max_position_embeddings=preset.max_seq_len,
        tie_word_embeddings=preset.tie_word_embeddings, hidden_act="silu", dtype=dtype)
    for key in ("num_experts", "num_local_experts"):  # the family writes its own spelling
        out.pop(key, None)
    out.update(family.write(preset))
    out.setdefault("intermediate_size", preset.moe_ffn_hidden_size)  # dense MLPs: none here
    out.pop("torch_dtype", None)
    if "rope_parameters" in out or "rope_theta" not in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": preset.rotary_base}
        out.pop("rope_theta", None)
    else:
        out["rope_theta"] = preset.rotary_base
    again = dataclasses.replace(preset_from_hf_config(out, "exported config"), name=preset.name,
                                vocab_size=preset.vocab_size)
    if again != preset:
        raise ValueError(f"preset {preset.name!r} has no exact {preset.hf_model_type} config "
                         f"(round trip gives {again})")
    return out
