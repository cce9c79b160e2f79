"""The trainable policy: presets and settings, the megatron-core GPTModel and its layers
(`gpt`, `attention`, `experts`, `dispatch`), log-probs, the optimizer, memory estimates,
sharding between layouts, the policy itself and its dist checkpoints. Uses `moe.platform` and
`moe.routing`."""
