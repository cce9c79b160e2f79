"""Sampling from the policy's own weights: our KV-cache decoders (`decode`), megatron-core's
dynamic inference engine (`engine`) and its paged attention in plain torch. Uses the rooms
below it; nothing below uses it."""
