"""moe: the megatron-core Mixture-of-Experts policy (the only package that imports megatron.core)."""

import warnings as _warnings

from moe.import_hooks import install_import_hooks as _install_import_hooks

_install_import_hooks()  # before any megatron import: megatron-core 0.18+ without triton
# megatron-core says at import that TransformerEngine / Apex are missing and it uses its local
# fallbacks: the path this package runs by design on CPU (`moe.model` notes the GPU case once)
_warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed")
