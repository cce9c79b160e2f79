"""Configuration: the run's schema (one frozen dataclass per component, every field with a
docstring) and its strict loading (YAML with `base:` inheritance, dotted `a.b=c` overrides,
unknown keys refused by name).

May import: `moe` (architecture and optimizer rules it validates against) and the top-level
helpers (`megatron_gspo.errors`, `megatron_gspo.dist`); nothing else of `megatron_gspo`: every
other room reads its settings from here.
"""
