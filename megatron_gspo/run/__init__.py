"""A run's lifetime around any job: the loop that drives a job (`loop`: resume, start eval and
accuracy band, steps, saves, preemption, finish), set-up (process groups, policy, task), the
run's random streams (`seeds`), the run directory, checkpoints (`resume`: save and resume;
`init`: init_checkpoint; export), preemption, metrics and the host.

May import: `megatron_gspo.config`, `algo`, `tasks`, `rollout`, `moe`, the top-level helpers;
never `megatron_gspo.jobs` (jobs plug into the run, not the reverse).
"""
