"""The `running_ops` task (megatron_gspo.tasks.running_ops): hand values, lengths, bounds."""

import random

import pytest

from megatron_gspo.tasks.toy import CharTokenizer, Example, make_splits, make_task


def test_hand_values_each_operation_mod_10():
    task = make_task("running_ops", num_numbers=4)
    assert task.scratchpad("+", [3, 5, 7, 2]) == "3+5=8,8+7=5,5+2=7"
    assert task.scratchpad("-", [3, 5, 7, 2]) == "3-5=8,8-7=1,1-2=9"
    assert task.scratchpad("*", [3, 5, 7, 2]) == "3*5=5,5*7=5,5*2=0"
    ex = Example("*:3,5,7,2=", "3*5=5,5*7=5,5*2=0")
    assert task.reward(ex, " 3*5=5,5*7=5,5*2=0 ") == 1.0
    assert task.reward(ex, "3+5=8,8+7=5,5+2=7") == 0.0  # another operation's scratchpad
    assert task.format_ok("3*5=5,5-7=8") and not task.format_ok("3*5=15") \
        and not task.format_ok("3*5=5,")


def test_the_first_token_names_the_operation_and_lengths_are_fixed():
    """Default: 22-character prompts, 53-character answers (54 tokens with <eos>); each of the
    three operations is drawn, and the answer uses the one the prompt names."""
    task, tok, rng = make_task("running_ops"), CharTokenizer(), random.Random(0)
    assert (task.max_prompt_chars, task.max_answer_chars) == (22, 53)
    seen = set()
    for _ in range(600):
        ex = task.sample(rng)
        tok.encode(ex.prompt + ex.answer)
        op = ex.prompt[0]
        seen.add(op)
        assert len(ex.prompt) == 22 and len(ex.answer) == 53 and ex.prompt[1] == ":"
        assert all(step[1] == op for step in ex.answer.split(","))
        assert task.reward(ex, ex.answer) == 1.0
    assert seen == {"+", "-", "*"}
    assert make_task("running_ops", ops="*").sample(rng).prompt[0] == "*"


def test_splits_and_bounds():
    small = make_task("running_ops", num_numbers=2, ops="+-")
    assert small.num_prompts() == 200
    train, val, test = make_splits(small, 150, 30, seed=0, n_val=20)
    assert len({e.prompt for e in train + val + test}) == 200
    for kwargs, bad in (({"num_numbers": 1}, "num_numbers=1"), ({"num_numbers": 65},
                        "num_numbers=65"), ({"ops": "+/"}, "ops='\\+/'"),
                        ({"ops": "++"}, "ops='\\+\\+'"), ({"ops": ""}, "ops=''")):
        with pytest.raises(ValueError, match=bad):
            make_task("running_ops", **kwargs)
    assert make_task("running_ops", num_numbers=64).num_numbers == 64
