"""A run's lifetime around any job: set-up (process groups, policy, task), the run directory,
checkpoints (save, resume, init, export), preemption, metrics and the host.

May import: `megatron_gspo.config`, `algo`, `tasks`, `rollout`, `moe`, the top-level helpers;
never `megatron_gspo.jobs` (jobs plug into the run, not the reverse).
"""
