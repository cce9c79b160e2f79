"""moe: the megatron-core Mixture-of-Experts policy (the only package that imports megatron.core).

Rooms by concern, each using only those before it:

    platform/   megatron-core compatibility, CPU shims, process groups, child processes
    routing/    Routing Replay, routing volatility, router scores and noise
    model/      presets, the GPTModel and its layers, log-probs, optimizer, memory, sharding,
                the policy and its dist checkpoints
    inference/  KV-cache decoders and megatron-core's inference engine over the policy
    hf/         Hugging Face families, config.json and safetensors in and out
"""

import warnings as _warnings

from moe.platform.import_hooks import install_import_hooks as _install_import_hooks

_install_import_hooks()  # before any megatron import: megatron-core 0.18+ without triton
# megatron-core says at import that TransformerEngine / Apex are missing and it uses its local
# fallbacks: the path this package runs by design on CPU (`moe.model.gpt` notes the GPU case once)
_warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
