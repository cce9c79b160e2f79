"""The RL algorithm's math: group advantages, the policy losses (GRPO, GSPO, GSPO-token) and
their importance-weight corrections, expert-flip statistics. Pure torch over tensors (and the
policy for the flip forwards): no run state, no I/O.

May import: `megatron_gspo.config`, `moe`, the top-level helpers.
"""
