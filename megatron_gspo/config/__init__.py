"""Configuration: the run's schema (one frozen dataclass per component, every field with a
docstring: `sections`, `data`, `schema`) and its strict loading (`yamlfile`: YAML with `base:`
inheritance and line:column errors; `loader`: dotted `a.b=c` overrides, unknown keys refused by
name, values read into their field's type; `fields`: the types and the one style of checks).

May import: `moe` (architecture and optimizer rules it validates against) and the top-level
helpers (`megatron_gspo.errors`, `megatron_gspo.dist`); nothing else of `megatron_gspo`: every
other room reads its settings from here. Names held by a higher room's registry (tasks, losses,
rewards, samplers) are checked at set-up by `megatron_gspo.run.names`.
"""
