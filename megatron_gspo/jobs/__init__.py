"""The jobs a user runs: RL training (GSPO / GRPO with Routing Replay), cold-start SFT with its
accuracy band, and eval. Each provides its step, its eval and its state; `megatron_gspo.run`
drives them.

May import: every room below it (`run`, `rollout`, `tasks`, `algo`, `config`), `moe`, the
top-level helpers. Only `megatron_gspo.cli` imports jobs.
"""
