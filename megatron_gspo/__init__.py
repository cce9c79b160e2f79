"""megatron_gspo: GSPO / GRPO reinforcement learning for megatron-core MoE policies."""
