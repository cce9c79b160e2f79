"""The engine-mismatch experiment's grid: the model shapes, inits and engine dtypes of the
measurements (part 1), and the RL arms (part 2). `run.py` runs it, `report.py` reports it."""

SHAPES = ("qwen3-moe-tiny-hd32", "qwen3-moe-tiny-hd32-wide")
INITS = ("random", "sft")
DTYPES = ("fp32", "bf16")
ARMS = ("gspo", "grpo", "grpo_r2", "grpo_r3", "grpo_fp32", "grpo_lean")
"""The four arms with a bfloat16 engine, then two controls without its mismatch."""
