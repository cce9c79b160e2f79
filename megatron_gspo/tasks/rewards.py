"""Reward registry: verifiers that score one completion against its ground truth.

    fn = get_reward("math")                     # KeyError listing the valid names otherwise
    fn("... so she has 72 apples. #### 72", "72")          -> 1.0
    rewards, status = compute_rewards(task, examples, completions, timeout_s=5.0)

Every reward has one signature, `fn(completion: str, ground_truth) -> float` in [0, 1], a
format check `format_ok(completion) -> bool` (`get_format_check`) and the ground truths it can
score (`GROUND_TRUTHS`: a dataset row with another one is refused when the data is loaded):
  exact      completion.strip() == str(ground_truth).strip() (the toy tasks addition / sort /
             running_sum; format: non-empty); a dataset's ground truth is a string or an integer
             (a float 82.0 would be the text "82.0", a list no text an answer writes).
  countdown  the completion is an expression over + - * ( ) using the given numbers once each
             and hitting the target (`expression.parse_expression`); ground truth (numbers, target) or
             verl/TinyZero's {"numbers": [...], "target": n}.
  math       the `math-verify` package (pip install -e .[math]): extracts the last answer of the
             completion (`\\boxed{...}`, `#### 72`, a final number or LaTeX expression), parses it
             with sympy and compares it with the ground truth, one string or number (fractions vs
             decimals, `\\dfrac`, `1,000`, `\\sqrt{4}` = 2, ...). A ground truth holding "####"
             (a GSM8K solution) is reduced to the text after the last "####"; one without
             `\\boxed` is wrapped in it (as verl's math_verify scorer does). Format: a `\\boxed{`
             or a `#### ` answer line.

`compute_rewards` is the one place rewards are computed (rollouts and eval, toy tasks and
datasets): it calls `task.reward(example, completion)` under a per-answer time limit, and the
whole batch under a batch limit (`reward.batch_timeout_s`, below the collective timeout: the
other ranks wait in a collective while one scores); a reward that raises or runs out of time,
or is not reached before the batch's time is up, scores 0.0 and is reported in the returned
status (0 ok, 1 raised, 2 timed out), so a bad verifier never kills a run.

The time limit. math-verify's own timeouts use `signal.alarm` (whole seconds, main thread only, a
ValueError in any other thread) per parse and per comparison, and swallow the timeout into a
False. Here its timers are off and its errors are raised (`raise_on_error=True`), and one
`signal.setitimer` (sub-second, restored afterwards, so an outer alarm survives) bounds the whole
answer: parse of the completion, (cached) parse of the ground truth and comparison. Python-level
sympy work and big-integer powers are interrupted (measured: verifying `\\boxed{9^{9^{9^{9}}}}`
ran for over 5 minutes without a limit; with a 1 s limit it stops after 1.0 s). Outside the main thread signals are not
available: there the reward runs without a limit and a warning says so once.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import logging
import math
import re
import signal
import threading
import time
import warnings
from typing import Any, Callable, Optional, Sequence

from megatron_gspo.errors import UnknownName
from megatron_gspo.tasks.expression import parse_expression
from moe.platform.checks import MissingDependency, is_int, refuse_duplicate

RewardFn = Callable[[str, Any], float]
REWARDS: dict[str, RewardFn] = {}
FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {}
GROUND_TRUTHS: dict[str, Callable[[Any], Optional[str]]] = {}
"""name -> `problem(ground_truth)`: why a dataset row's ground truth can never score under the
reward (a phrase), or None; the data check refuses such a row (`datasets.check_ground_truths`)."""

OK, RAISED, TIMED_OUT = 0, 1, 2
"""Per-answer status codes of `compute_rewards`."""


class RewardTimeout(BaseException):
    """Raised inside a reward that ran past its time limit. A BaseException, so that the
    `except Exception` blocks of sympy / math-verify cannot swallow it."""


def _any_truth(ground_truth) -> None:
    return None


def register_reward(name: str, *, format_check: Callable[[str], bool],
                    ground_truth: Callable[[Any], Optional[str]] = _any_truth):
    """Decorator adding `fn(completion, ground_truth) -> float` to REWARDS; `ground_truth(value)`
    says why a dataset row's ground truth (a JSON value as `datasets.freeze` keeps it: lists as
    tuples, objects as sorted (key, value) tuples) can never score under it, or None (the
    default accepts every value)."""
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            refuse_duplicate("reward", name, REWARDS[name], fn)
        REWARDS[name], FORMAT_CHECKS[name], GROUND_TRUTHS[name] = fn, format_check, ground_truth
        return fn
    return deco


def _kind(value) -> str:
    """A ground truth's JSON kind, for a message."""
    if isinstance(value, tuple):
        pairs = bool(value) and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                    for v in value)
        return "a JSON object" if pairs else "a list"
    return f"the {'number' if isinstance(value, (int, float)) else type(value).__name__} {value!r}"


def _text_truth(value) -> str | None:
    """exact: a string or an integer (the text of both is what a completion writes)."""
    if isinstance(value, str) or is_int(value):
        return None
    return (f"is {_kind(value)}: reward 'exact' compares the answer's text with "
            f"{str(value)!r}, which no answer writes as meant; write the ground truth as a "
            "JSON string")


def _one_value(value) -> str | None:
    """math: one string or number (a list or an object is no answer math-verify compares)."""
    if not isinstance(value, tuple):
        return None
    return (f"is {_kind(value)}: reward 'math' compares one answer; write the ground truth as "
            "a string or a number")


def get_reward(name: str) -> RewardFn:
    """The registered reward called `name`; KeyError listing the valid names otherwise."""
    if name not in REWARDS:
        raise UnknownName(f"unknown reward {name!r}; valid names: {sorted(REWARDS)}")
    return REWARDS[name]


def get_format_check(name: str) -> Callable[[str], bool]:
    get_reward(name)
    return FORMAT_CHECKS[name]


def _check_completion(completion) -> str:
    if not isinstance(completion, str):
        raise TypeError(f"completion must be a str, got {type(completion).__name__}")
    return completion


# ----------------------------------------------------------------------------- exact


def _non_empty(completion: str) -> bool:
    return bool(_check_completion(completion).strip())


@register_reward("exact", format_check=_non_empty, ground_truth=_text_truth)
def exact_reward(completion: str, ground_truth) -> float:
    """1.0 iff the stripped completion equals the stripped ground truth (as text)."""
    return float(_check_completion(completion).strip() == str(ground_truth).strip())


# ----------------------------------------------------------------------------- countdown


def _countdown_format(completion: str) -> bool:
    return parse_expression(_check_completion(completion)) is not None


def countdown_truth(ground_truth) -> tuple[tuple[int, ...], int]:
    """(numbers, target) from a (numbers, target) pair or a {"numbers", "target"} mapping (also
    given as sorted (key, value) pairs, the hashable form `data` stores)."""
    if isinstance(ground_truth, tuple) and ground_truth and isinstance(ground_truth[0], tuple) \
            and len(ground_truth[0]) == 2 and isinstance(ground_truth[0][0], str):
        ground_truth = dict(ground_truth)
    if isinstance(ground_truth, dict):
        missing = {"numbers", "target"} - set(ground_truth)
        if missing:
            raise ValueError(f"countdown ground truth lacks {sorted(missing)}: {ground_truth!r}")
        ground_truth = (ground_truth["numbers"], ground_truth["target"])
    numbers, target = ground_truth
    return tuple(int(n) for n in numbers), int(target)


def _pair_or_mapping(value) -> str | None:
    """countdown: (numbers, target) or {"numbers", "target"} (`countdown_truth` reads both)."""
    try:
        if isinstance(value, tuple):
            countdown_truth(value)
            return None
    except (TypeError, ValueError):
        pass
    return (f"is {_kind(value)}: reward 'countdown' reads [numbers, target] or "
            '{"numbers": [...], "target": n}')


@register_reward("countdown", format_check=_countdown_format, ground_truth=_pair_or_mapping)
def countdown_reward(completion: str, ground_truth) -> float:
    """1.0 iff the completion's expression uses each given number exactly once and hits the
    target (the toy task's verifier, `tasks.Countdown`)."""
    parsed = parse_expression(_check_completion(completion))
    if parsed is None:
        return 0.0
    numbers, target = countdown_truth(ground_truth)
    value, used = parsed
    return float(value == target and sorted(used) == sorted(numbers))


# ----------------------------------------------------------------------------- math


_MATH_FORMAT = re.compile(r"\\boxed\{|(^|\n)\s*####\s*\S")


def _math_format(completion: str) -> bool:
    return _MATH_FORMAT.search(_check_completion(completion)) is not None


@functools.lru_cache(maxsize=1)
def _math_verify():
    try:  # optional dependency ([math] extra): only reward.name=math needs it
        import math_verify
    except ImportError:
        raise MissingDependency("reward 'math' needs the math-verify package: pip install -e "
                                ".[math] (or pip install math-verify)") from None
    # Its timers are off on purpose (see the module docstring); silence its one-time warning.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def check_math_available() -> None:
    """ImportError with the install command when math-verify is missing."""
    _math_verify()


def math_gold_text(ground_truth) -> str:
    """The ground truth as math-verify gold: after the last '####', wrapped in \\boxed{}. A
    float is written in positional notation (str(1e-05) is read as e - 5 by math-verify)."""
    if isinstance(ground_truth, float) and math.isfinite(ground_truth):
        ground_truth = format(decimal.Decimal(repr(ground_truth)), "f")
    text = str(ground_truth).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text if "\\boxed" in text else "\\boxed{" + text + "}"


@functools.lru_cache(maxsize=65536)
def _parse_gold(text: str):
    mv = _math_verify()
    gold = mv.parse(text, parsing_timeout=None, raise_on_error=True)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {text!r}")
    return gold


@register_reward("math", format_check=_math_format, ground_truth=_one_value)
def math_reward(completion: str, ground_truth) -> float:
    """1.0 iff math-verify finds the completion's answer equal to the ground truth."""
    mv = _math_verify()
    gold = _parse_gold(math_gold_text(ground_truth))
    pred = mv.parse(_check_completion(completion), parsing_timeout=None, raise_on_error=True)
    if not pred:
        return 0.0
    return float(mv.verify(gold, pred, timeout_seconds=None, raise_on_error=True))


# ----------------------------------------------------------------------------- time limit

_warned_no_limit = False


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise RewardTimeout in the block after `seconds` (None / 0: no limit).

    SIGALRM via `setitimer`, main thread only; elsewhere the block runs unlimited (warned
    once). An outer ITIMER_REAL alarm is restored with its remaining time afterwards."""
    global _warned_no_limit
    if not seconds or seconds <= 0:
        yield
        return
    if threading.current_thread() is not threading.main_thread() \
            or not hasattr(signal, "setitimer"):
        if not _warned_no_limit:
            warnings.warn("reward time limit needs the main thread (SIGALRM); rewards "
                          "computed here run without it", RuntimeWarning, stacklevel=3)
            _warned_no_limit = True
        yield
        return

    def on_alarm(signum, frame):
        raise RewardTimeout(f"reward exceeded its {seconds} s time limit")

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            left = max(old_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


_ERRORS_SHOWN = 3
_errors_seen = 0


def _report(example, error: BaseException) -> None:
    """Print the first few reward errors of the process (later ones are only counted)."""
    global _errors_seen
    _errors_seen += 1
    if _errors_seen <= _ERRORS_SHOWN:
        more = " (further errors are only counted)" if _errors_seen == _ERRORS_SHOWN else ""
        meta = getattr(example, "meta", ())
        where = meta[2] if len(meta) == 3 and isinstance(meta[2], str) \
            else f"prompt {str(getattr(example, 'prompt', ''))[:60]!r}"  # a dataset row: file:line
        print(f"reward error, scored 0 and counted in reward/errors: {type(error).__name__}: "
              f"{error} [{where}]{more}", flush=True)


def compute_rewards(task, examples: Sequence, completions: Sequence[str],
                    timeout_s: float | None = None, batch_timeout_s: float | None = None,
                    clock: Callable[[], float] = time.monotonic
                    ) -> tuple[list[float], list[int]]:
    """`task.reward(example, completion)` for each pair under a per-answer time limit, the
    whole batch under `batch_timeout_s`.

    Returns (rewards, status): a reward that raises, times out or is not a finite number scores
    0.0 with status RAISED / TIMED_OUT. `timeout_s` None takes the task's `reward_timeout_s`
    (0 = no limit: the toy tasks' verifiers are linear-time). `batch_timeout_s` None takes the
    task's `reward_batch_timeout_s` (absent or 0: none): each answer's limit is then the smaller
    of its own and the time left, and the answers not reached in time score 0 as TIMED_OUT
    without running, so a rank scoring its batch serially never outlives the collective
    timeout its peers wait under (128 answers x a 5 s limit is 640 s)."""
    if len(examples) != len(completions):
        raise ValueError(f"compute_rewards: {len(examples)} examples but {len(completions)} "
                         "completions")
    if timeout_s is None:
        timeout_s = getattr(task, "reward_timeout_s", 0.0)
    if batch_timeout_s is None:
        batch_timeout_s = getattr(task, "reward_batch_timeout_s", None)
    deadline = clock() + batch_timeout_s if batch_timeout_s else None
    rewards, status, late = [], [], 0
    for ex, completion in zip(examples, completions):
        limit = timeout_s
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:  # the batch's time is up: not run
                late += 1
                rewards.append(0.0)
                status.append(TIMED_OUT)
                continue
            limit = min(limit, left) if limit and limit > 0 else left
        try:
            with time_limit(limit):
                r = float(task.reward(ex, completion))
            if not math.isfinite(r):
                raise ValueError(f"reward is {r}")
            rewards.append(r)
            status.append(OK)
        except RewardTimeout as e:
            _report(ex, e)
            rewards.append(0.0)
            status.append(TIMED_OUT)
        except Exception as e:  # noqa: BLE001 (a verifier bug must not kill the run)
            _report(ex, e)
            rewards.append(0.0)
            status.append(RAISED)
    if late:
        print(f"reward: the batch time limit ({batch_timeout_s:g} s) ran out with {late} of "
              f"{len(completions)} answers not scored: 0 each, counted in reward/timeouts",
              flush=True)
    return rewards, status
