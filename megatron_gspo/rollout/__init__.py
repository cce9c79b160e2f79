"""Sampling: the rollout batch layout, the samplers that fill it (the sampler seam and its
backends), scoring with the task's rewards, dynamic-sampling filters and the greedy eval.

May import: `megatron_gspo.config`, `megatron_gspo.algo`, `megatron_gspo.tasks`, `moe`, the
top-level helpers.
"""
