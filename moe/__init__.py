"""moe: the megatron-core Mixture-of-Experts policy (the only package that imports megatron.core)."""
