"""What the policy is trained on: toy tasks with exact verifiers, prompt datasets from files,
reward functions, the tokenizer (and its chat template).

May import: `megatron_gspo.config`, the top-level helpers; not `moe` (tasks are model-free).
"""

from megatron_gspo.tasks import running_ops  # noqa: F401 (registers its task with the toy ones)
