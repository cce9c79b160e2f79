"""Tasks, tokenizer, splits and scoring against hand-worked values."""

import random

import pytest

from megatron_gspo.tasks.toy import (TASKS, CharTokenizer, Example, make_splits, make_task,
                                 parse_expression, score)


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


def test_tokenizer_ids_and_round_trip(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size <= 40
    # specials 0..2, then "0123456789+-*=,:>() ..." in order: '1' -> 4, '+' -> 13, '=' -> 16
    assert tok.encode("12+3=") == [4, 5, 13, 6, 16]
    assert tok.encode("c:(3) s") == [24, 18, 20, 6, 21, 22, 25]
    for text in ["12+345=", "s:3819=", "c:3,5,7>56=", "(3+5)*7", " 1-2 "]:
        assert tok.decode(tok.encode(text)) == text


def test_decode_stops_at_eos_and_drops_pad_bos(tok):
    ids = [tok.bos_id] + tok.encode("42") + [tok.pad_id] + tok.encode("7") + [tok.eos_id] \
        + tok.encode("99")
    assert tok.decode(ids) == "427"
    with pytest.raises(ValueError, match="99"):
        tok.decode([99])


def test_encode_unknown_char_names_char_and_position(tok):
    with pytest.raises(ValueError, match=r"'/' at position 2"):
        tok.encode("12/3")


def test_addition_reward():
    task = make_task("addition", num_digits=3)
    ex = Example("12+345=", "357")
    assert task.reward(ex, "357") == 1.0
    assert task.reward(ex, "  357 ") == 1.0
    assert task.reward(ex, "358") == 0.0
    assert task.reward(ex, "0357") == 0.0
    assert task.reward(ex, "3 57") == 0.0
    assert task.reward(ex, "") == 0.0
    assert task.format_ok(" 358") and not task.format_ok("3+5") and not task.format_ok("")


def test_addition_samples_are_correct_sums():
    task, rng = make_task("addition", num_digits=2), random.Random(1)
    lengths = set()
    for _ in range(300):
        ex = task.sample(rng)
        a, b = ex.prompt[:-1].split("+")
        assert ex.prompt.endswith("=") and ex.answer == str(int(a) + int(b))
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        lengths.update((len(a), len(b)))
    assert lengths == {1, 2}


def test_sort_reward():
    task = make_task("sort", length=4)
    ex = task.sample(random.Random(0))
    digits = ex.prompt[2:-1]
    assert ex.prompt.startswith("s:") and ex.answer == "".join(sorted(digits))
    hand = Example("s:3819=", "1389")
    assert task.reward(hand, "1389") == 1.0
    assert task.reward(hand, "\t1389  ") == 1.0
    assert task.reward(hand, "9831") == 0.0
    assert task.reward(hand, "138") == 0.0
    assert task.reward(hand, "1,3,8,9") == 0.0
    assert task.format_ok("9831") and not task.format_ok("983") and not task.format_ok("ab12")


def test_parse_expression_hand_cases():
    assert parse_expression("(3+5)*7") == (56, [3, 5, 7])
    assert parse_expression(" 3 + 5 * 7 ") == (38, [3, 5, 7])
    assert parse_expression("2-3-4") == (-5, [2, 3, 4])  # left associative
    assert parse_expression("10*(2-(1+1))") == (0, [10, 2, 1, 1])
    for bad in ["", "3+", "(3+5", "3+5)", "3 5", "-3+5", "3/5", "07+1", "3**2", "__import__",
                "()", "(" * 100 + "1" + ")" * 100, "1+" * 200 + "1", "(1 2", "(1+2("]:
        assert parse_expression(bad) is None, bad


def test_parse_expression_bounds_are_inclusive_and_depth_is_per_nesting():
    """256 characters and 32 nested parentheses are allowed, one more is not; depth counts
    nesting, not how many parenthesized groups there are; a lone 0 is a number."""
    assert parse_expression(" " + "1+" * 127 + "11 ") == (138, [1] * 127 + [11])  # 256 chars
    assert parse_expression("1+" * 127 + "111") is None  # 257
    assert parse_expression("(" * 32 + "1" + ")" * 32) == (1, [1])
    assert parse_expression("(" * 33 + "1" + ")" * 33) is None
    assert parse_expression("+".join(["(1)"] * 40)) == (40, [1] * 40)
    assert parse_expression("0+10*0") == (0, [0, 10, 0])


def test_countdown_reward():
    task = make_task("countdown")
    ex = Example("c:3,5,7>56=", "(3+5)*7", ((3, 5, 7), 56))
    assert task.reward(ex, "(3+5)*7") == 1.0
    assert task.reward(ex, " 7*(5+3) ") == 1.0  # a different correct expression
    assert task.reward(ex, "(3+5)*7*1") == 0.0  # literal not given
    assert task.reward(ex, "(3+5)*7+0") == 0.0
    assert task.reward(ex, "(5+3)*7+5-5") == 0.0  # reuses a number
    assert task.reward(ex, "(3+5)*(7)") == 1.0
    assert task.reward(ex, "(3+5)*8") == 0.0  # wrong number
    assert task.reward(ex, "3+5*7") == 0.0  # right numbers, wrong value (38)
    assert task.reward(ex, "(3+5)") == 0.0  # misses a number
    ex2 = Example("c:2,8,4>2=", "8/4*2", ((2, 8, 4), 2))
    assert task.reward(ex2, "8/4*2") == 0.0  # division is not allowed (= 4 anyway)
    assert task.reward(ex2, "8/(2*4)") == 0.0  # would be 1 under division
    assert task.reward(ex2, "8-2*4+2") == 0.0
    for malformed in ["(3+5*7", "abc", "", "3+5*7=", "56", "import os"]:
        assert task.reward(ex, malformed) == 0.0
    assert task.format_ok("1+2") and not task.format_ok("1+")


def test_countdown_duplicate_numbers_are_a_multiset():
    task = make_task("countdown")
    ex = Example("c:3,3,4>24=", "(3+3)*4", ((3, 3, 4), 24))
    assert task.reward(ex, "4*(3+3)") == 1.0
    assert task.reward(ex, "(3+3)*4*3") == 0.0
    assert task.reward(ex, "(4+4)*3") == 0.0  # uses 4 twice, 3 once


@pytest.mark.parametrize("kwargs", [{}, {"shuffle": True}, {"num_numbers": 4, "max_number": 12}])
def test_countdown_references_score_one(kwargs):
    task, rng = make_task("countdown", **kwargs), random.Random(0)
    for _ in range(200):
        ex = task.sample(rng)
        numbers, target = ex.meta
        assert target >= 0 and len(numbers) == task.num_numbers
        head = ex.prompt[2:-1].split(">")
        assert tuple(int(x) for x in head[0].split(",")) == numbers and int(head[1]) == target
        assert task.reward(ex, ex.answer) == 1.0, ex


def test_countdown_reference_parenthesizes():
    # "(a+b)*c" exists among the references for the defaults, and its value is (a+b)*c
    task, rng = make_task("countdown"), random.Random(3)
    seen = [task.sample(rng) for _ in range(200)]
    bracketed = [ex for ex in seen if ex.answer.startswith("(")]
    assert bracketed
    for ex in bracketed:
        (a, b, c), target = ex.meta
        op = ex.answer[2]
        assert ex.answer == f"({a}{op}{b})*{c}"
        assert target == (a + b if op == "+" else a - b) * c


@pytest.mark.parametrize("name,kwargs", [("addition", {}), ("sort", {}), ("countdown", {}),
                                         ("addition", {"num_digits": 4}), ("sort", {"length": 7}),
                                         ("countdown", {"num_numbers": 4, "max_number": 20,
                                                        "shuffle": True})])
def test_samples_encode_and_fit_bounds(tok, name, kwargs):
    task, rng = make_task(name, **kwargs), random.Random(0)
    longest_prompt = longest_answer = 0
    for _ in range(500):
        ex = task.sample(rng)
        tok.encode(ex.prompt + ex.answer)
        longest_prompt = max(longest_prompt, len(ex.prompt))
        longest_answer = max(longest_answer, len(ex.answer))
        hash(ex)
    assert longest_prompt <= task.max_prompt_chars and longest_answer <= task.max_answer_chars
    if not kwargs:
        assert task.max_prompt_chars + task.max_answer_chars <= 24


def test_bounds_hand_values():
    assert (make_task("addition").max_prompt_chars, make_task("addition").max_answer_chars) == (6, 3)
    assert (make_task("sort").max_prompt_chars, make_task("sort").max_answer_chars) == (7, 4)
    # "c:9,9,9>729=" and "(9+9)*9"
    cd = make_task("countdown")
    assert (cd.max_prompt_chars, cd.max_answer_chars) == (12, 7)


def test_make_splits_deterministic_disjoint():
    task = make_task("addition")
    train, _, ev = make_splits(task, 300, 50, seed=0)
    train2, _, ev2 = make_splits(task, 300, 50, seed=0)
    assert train == train2 and ev == ev2
    assert (len(train), len(ev)) == (300, 50)
    prompts = [ex.prompt for ex in train + ev]
    assert len(set(prompts)) == 350  # distinct within and across splits
    other, _, ev_other = make_splits(task, 300, 50, seed=1)
    assert [ex.prompt for ex in other] != [ex.prompt for ex in train]
    assert make_splits(task, 10, 50, seed=0).test == ev  # test does not depend on n_train


def test_a_validation_split_is_disjoint_and_leaves_train_and_test_as_they_were():
    """Drawn after test and train: the same (task, n_train, n_test, seed) gives the same train
    and test examples with or without it (old runs' splits), and its prompts are new."""
    task = make_task("addition")
    before = make_splits(task, 300, 50, seed=0)
    splits = make_splits(task, 300, 50, seed=0, n_val=40)
    assert (splits.train, splits.test) == (before.train, before.test) and before.val == []
    assert len(splits.val) == 40
    assert len({ex.prompt for ex in splits.train + splits.val + splits.test}) == 390
    assert make_splits(task, 300, 50, seed=0, n_val=40) == splits
    with pytest.raises(ValueError, match=r"n_train \+ n_test \+ n_val = 90 \+ 5 \+ 6 = 101"):
        make_splits(make_task("addition", num_digits=1), 90, 5, seed=0, n_val=6)
    with pytest.raises(ValueError, match="n_val=-1"):
        make_splits(task, 1, 1, seed=0, n_val=-1)


def test_make_splits_capacity_errors():
    with pytest.raises(ValueError, match="only 100 distinct prompts"):
        make_splits(make_task("addition", num_digits=1), 90, 11, seed=0)
    train, _, ev = make_splits(make_task("addition", num_digits=1), 90, 10, seed=0)
    assert len({ex.prompt for ex in train + ev}) == 100
    # countdown with 2 numbers in [1, 2], hand-enumerated: (1,1)>{2,0,1}, (1,2)>{3,2},
    # (2,1)>{3,1,2}, (2,2)>{4,0} = 10 prompts
    small = make_task("countdown", num_numbers=2, max_number=2)
    assert small.num_prompts() == 10
    with pytest.raises(ValueError, match="only 10 distinct prompts"):
        make_splits(small, 8, 3, seed=0)
    with pytest.raises(ValueError, match="n_test=-1"):
        make_splits(small, 1, -1, seed=0)
    train, _, ev = make_splits(small, 3, 0, seed=0)  # task.n_test=0 is a valid config
    assert len(train) == 3 and ev == []


def test_countdown_samples_reach_every_counted_prompt():
    """Targets of 0 are drawn (resampling is only for negative targets), and num_prompts with
    shuffle counts each distinct listing order of a multiset once (hand-enumerated)."""
    small = make_task("countdown", num_numbers=2, max_number=2)
    train, _, ev = make_splits(small, 7, 3, seed=0)
    assert {ex.prompt for ex in train + ev} == {
        "c:1,1>2=", "c:1,1>0=", "c:1,1>1=", "c:1,2>3=", "c:1,2>2=", "c:2,1>3=", "c:2,1>1=",
        "c:2,1>2=", "c:2,2>4=", "c:2,2>0="}
    # shuffle: {1,1} x {2,0,1} -> 3, {1,2} x {3,2,1} in 2 orders -> 6, {2,2} x {4,0} -> 2
    shuffled, rng = make_task("countdown", num_numbers=2, max_number=2, shuffle=True), \
        random.Random(0)
    assert shuffled.num_prompts() == 11
    assert len({shuffled.sample(rng).prompt for _ in range(2000)}) == 11


def test_registry_errors():
    assert set(TASKS) == {"addition", "sort", "countdown", "running_sum", "running_ops"}
    with pytest.raises(KeyError, match="addition.*countdown.*sort"):
        make_task("multiply")
    with pytest.raises(TypeError, match=r"kwarg\(s\) \['digits'\]; valid: \['num_digits'\]"):
        make_task("addition", digits=2)
    with pytest.raises(ValueError, match="num_digits=0"):
        make_task("addition", num_digits=0)
    with pytest.raises(ValueError, match="length='4'"):
        make_task("sort", length="4")
    with pytest.raises(ValueError, match="shuffle=1"):
        make_task("countdown", shuffle=1)


def test_register_task_decorator_adds_a_task_and_refuses_a_second_name():
    from dataclasses import dataclass
    from typing import ClassVar

    from megatron_gspo.tasks.toy import register_task

    @dataclass(frozen=True)
    class Echo:
        width: int = 2
        name: ClassVar[str] = "echo_test"

        def sample(self, rng):
            return Example("e:7=", "7")

        def reward(self, example, completion):
            return float(completion == example.answer)

        def format_ok(self, completion):
            return completion.isdigit()

        def num_prompts(self):
            return 1

    try:
        assert register_task(Echo) is Echo and make_task("echo_test", width=3).width == 3
        with pytest.raises(ValueError, match="'echo_test' is already registered"):
            register_task(Echo)
        with pytest.raises(ValueError, match="only 1 distinct prompts"):  # num_prompts is read
            make_splits(make_task("echo_test"), 1, 1, seed=0)
    finally:
        TASKS.pop("echo_test", None)


def test_score_hand_values():
    task = make_task("addition")
    examples = [Example("1+2=", "3"), Example("5+5=", "10"), Example("9+9=", "18"),
                Example("2+2=", "4")]
    out = score(task, examples, ["3", " 11", "1+7", "4<"])
    assert out == {"eval/accuracy": 0.25, "eval/reward_mean": 0.25, "eval/format_ok": 0.5}
    with pytest.raises(ValueError, match="4 examples but 3 completions"):
        score(task, examples, ["3", "10", "18"])


def test_score_accuracy_counts_only_full_rewards():
    """A partial reward (a format bonus) adds to eval/reward_mean, not to eval/accuracy."""

    class Partial:
        name, reward_timeout_s = "partial", 0.0

        def reward(self, example, completion):
            return 0.25 if completion == "~" else float(completion == example.answer)

        def format_ok(self, completion):
            return True

    out = score(Partial(), [Example("1+2=", "3")] * 2, ["3", "~"])
    assert out == {"eval/accuracy": 0.5, "eval/reward_mean": 0.625, "eval/format_ok": 1.0}
    Partial.reward = lambda self, example, completion: 0.999  # nearly right is not right
    assert score(Partial(), [Example("1+2=", "3")], ["3"])["eval/accuracy"] == 0.0


def test_running_sum_hand_values_and_lengths(tok):
    task = make_task("running_sum")
    ex = Example("a:3,5,7,2=", "3+5=8,8+7=15,15+2=17")
    assert make_task("running_sum", num_numbers=4)._scratchpad([3, 5, 7, 2]) == ex.answer
    assert task.reward(ex, "3+5=8,8+7=15,15+2=17") == 1.0
    assert task.reward(ex, " 3+5=8,8+7=15,15+2=17 ") == 1.0
    assert task.reward(ex, "3+5=8,8+7=15,15+2=18") == 0.0  # last partial sum wrong
    assert task.reward(ex, "3+5=8,8+7=16,16+2=18") == 0.0  # consistent, but wrong from step 2
    assert task.format_ok("3+5=8,8+7=15,15+2=17")  # any number of steps
    assert task.format_ok("3+5=8,8+7=15") and not task.format_ok("3+5=8,") \
        and not task.format_ok("17")
    # "a:9,9,9,9,9,9,9,9,9,9=" and "9+9=18,18+9=27,...,81+9=90": 6 + 8 * 7 + 8 commas
    assert (task.max_prompt_chars, task.max_answer_chars) == (22, 70)
    rng = random.Random(0)
    lengths = []
    for _ in range(2000):
        ex = task.sample(rng)
        assert len(ex.prompt) == 22 and task.reward(ex, ex.answer) == 1.0
        lengths.append(len(tok.encode(ex.answer)) + 1)  # + <eos>
    assert min(lengths) >= 61 and max(lengths) <= 71
    assert sum(n >= 64 for n in lengths) / len(lengths) > 0.99
    with pytest.raises(ValueError, match="num_numbers=1"):
        make_task("running_sum", num_numbers=1)


@pytest.mark.parametrize("name,field,lo,hi", [
    ("addition", "num_digits", 1, 9), ("sort", "length", 1, 20),
    ("countdown", "num_numbers", 2, 6), ("countdown", "max_number", 1, 99),
    ("running_sum", "num_numbers", 2, 64), ("running_sum", "max_number", 1, 999)])
def test_task_kwarg_bounds_are_inclusive(name, field, lo, hi):
    """Each documented range accepts both ends and refuses one past either."""
    assert getattr(make_task(name, **{field: lo}), field) == lo
    assert getattr(make_task(name, **{field: hi}), field) == hi
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ValueError, match=f"{field}={bad} must be an int in \\[{lo}, {hi}\\]"):
            make_task(name, **{field: bad})


def test_num_prompts_hand_values():
    """sort: 10**length; running_sum: max_number**num_numbers (numbers 1..max); countdown past
    the enumeration budget (29**3 * 3**2 > 200_000): None, too many to count."""
    assert make_task("sort", length=2).num_prompts() == 100
    small = make_task("running_sum", num_numbers=2, max_number=3)
    assert small.num_prompts() == 9
    train, _, _ = make_splits(small, 9, 0, seed=0)
    assert len({ex.prompt for ex in train}) == 9
    with pytest.raises(ValueError, match="only 9 distinct prompts"):
        make_splits(small, 10, 0, seed=0)
    assert make_task("countdown", num_numbers=3, max_number=29).num_prompts() is None


def test_draw_distinct_uses_its_last_draw_and_then_gives_up():
    """A new prompt found on the last allowed draw (50 n + 10_000) counts; one draw later is
    an error naming how many were found."""
    from megatron_gspo.tasks.toy import _draw_distinct

    class Late:
        def __init__(self, at):
            self.at, self.draws = at, 0

        def sample(self, rng):
            self.draws += 1
            return Example("new" if self.draws == self.at else "old", "")

    assert [ex.prompt for ex in _draw_distinct(Late(10_050), None, 1, {"old"})] == ["new"]
    with pytest.raises(ValueError, match="found only 0 of 1 new distinct prompts in 10050 draws"):
        _draw_distinct(Late(10_051), None, 1, {"old"})


@pytest.mark.parametrize("bad", [2.0, True])
def test_make_splits_refuses_non_int_sizes(bad):
    with pytest.raises(ValueError, match=f"n_train={bad!r} must be an int >= 0"):
        make_splits(make_task("addition"), bad, 1, seed=0)


def test_score_refuses_an_empty_set():
    with pytest.raises(ValueError, match="score: no examples"):
        score(make_task("addition"), [], [])
