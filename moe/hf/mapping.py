"""Parameter names and fused-tensor formats between megatron-core and Hugging Face, via mbridge.

mbridge (github.com/ISEEKYAN/mbridge, pinned 0.15.1) keeps a maintained per-family table from
megatron-core parameter names to Hugging Face tensor names, and the conversions between fused
megatron tensors and their Hugging Face parts: QKV (megatron interleaves q, k, v per query group)
and SwiGLU `linear_fc1` ([gate; up]). Both conversions work on TP slices as well as on whole
tensors (a rank that read q/k/v rows of its own query groups gets its own QKV shard), which is
what lets each rank read only what it holds.

What we use from mbridge: `_weight_name_mapping_mcore_to_hf`, `_weight_to_mcore_format`,
`_weight_to_hf_format` (mbridge's own bridge subclasses override exactly these per family).
What we do not use, and why: its `load_weights` (tensor-parallel rank 0 reads every whole tensor
and scatters it; we read per-rank slices), its `get_model` (TransformerEngine spec, CUDA) and its
`TransformerConfig` (which also misses Qwen2-MoE's `moe_shared_expert_gate`; ours comes from the
preset, `moe.hf.config`).

mbridge speaks the TransformerEngine layer spec's names; on CPU we build megatron's local spec.
`local_to_te` is the translation (it would serve every family mbridge knows):
- TE fuses the pre-attention RMSNorm into linear_qkv: `input_layernorm.weight` <->
  `self_attention.linear_qkv.layer_norm_weight` (and a dense MLP's `pre_mlp_layernorm` into
  linear_fc1; MoE layers keep `pre_mlp_layernorm`);
- TEGroupedMLP names expert e `mlp.experts.linear_fcX.weight{e}`; ours (`moe.model.experts`) stacks
  every expert of a layer in one `mlp.experts.linear_fcX.weight` [E, ...], whose row e is TE's
  `...weight{e}` (`HFMapping.hf_names` / `to_hf` take the stacked name and the experts).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from moe.platform.checks import MissingDependency

_EXPERTS = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight$")
_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.")
_PRE_MLP = re.compile(r"^decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight$")


def local_to_te(names: Iterable[str]) -> dict[str, str]:
    """megatron local-spec parameter names -> TransformerEngine-spec names (mbridge's)."""
    names = list(names)
    moe_layers = {m.group(1) for n in names if (m := _ROUTER.match(n))}
    out = {}
    for name in names:
        te = re.sub(r"\.input_layernorm\.weight$", ".self_attention.linear_qkv.layer_norm_weight",
                    name)
        if (m := _PRE_MLP.match(te)) and m.group(1) not in moe_layers:
            te = f"decoder.layers.{m.group(1)}.mlp.linear_fc1.layer_norm_weight"
        out[name] = te
    return out


def is_expert_stack(name: str) -> bool:
    """Whether `name` is a MoE layer's stacked expert weight (`moe.model.experts`), [E, ...]."""
    return bool(_EXPERTS.search(name))


def _hf_config_object(config: dict):
    from transformers import AutoConfig  # optional dependency ([hf] extra) and a heavy import

    keep = {k: v for k, v in config.items() if k not in ("model_type", "architectures",
                                                         "transformers_version")}
    obj = AutoConfig.for_model(config["model_type"], **keep)
    if getattr(obj, "head_dim", None) is None:
        # mbridge 0.15.1 reads getattr(cfg, "head_dim", default): a None attribute (Qwen2-MoE's
        # config class) defeats the default.
        obj.head_dim = obj.hidden_size // obj.num_attention_heads
    return obj


class HFMapping:
    """mbridge's bridge for one Hugging Face config, used for names and formats only."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32):
        try:  # optional dependency ([hf] extra): a missing one is a MissingDependency, here
            from mbridge import AutoBridge
            from mbridge.core.parallel_states import ParallelStates
        except ImportError as e:
            raise MissingDependency("Hugging Face checkpoints need mbridge: pip install -e "
                                    f"'.[hf]' ({e})") from None
        # Names and formats do not depend on the layout: a 1-way bridge serves every rank.
        self.bridge = AutoBridge.from_config(_hf_config_object(hf_config), dtype=dtype,
                                             parallel_states=ParallelStates())
        self.dtype = dtype

    def hf_names(self, te_name: str, experts: Iterable[int] = ()) -> list[str]:
        """The Hugging Face tensors a megatron (TE-spec) parameter is made of; of a stacked
        expert weight (`is_expert_stack`), those of global experts `experts`."""
        if is_expert_stack(te_name):
            return [n for e in experts for n in self.hf_names(f"{te_name}{e}")]
        try:
            return self.bridge._weight_name_mapping_mcore_to_hf(te_name)
        except (KeyError, NotImplementedError):
            raise KeyError(f"mbridge ({type(self.bridge).__name__}) has no Hugging Face name "
                           f"for megatron parameter {te_name!r}") from None

    def to_mcore(self, te_name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Fuse Hugging Face tensors (or their TP slices) into the megatron tensor (slice)."""
        return self.bridge._weight_to_mcore_format(te_name, parts).to(self.dtype)

    def to_hf(self, te_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Split a full megatron tensor into its Hugging Face tensors (a stacked expert weight
        [E, ...]: each expert's, as views)."""
        if is_expert_stack(te_name):
            return [pair for e, row in enumerate(tensor) for pair in self.to_hf(f"{te_name}{e}",
                                                                                 row)]
        names, parts = self.bridge._weight_to_hf_format(te_name, tensor)
        return list(zip(names, parts))
