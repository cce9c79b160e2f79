"""moe: the megatron-core Mixture-of-Experts policy (the only package that imports megatron.core)."""

from moe.compat import install_import_hooks as _install_import_hooks

_install_import_hooks()  # before any megatron import: megatron-core 0.18+ without triton
