"""Verifiable toy tasks with exact 0/1 rewards (tokenized by `megatron_gspo.tasks.tokenizer.CharTokenizer`).

Each task is small enough for a tiny MoE transformer (vocab < 32, context <= 48 tokens) to learn
on CPU in minutes, and its reward is exact (no learned judge), as in the GSPO paper's
(arXiv 2507.18071) math/code settings, scaled down:

- `addition(num_digits)`: "12+345=" -> "357".
- `sort(length)`: "s:3819=" -> "1389".
- `countdown(num_numbers, max_number)`: "c:3,5,7>56=" -> "(3+5)*7"; any expression over + - *
  and parentheses that uses each given number exactly once and hits the target scores 1.0.
  Departs from TinyZero's Countdown: no division, and by default the numbers are listed in the
  order the reference expression uses them (`shuffle=True` lists them in random order).

Examples carry a reference answer (the SFT target) and `meta`, the data the reward needs.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass, fields
from typing import ClassVar, NamedTuple, Protocol, Sequence

from megatron_gspo.tasks.expression import parse_expression  # noqa: F401 (re-exported)
from megatron_gspo.tasks.rewards import compute_rewards, countdown_reward, exact_reward
from megatron_gspo.tasks.tokenizer import CharTokenizer  # noqa: F401 (re-exported)
from moe.platform.checks import is_int, refuse_duplicate

@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    """Reference completion (the SFT target)."""
    meta: tuple = ()
    """Task data the reward needs (countdown: (numbers, target)); hashable."""


class Task(Protocol):
    """What the library reads from a task: its registry name, the reward of a completion
    (`rewards.compute_rewards`) and a format check (`score`'s `eval/format_ok`). Dataset tasks
    (`data.DatasetTask`) are exactly this."""
    name: ClassVar[str]

    def reward(self, example: Example, completion: str) -> float: ...

    def format_ok(self, completion: str) -> bool: ...


class GeneratedTask(Task, Protocol):
    """A task that draws its own examples (`make_splits`): the toy tasks below."""

    def sample(self, rng: random.Random) -> Example: ...

    def num_prompts(self) -> int | None:
        """How many distinct prompts exist (None = too many to count); bounds the splits."""
        ...


TASKS: dict[str, type] = {}


def register_task(cls: type) -> type:
    """Class decorator adding a `GeneratedTask` dataclass to TASKS under its `name`; its fields
    are the `task.kwargs` the config accepts."""
    if cls.name in TASKS:
        refuse_duplicate("task", cls.name, TASKS[cls.name], cls)
    TASKS[cls.name] = cls
    return cls


def _check_int(task: str, field: str, value, lo: int, hi: int) -> None:
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{task}: {field}={value!r} must be an int in [{lo}, {hi}]")


def _check_completion(completion) -> str:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    return completion


_DIGITS = re.compile(r"[0-9]+")


@register_task
@dataclass(frozen=True)
class Addition:
    """"a+b=" -> str(a+b); a and b have 1..num_digits digits (count uniform, then value)."""

    num_digits: int = 2
    name: ClassVar[str] = "addition"

    def __post_init__(self) -> None:
        _check_int(self.name, "num_digits", self.num_digits, 1, 9)

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.num_digits + 2

    @property
    def max_answer_chars(self) -> int:
        return self.num_digits + 1

    def num_prompts(self) -> int:
        return (10 ** self.num_digits) ** 2

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.num_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        return Example(f"{a}+{b}=", str(a + b))

    def reward(self, example: Example, completion: str) -> float:
        return exact_reward(completion, example.answer)

    def format_ok(self, completion: str) -> bool:
        return _DIGITS.fullmatch(_check_completion(completion).strip()) is not None


@register_task
@dataclass(frozen=True)
class Sort:
    """"s:3819=" -> "1389": the digits sorted ascending."""

    length: int = 4
    name: ClassVar[str] = "sort"

    def __post_init__(self) -> None:
        _check_int(self.name, "length", self.length, 1, 20)

    @property
    def max_prompt_chars(self) -> int:
        return self.length + 3

    @property
    def max_answer_chars(self) -> int:
        return self.length

    def num_prompts(self) -> int:
        return 10 ** self.length

    def sample(self, rng: random.Random) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(self.length))
        return Example(f"s:{digits}=", "".join(sorted(digits)))

    def reward(self, example: Example, completion: str) -> float:
        return exact_reward(completion, example.answer)

    def format_ok(self, completion: str) -> bool:
        text = _check_completion(completion).strip()
        return len(text) == self.length and _DIGITS.fullmatch(text) is not None


def _build_left_to_right(nums: Sequence[int], ops: Sequence[str]) -> tuple[str, int]:
    """Apply ops left to right, bracketing the running expression before '*' when needed."""
    expr, value, additive = str(nums[0]), nums[0], False
    for op, m in zip(ops, nums[1:]):
        if op == "*":
            expr = f"({expr})*{m}" if additive else f"{expr}*{m}"
            value *= m
        else:
            expr = f"{expr}{op}{m}"
            value = value + m if op == "+" else value - m
        additive = op != "*"
    return expr, value


def _distinct_permutations(multiset: Sequence[int]) -> int:
    counts = {}
    for x in multiset:
        counts[x] = counts.get(x, 0) + 1
    return math.factorial(len(multiset)) // math.prod(math.factorial(c) for c in counts.values())


@register_task
@dataclass(frozen=True)
class Countdown:
    """"c:3,5,7>56=" -> an expression using 3, 5, 7 once each with value 56 (e.g. "(3+5)*7").

    The reference is built by construction: random numbers in [1, max_number] and random ops
    from + - *, applied left to right (parentheses where needed), resampled until target >= 0.
    """

    num_numbers: int = 3
    max_number: int = 9
    shuffle: bool = False
    """List the numbers in random order instead of the reference expression's order."""
    name: ClassVar[str] = "countdown"

    def __post_init__(self) -> None:
        _check_int(self.name, "num_numbers", self.num_numbers, 2, 6)
        _check_int(self.name, "max_number", self.max_number, 1, 99)
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"{self.name}: shuffle={self.shuffle!r} must be a bool")

    @property
    def max_prompt_chars(self) -> int:
        n, digits = self.num_numbers, len(str(self.max_number))
        target = self.max_number  # left to right: the largest value takes max(v + M, v * M)
        for _ in range(n - 1):
            target = max(target + self.max_number, target * self.max_number)
        return len("c:>=") + n * digits + (n - 1) + len(str(target))

    @property
    def max_answer_chars(self) -> int:
        n, digits = self.num_numbers, len(str(self.max_number))
        return n * digits + (n - 1) + 2 * (n - 2)

    def sample(self, rng: random.Random) -> Example:
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            ops = [rng.choice("+-*") for _ in range(self.num_numbers - 1)]
            expr, target = _build_left_to_right(nums, ops)
            if target >= 0:
                break
        shown = rng.sample(nums, len(nums)) if self.shuffle else nums
        prompt = f"c:{','.join(map(str, shown))}>{target}="
        return Example(prompt, expr, (tuple(shown), target))

    def reward(self, example: Example, completion: str) -> float:
        return countdown_reward(completion, example.meta)

    def format_ok(self, completion: str) -> bool:
        return parse_expression(_check_completion(completion)) is not None

    def num_prompts(self) -> int | None:
        """Exact count of distinct prompts by enumeration (None when that would be too slow)."""
        n, M = self.num_numbers, self.max_number
        if M ** n * 3 ** (n - 1) > 200_000:
            return None
        seen = set()
        for nums in itertools.product(range(1, M + 1), repeat=n):
            for ops in itertools.product("+-*", repeat=n - 1):
                value = _build_left_to_right(nums, ops)[1]
                if value >= 0:
                    seen.add((tuple(sorted(nums)) if self.shuffle else nums, value))
        if not self.shuffle:
            return len(seen)
        return sum(_distinct_permutations(ms) for ms, _ in seen)


@register_task
@dataclass(frozen=True)
class RunningSum:
    """"a:3,5,7,2=" -> "3+5=8,8+7=15,15+2=17": running sums written out as a scratchpad.

    The long-response task: with the defaults (10 numbers in [1, 9]) the reference has 9 steps
    and 61-71 tokens with <eos> under the character tokenizer (over 99% of them 64+; see
    tests), so sequence-level (GSPO) and token-level (GRPO) importance ratios differ over 60+
    tokens per response. Each step is one small addition plus a copy from the prompt. Reward:
    `exact` (the whole scratchpad, i.e. every partial sum, must be right); `format_ok`: it
    parses as steps "a+b=c" joined by ",". Needs model.max_seq_len >= 23 + 71 = 94 (the tiny
    presets have 64).
    """

    num_numbers: int = 10
    max_number: int = 9
    name: ClassVar[str] = "running_sum"

    def __post_init__(self) -> None:
        _check_int(self.name, "num_numbers", self.num_numbers, 2, 64)
        _check_int(self.name, "max_number", self.max_number, 1, 999)

    def _scratchpad(self, nums: Sequence[int]) -> str:
        steps, total = [], nums[0]
        for x in nums[1:]:
            steps.append(f"{total}+{x}={total + x}")
            total += x
        return ",".join(steps)

    @property
    def max_prompt_chars(self) -> int:
        return len("a:=") + self.num_numbers * len(str(self.max_number)) + self.num_numbers - 1

    @property
    def max_answer_chars(self) -> int:  # every number at its maximum gives the longest text
        return len(self._scratchpad([self.max_number] * self.num_numbers))

    def num_prompts(self) -> int:
        return self.max_number ** self.num_numbers

    def sample(self, rng: random.Random) -> Example:
        nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        return Example(f"a:{','.join(map(str, nums))}=", self._scratchpad(nums))

    def reward(self, example: Example, completion: str) -> float:
        return exact_reward(completion, example.answer)

    def format_ok(self, completion: str) -> bool:
        return _STEPS.fullmatch(_check_completion(completion).strip()) is not None


_STEPS = re.compile(r"[0-9]+\+[0-9]+=[0-9]+(,[0-9]+\+[0-9]+=[0-9]+)*")


def task_kwarg_names(name: str) -> list[str]:
    """The constructor arguments of registered task `name`."""
    return [f.name for f in fields(TASKS[name])]


def make_task(name: str, **kwargs) -> GeneratedTask:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    valid = task_kwarg_names(name)
    bad = [k for k in kwargs if k not in valid]
    if bad:
        raise TypeError(f"task {name!r} got unknown kwarg(s) {bad}; valid: {valid}")
    return cls(**kwargs)


def _draw_distinct(task: GeneratedTask, rng: random.Random, n: int, seen: set) -> list[Example]:
    out, max_draws = [], 50 * n + 10_000
    for _ in range(max_draws):
        if len(out) == n:
            return out
        ex = task.sample(rng)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    if len(out) == n:
        return out
    raise ValueError(f"{task!r}: found only {len(out)} of {n} new distinct prompts in "
                     f"{max_draws} draws; the task has too few distinct prompts for this split")


class Splits(NamedTuple):
    """A task's examples: train, validation (what evals during training and the accuracy bands
    read; may be empty) and test (evaluated at a run's first and last step only)."""

    train: list[Example]
    val: list[Example]
    test: list[Example]


def make_splits(task: GeneratedTask, n_train: int, n_test: int, seed: int,
                n_val: int = 0) -> Splits:
    """Train, validation and test examples with distinct prompts, pairwise disjoint,
    deterministic for `seed`.

    Test is drawn first, then train, then validation, from one seeded stream: the test set
    depends only on (task, n_test, seed), and test and train are the same with or without a
    validation split (the test split is the eval split of the runs from before it existed).
    """
    for label, n in (("n_train", n_train), ("n_test", n_test), ("n_val", n_val)):
        if not is_int(n) or n < 0:
            raise ValueError(f"make_splits: {label}={n!r} must be an int >= 0")
    capacity, total = task.num_prompts(), n_train + n_test + n_val
    if capacity is not None and total > capacity:
        raise ValueError(f"{task!r} has only {capacity} distinct prompts; asked for "
                         f"n_train + n_test + n_val = {n_train} + {n_test} + {n_val} = {total}")
    rng, seen = random.Random(seed), set()
    test = _draw_distinct(task, rng, n_test, seen)
    train = _draw_distinct(task, rng, n_train, seen)
    return Splits(train, _draw_distinct(task, rng, n_val, seen), test)


def score(task: Task, examples: Sequence[Example], completions: Sequence[str]) -> dict[str, float]:
    """`eval/accuracy` (reward 1.0), `eval/reward_mean`, `eval/format_ok` (answer parses)."""
    if len(examples) != len(completions):
        raise ValueError(f"score: {len(examples)} examples but {len(completions)} completions")
    if not examples:
        raise ValueError("score: no examples")
    rewards, _ = compute_rewards(task, examples, completions)
    n = len(rewards)
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / n,
            "eval/reward_mean": sum(rewards) / n,
            "eval/format_ok": sum(bool(task.format_ok(c)) for c in completions) / n}
