"""`running_ops`: a running result mod 10 under the operation the first prompt token names.

"*:3,5,7,2=" -> "3*5=5,5*7=5,5*2=0": the numbers (digits 0-9) combined left to right by one
operation, + - or *, each step's result taken mod 10 and written out as a scratchpad, like
`running_sum`'s (`megatron_gspo.tasks.toy`). The operation is named once, by the first prompt
token, and every step of the answer depends on it: the policy must carry it from there to each
step, which a mixture of experts can do by sending each operation's steps to experts of their
own (a task that rewards specialisation; experiments/routing_volatility_r2). With the defaults
(10 numbers) the answer has 9 steps, 53 characters (54 tokens with <eos>), the prompt 22.
Reward: `exact`; `format_ok`: steps "a?b=c" (one digit each) joined by ",".
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

from megatron_gspo.tasks.rewards import exact_reward
from megatron_gspo.tasks.toy import Example, register_task
from moe.platform.checks import is_int

OPS = {"+": lambda a, b: (a + b) % 10, "-": lambda a, b: (a - b) % 10,
       "*": lambda a, b: (a * b) % 10}
_STEPS = re.compile(r"[0-9][-+*][0-9]=[0-9](,[0-9][-+*][0-9]=[0-9])*")


@register_task
@dataclass(frozen=True)
class RunningOps:
    """"op:d1,d2,...=" -> "d1 op d2 = r1,r1 op d3 = r2,..." mod 10 (module docstring)."""

    num_numbers: int = 10
    ops: str = "+-*"
    """The operations drawn from (uniformly, one per prompt): distinct characters of "+-*"."""
    name: ClassVar[str] = "running_ops"

    def __post_init__(self) -> None:
        if not is_int(self.num_numbers) or not 2 <= self.num_numbers <= 64:
            raise ValueError(f"{self.name}: num_numbers={self.num_numbers!r} must be an int in "
                             "[2, 64]")
        if not isinstance(self.ops, str) or not self.ops or set(self.ops) - set(OPS) \
                or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"{self.name}: ops={self.ops!r} must be distinct characters of "
                             f"{''.join(OPS)!r}")

    def scratchpad(self, op: str, nums: Sequence[int]) -> str:
        steps, value = [], nums[0]
        for x in nums[1:]:
            steps.append(f"{value}{op}{x}={OPS[op](value, x)}")
            value = OPS[op](value, x)
        return ",".join(steps)

    @property
    def max_prompt_chars(self) -> int:
        return len("+:=") + 2 * self.num_numbers - 1

    @property
    def max_answer_chars(self) -> int:
        return 6 * (self.num_numbers - 1) - 1

    def num_prompts(self) -> int:
        return len(self.ops) * 10 ** self.num_numbers

    def sample(self, rng: random.Random) -> Example:
        op = rng.choice(self.ops)
        nums = [rng.randint(0, 9) for _ in range(self.num_numbers)]
        return Example(f"{op}:{','.join(map(str, nums))}=", self.scratchpad(op, nums))

    def reward(self, example: Example, completion: str) -> float:
        return exact_reward(completion, example.answer)

    def format_ok(self, completion: str) -> bool:
        if not isinstance(completion, str):
            raise TypeError(f"completion must be a str, got {type(completion).__name__}")
        return _STEPS.fullmatch(completion.strip()) is not None
