"""Build a megatron-core MoE `GPTModel` from a preset.

Shape legend: B sequences, T tokens per sequence, V vocabulary.

The TransformerEngine layer spec is used when TE imports and CUDA is present; otherwise the
local (pure megatron-core / torch) spec, which is what runs on CPU (on a GPU without TE it runs
too, slower, with a one-line notice on stderr once per process). Parameters are initialised
on the CPU from one seeded generator and then sharded (`use_cpu_initialization=True`), so a
TP/EP-sharded model holds exactly the slices of the 1-process model built with the same seed.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.transformer_config import TransformerConfig

from moe.model.attention import SDPAAttention
from moe.platform.compat import apply_cpu_patches, apply_cpu_training_patches, cuda_available
from moe.model.dispatch import install_sync_free_dispatch
from moe.model.experts import StackedExperts
from moe.model.presets import MoEPreset
from moe.model.settings import ParallelLayout, Recompute

_LOCAL_SPEC_NOTICE_SHOWN = False


def _transformer_engine_error() -> str | None:
    """None when TransformerEngine imports, else why not (one line)."""
    try:
        import transformer_engine  # noqa: F401  (optional dependency, the [gpu] extra: probed here)
    except Exception as e:  # ImportError, or a broken CUDA / TE build
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def have_transformer_engine() -> bool:
    """True when TransformerEngine imports and a GPU is present (the `[gpu]` extra)."""
    return cuda_available() and _transformer_engine_error() is None


def _notice_local_spec_on_gpu() -> None:
    """CUDA without TE: say once per process that the slower local spec is used, and why."""
    global _LOCAL_SPEC_NOTICE_SHOWN
    if _LOCAL_SPEC_NOTICE_SHOWN or not cuda_available():
        return
    _LOCAL_SPEC_NOTICE_SHOWN = True
    print(f"note: CUDA is available but TransformerEngine is not ({_transformer_engine_error()}); "
          f"using megatron-core's local (torch) layer spec; see README 'Install' for the [gpu] "
          f"extra", file=sys.stderr)


def transformer_config(preset: MoEPreset, layout: ParallelLayout = ParallelLayout(), *,
                       dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0,
                       routing_replay: bool = True, recompute: Recompute = Recompute(),
                       inference_graphs: bool = False):
    """The megatron `TransformerConfig` for a preset and a parallel layout. `inference_graphs`:
    megatron's own CUDA graphs (`cuda_graph_impl='local'`) at block scope, which its dynamic
    inference engine replays for decode steps only (`moe.inference.engine`); training forwards stay eager
    (block-scope graphs run only in inference mode with an inference context)."""
    preset.check_parallel(layout.tp, layout.ep)
    hard_gate = preset.topk == 1 and preset.norm_topk_prob
    config = TransformerConfig(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        kv_channels=preset.kv_channels,
        ffn_hidden_size=preset.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=preset.norm_epsilon,
        qk_layernorm=preset.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_qkv_bias=preset.qkv_bias,
        num_moe_experts=preset.num_experts,
        moe_router_topk=preset.topk,
        moe_ffn_hidden_size=preset.moe_ffn_hidden_size,
        # norm_topk_prob: softmax over the top-k logits = renormalised top-k probs; otherwise
        # softmax over all experts, then top-k (Qwen2-MoE).
        moe_router_pre_softmax=not preset.norm_topk_prob or hard_gate,
        moe_shared_expert_intermediate_size=preset.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=preset.shared_expert_gate,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type=layout.dispatcher,
        moe_enable_routing_replay=routing_replay,
        tensor_model_parallel_size=layout.tp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        init_method_std=0.02,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute.config_kwargs(),
        **(dict(cuda_graph_impl="local", inference_cuda_graph_scope="block")
           if inference_graphs else {}),
    )
    if hard_gate:  # Qwen3's norm_topk_prob at K = 1: a hard gate, weight 1, so the router gets
        # no gradient from the loss (its routes move only with the hidden states). megatron's
        # check refuses the setting for that reason; it reads the flag at each forward.
        config.moe_router_pre_softmax = False
    return config


def _with_modules(spec, experts, sdpa_attention: bool):
    """`spec` with `experts` (a class) as the MoE layers' experts, and with `sdpa_attention`
    `SDPAAttention` in place of `DotProductAttention`."""
    mlp, attn = _submodules(spec).mlp, _submodules(spec).self_attention
    if experts is not None:
        experts = _respec(_submodules(mlp).experts, module=experts)
        mlp = _respec(mlp, submodules=replace(_submodules(mlp), experts=experts))
    if sdpa_attention:
        attn = _respec(attn, submodules=replace(_submodules(attn),
                                                core_attention=SDPAAttention))
    return _respec(spec, submodules=replace(_submodules(spec), mlp=mlp, self_attention=attn))


def _submodules(spec):
    """A spec's submodules: a `ModuleSpec`'s field, or (megatron-core 0.19 builds some specs as
    `functools.partial(Module, submodules=...)`) the partial's keyword."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) \
        else spec.submodules


def _respec(spec, module=None, submodules=None):
    """`spec` with another module class and/or submodules, in the spec's own form."""
    if isinstance(spec, functools.partial):
        keywords = dict(spec.keywords)
        if submodules is not None:
            keywords["submodules"] = submodules
        return functools.partial(module or spec.func, *spec.args, **keywords)
    changes = {k: v for k, v in (("module", module), ("submodules", submodules)) if v is not None}
    return replace(spec, **changes)


def build_gpt_moe(preset: MoEPreset, layout: ParallelLayout = ParallelLayout(), *, seed: int = 0,
                  dtype: torch.dtype = torch.float32, aux_loss_coeff: float = 0.0,
                  routing_replay: bool = True, recompute: Recompute = Recompute(),
                  experts: type = StackedExperts, sdpa_attention: bool = True,
                  inference_graphs: bool = False):
    """Build the (sharded) MoE GPTModel. Call `moe.platform.parallel.init_parallel` first.

    `routing_replay=True` gives every router a megatron `RouterReplay`; idle (no action set) it
    routes normally, so it costs nothing until `moe.routing.replay` records or replays.
    `experts`: the MoE layers' experts module, `moe.model.experts.StackedExperts` (two stacked
    weights per layer, grouped GEMMs), whatever the layer spec; megatron's `SequentialMLP`
    (one module per expert, the layout before the stacked one) builds the tests' references.
    Local spec: `sdpa_attention` core attention as `moe.model.attention.SDPAAttention` (one SDPA
    call; equal to fp32 rounding; same parameters as `DotProductAttention`). On one
    expert-parallel rank, MoE layers dispatch through `moe.model.dispatch.SyncFreeDispatcher`
    (megatron's permutation without host syncs; the same rows).
    """
    apply_cpu_patches()
    if recompute.granularity is not None:
        apply_cpu_training_patches()
    config = transformer_config(preset, layout, dtype=dtype, aux_loss_coeff=aux_loss_coeff,
                                routing_replay=routing_replay, recompute=recompute,
                                inference_graphs=inference_graphs)
    spec = _layer_spec(preset, experts, sdpa_attention)
    # megatron's RouterReplay matches replay data to layers through a class-level list filled in
    # construction order: a model built earlier in this process (reference model, a test) would
    # shift every layer. Start each model with an empty list (docs/pitfalls.md#global-replay-list).
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.max_seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=preset.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(preset.rotary_base) if float(preset.rotary_base).is_integer()
        else preset.rotary_base,
        parallel_output=False,
    )
    if cuda_available():
        model = model.cuda()
    _finish_params(model, dtype)
    model.router_replays = list(RouterReplay.global_router_replay_instances)
    install_sync_free_dispatch(model)  # one rank: tokens to experts without host syncs
    return model


def _layer_spec(preset: MoEPreset, experts, sdpa_attention: bool):
    """TransformerEngine's layer spec where TE is installed, else megatron's local spec with
    `SDPAAttention` (`sdpa_attention`); `experts` in both (`_with_modules`). megatron's own
    experts module is left where `experts` is `SequentialMLP` (its TE linears under TE)."""
    experts = None if experts is SequentialMLP else experts
    if have_transformer_engine():
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=preset.num_experts, moe_grouped_gemm=False,
            qk_layernorm=preset.qk_layernorm)
        return _with_modules(spec, experts, False)
    _notice_local_spec_on_gpu()
    spec = get_gpt_layer_local_spec(num_experts=preset.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=preset.qk_layernorm, normalization="RMSNorm")
    return _with_modules(spec, experts, sdpa_attention)


def _finish_params(model, dtype: torch.dtype) -> None:
    """Every parameter in `dtype`, expert weights tagged for their gradient reduction."""
    # megatron's torch RMSNorm (local spec) creates fp32 weights whatever params_dtype says; TE's
    # norms, and Megatron-LM's Float16Module for any spec, make every parameter 16-bit in a
    # 16-bit run. Do the same: the Float16 optimizer then holds an fp32 master for every
    # parameter (and its sharded_state_dict maps only 16-bit params).
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
    # megatron marks expert weights `allreduce=False` (reduce over the expert-data-parallel group)
    # only when ep > 1. With ep == 1 and tp > 1 (expert TP = 1), each TP rank's experts see only
    # its sequence shard, so their grads must still be summed over the expert-DP group (which
    # spans the TP ranks); as dense params DDP would reduce them over DP alone and drop half the
    # gradient. Mark them always, and tag them for moe.model.sharding / moe.grads.
    for name, param in model.named_parameters():
        param.is_moe_expert = ".mlp.experts." in name
        if param.is_moe_expert:
            param.allreduce = False
