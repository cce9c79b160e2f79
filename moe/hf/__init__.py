"""Hugging Face MoE checkpoints in and out of the megatron-core policy, in any TP/EP layout.

    preset = preset_from_hf("/models/Qwen3-30B-A3B")           # moe.hf.config: config.json
    load_hf_weights(model, "/models/Qwen3-30B-A3B")            # moe.hf.weights: this rank's shard
    export_hf(full_params, preset, "out/", hf_config=...)      # moe.hf.weights: sharded safetensors

Families (`moe.hf.families`, a registry a plugin adds to): `qwen3_moe` (Qwen3-30B-A3B and its
smaller cousins) and `qwen2_moe` (shared expert with a sigmoid gate, QKV bias, un-renormalised
top-k). Names and fused-tensor formats come from
mbridge's maintained per-family mapping (`moe.hf.mapping`, which translates megatron's local
layer-spec names to the TransformerEngine names mbridge speaks); reading is our own so that each
rank reads only the slices it holds (`moe.hf.io`, `moe.model.sharding.shard_plan`).

Submodules are imported on use: `moe.hf.config` needs neither megatron nor transformers.
"""
