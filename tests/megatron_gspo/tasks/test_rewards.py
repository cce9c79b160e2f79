"""Reward registry: hand-checked verdicts, the per-answer time limit, error counting."""

import signal
import threading
import time

import pytest

import megatron_gspo.tasks.rewards as rewards_mod
from megatron_gspo.errors import UnknownName
from megatron_gspo.tasks.rewards import (FORMAT_CHECKS, OK, RAISED, REWARDS, TIMED_OUT,
                                   compute_rewards, countdown_reward,
                                   exact_reward, get_format_check, get_reward, math_gold_text,
                                   register_reward)
from megatron_gspo.tasks.toy import Example, make_task


def test_registry_names_and_unknown_name_lists_valid_ones():
    assert sorted(REWARDS) == ["countdown", "exact", "math"]
    with pytest.raises(KeyError, match=r"unknown reward 'bogus'; valid names: \['countdown', "
                                        r"'exact', 'math'\]"):
        get_reward("bogus")
    with pytest.raises(ValueError):  # also a ValueError, for config loaders
        get_reward("bogus")
    assert issubclass(UnknownName, ValueError)


def test_register_reward_refuses_a_second_reward_under_a_taken_name():
    """A second `register_reward("exact")` must not silently replace the exact verifier."""
    saved = REWARDS["exact"], FORMAT_CHECKS["exact"]
    try:
        with pytest.raises(ValueError, match="reward 'exact' is already registered"):
            register_reward("exact", format_check=bool)(lambda completion, truth: 1.0)
        assert REWARDS["exact"] is exact_reward and FORMAT_CHECKS["exact"] is saved[1]
    finally:
        REWARDS["exact"], FORMAT_CHECKS["exact"] = saved


def test_exact():
    assert exact_reward("357", "357") == 1.0
    assert exact_reward(" 357\n", "357") == 1.0
    assert exact_reward("358", "357") == 0.0
    assert exact_reward("72", 72) == 1.0  # a numeric ground truth compares as text
    assert exact_reward("72", " 72\n") == 1.0  # the ground truth is stripped too
    assert exact_reward("", "0") == 0.0
    with pytest.raises(TypeError, match="completion must be a str"):
        exact_reward(None, "1")
    fmt = get_format_check("exact")
    assert fmt(" 7 ") and not fmt("  ")


def test_countdown_accepts_tuple_dict_and_frozen_dict():
    for truth in [((3, 5, 7), 56), {"numbers": [3, 5, 7], "target": 56},
                  (("numbers", (3, 5, 7)), ("target", 56))]:
        assert countdown_reward("(3+5)*7", truth) == 1.0
        assert countdown_reward("7*(5+3)", truth) == 1.0
        assert countdown_reward("3+5*7", truth) == 0.0  # 38
        assert countdown_reward("(3+5)*7+0", truth) == 0.0  # an extra number
        assert countdown_reward("(3+3)*7", truth) == 0.0  # 3 twice, 5 unused
    with pytest.raises(ValueError, match="lacks"):
        countdown_reward("1+2", {"target": 3})


def test_countdown_two_number_pair_is_not_taken_for_frozen_dict_items():
    """((3, 5), 8) is (numbers, target), though its first item is a pair like a frozen
    ("numbers", ...) item; only pairs keyed by a string are read as a mapping."""
    assert countdown_reward("3+5", ((3, 5), 8)) == 1.0
    assert countdown_reward("5*3", ((3, 5), 8)) == 0.0
    assert countdown_reward("3+5", (("numbers", (3, 5)), ("target", 8))) == 1.0


def test_toy_tasks_use_the_registry_verifiers():
    add = make_task("addition")
    ex = Example("12+345=", "357")
    assert add.reward(ex, "357") == exact_reward("357", "357") == 1.0
    cd = make_task("countdown")
    ex = Example("c:3,5,7>56=", "(3+5)*7", ((3, 5, 7), 56))
    assert cd.reward(ex, "7*(3+5)") == 1.0 and cd.reward(ex, "3*5*7") == 0.0


def test_math_gold_text():
    assert math_gold_text("72") == "\\boxed{72}"
    assert math_gold_text(72) == "\\boxed{72}"
    assert math_gold_text("Natalia sold 48/2 = 24 clips.\n#### 72") == "\\boxed{72}"
    assert math_gold_text("\\boxed{\\frac{1}{2}}") == "\\boxed{\\frac{1}{2}}"
    # the text after the *last* '####' is the answer
    assert math_gold_text("first #### 5\nthen #### 72") == "\\boxed{72}"


def test_float_ground_truths_in_scientific_notation_still_match():
    """A JSON / parquet float ground truth whose str() is in scientific notation (1e-05, 1e+20)
    made every correct answer score 0 (math-verify reads '1e-05' as e - 5); it is written in
    positional notation now."""
    assert math_gold_text(1e-5) == "\\boxed{0.00001}"
    assert math_gold_text(1e20) == "\\boxed{100000000000000000000}"
    assert math_gold_text(72.0) == "\\boxed{72.0}" and math_gold_text(0.1 + 0.2) == \
        "\\boxed{0.30000000000000004}"
    pytest.importorskip("math_verify")
    reward = get_reward("math")
    assert reward("#### 0.00001", 1e-5) == 1.0 and reward("#### 0.0001", 1e-5) == 0.0
    assert reward("#### 100000000000000000000", 1e20) == 1.0


def test_unparseable_math_ground_truth_raises_instead_of_scoring_zero():
    """A ground truth math-verify cannot parse is a data error (counted by compute_rewards),
    not a silent 0.0 for every answer."""
    pytest.importorskip("math_verify")
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        get_reward("math")("#### 1", "")


# Hand-checked: (completion, ground truth, verdict).
MATH_CASES = [
    ("She has 10 + 72 = 82 apples.\n#### 82", "82", 1.0),
    ("So the answer is \\boxed{72}.", "72", 1.0),
    ("The answer is 72", "72", 1.0),  # a final number without markup
    ("#### 72.0", "72", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fraction vs decimal
    ("#### 0.5", "\\frac{1}{2}", 1.0),
    ("each pays 7.5 dollars\n#### 7.5", "7.5", 1.0),
    ("\\boxed{\\frac{15}{2}}", "7.5", 1.0),
    ("$\\dfrac{3}{4}$", "\\frac{3}{4}", 1.0),  # \dfrac == \frac
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # symbolic equality
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K gold
    ("#### 71", "72", 0.0),
    ("\\boxed{0.49}", "\\frac{1}{2}", 0.0),
    ("I think 72 but then 73", "72", 0.0),  # the last answer counts
    ("\\boxed{x^2+1}", "x^2+2x+1", 0.0),
    ("", "72", 0.0),
    ("no number here", "72", 0.0),
]


@pytest.mark.parametrize("completion,truth,verdict", MATH_CASES)
def test_math_reward_hand_checked(completion, truth, verdict):
    pytest.importorskip("math_verify")
    assert get_reward("math")(completion, truth) == verdict


def test_math_format_check():
    fmt = get_format_check("math")
    assert fmt("so \\boxed{3}") and fmt("steps\n#### 5") and fmt("#### 5")
    assert not fmt("the answer is 5") and not fmt("####") and not fmt("a #### 5")
    assert not fmt("\\boxed") and not fmt("a \\boxedtext")  # the brace is part of it


class _Task:
    reward_timeout_s = 0.3

    def __init__(self, fn):
        self.reward = fn


def _spin(example, completion):
    while True:
        pass


def test_time_limit_interrupts_a_python_loop_and_counts_it():
    task = _Task(lambda ex, c: 1.0 if c == "ok" else _spin(ex, c))
    rewards, status = compute_rewards(task, [Example("p", "a")] * 3, ["ok", "spin", "ok"])
    assert rewards == [1.0, 0.0, 1.0] and status == [OK, TIMED_OUT, OK]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind


def test_math_verify_blowup_times_out_instead_of_hanging():
    """\\boxed{9^{9^{9^{9}}}} runs for minutes without a limit (measured); here it is stopped."""
    pytest.importorskip("math_verify")
    from megatron_gspo.tasks.datasets import DatasetTask

    task = DatasetTask(reward_name="math", reward_timeout_s=0.5)
    rewards, status = compute_rewards(task, [Example("p", "1", ("1", "", "x"))] * 2,
                                      ["\\boxed{9^{9^{9^{9}}}}", "#### 1"])
    assert rewards == [0.0, 1.0] and status == [TIMED_OUT, OK]


def test_raising_or_nan_reward_scores_zero_and_is_counted():
    def reward(ex, c):
        if c == "boom":
            raise RuntimeError("verifier bug")
        return float("nan") if c == "nan" else 0.5

    rewards, status = compute_rewards(_Task(reward), [Example("p", "a")] * 3,
                                      ["fine", "boom", "nan"])
    assert rewards == [0.5, 0.0, 0.0] and status == [OK, RAISED, RAISED]
    with pytest.raises(ValueError, match="2 examples but 1 completions"):
        compute_rewards(_Task(reward), [Example("p", "a")] * 2, ["x"])


def test_outer_alarm_survives_a_reward_time_limit():
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        compute_rewards(_Task(lambda ex, c: 1.0), [Example("p", "a")], ["x"])
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.0 < left <= 30.0 and not fired
        # the time the reward took is charged to the outer alarm
        compute_rewards(_Task(lambda ex, c: time.sleep(0.2) or 1.0), [Example("p", "a")], ["x"])
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 29.0 < left < 29.85 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_outside_the_main_thread_rewards_run_without_a_limit():
    out = {}

    def run():
        out["result"] = compute_rewards(_Task(lambda ex, c: 1.0), [Example("p", "a")], ["x"])

    with pytest.warns(RuntimeWarning, match="main thread"):
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert out["result"] == ([1.0], [OK])


def test_first_three_reward_errors_are_printed_then_only_counted(monkeypatch, capsys):
    """Errors name the dataset row (meta[2], 'file:line') or else the prompt; after the third
    the process only counts them."""
    monkeypatch.setattr(rewards_mod, "_errors_seen", 0)

    def boom(ex, c):
        raise RuntimeError(f"bug {c}")

    examples = [Example("p", "a", ("7", "src", "f.jsonl:7")), Example("12+3=", "15"),
                Example("c:1,2>3=", "1+2", ((1, 2), 3)), Example("q", "a")]
    rewards, status = compute_rewards(_Task(boom), examples, ["1", "2", "3", "4"])
    assert rewards == [0.0] * 4 and status == [RAISED] * 4
    head = "reward error, scored 0 and counted in reward/errors: RuntimeError: "
    assert capsys.readouterr().out.splitlines() == [
        head + "bug 1 [f.jsonl:7]", head + "bug 2 [prompt '12+3=']",
        head + "bug 3 [prompt 'c:1,2>3='] (further errors are only counted)"]


def test_get_format_check_of_an_unknown_name_lists_the_valid_ones():
    """The format check lookup gives the same error as get_reward, not a bare KeyError."""
    with pytest.raises(UnknownName, match=r"unknown reward 'bogus'; valid names"):
        get_format_check("bogus")


def test_countdown_numbers_and_target_given_as_text_are_read_as_ints():
    """A JSON dataset may write {"numbers": ["3", ...], "target": "56"}: compared as ints."""
    assert countdown_reward("(3+5)*7", {"numbers": ["3", "5", "7"], "target": "56"}) == 1.0
    assert countdown_reward("(3+5)*7", {"numbers": ["3", "5", "7"], "target": "57"}) == 0.0


def test_infinite_reward_scores_zero_and_is_counted():
    """+-inf is not a finite reward either (not only nan)."""
    rewards, status = compute_rewards(_Task(lambda ex, c: float(c)), [Example("p", "a")] * 3,
                                      ["inf", "-inf", "0.5"])
    assert rewards == [0.0, 0.0, 0.5] and status == [RAISED, RAISED, OK]


def test_time_limit_restores_the_outer_handler_and_interval():
    """After a limited reward the previous SIGALRM handler and an outer timer's interval are
    back in place."""
    def outer(signum, frame):
        pass

    old = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0, 10.0)
        compute_rewards(_Task(lambda ex, c: 1.0), [Example("p", "a")], ["x"])
        assert signal.getsignal(signal.SIGALRM) is outer
        assert signal.getitimer(signal.ITIMER_REAL)[1] == pytest.approx(10.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_negative_time_limit_means_no_limit():
    """time_limit(-1) runs the block unlimited (as 0 / None) instead of arming a bad timer."""
    with rewards_mod.time_limit(-1.0):
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_compute_rewards_takes_the_tasks_limit_and_none_for_toy_tasks(monkeypatch):
    """timeout_s=None takes task.reward_timeout_s; a task without one (the toy tasks) gets no
    limit (0), and an explicit timeout_s wins."""
    seen = []
    real = rewards_mod.time_limit

    def spy(seconds):
        seen.append(seconds)
        return real(seconds)

    monkeypatch.setattr(rewards_mod, "time_limit", spy)
    ex = Example("1+2=", "3")
    compute_rewards(make_task("addition"), [ex], ["3"])
    compute_rewards(_Task(lambda e, c: 1.0), [ex], ["3"])
    compute_rewards(_Task(lambda e, c: 1.0), [ex], ["3"], timeout_s=2.0)
    assert seen == [0.0, 0.3, 2.0]


def test_no_limit_warning_is_given_once_per_process(monkeypatch):
    """Outside the main thread the missing limit is warned about once, not at every reward."""
    import warnings

    monkeypatch.setattr(rewards_mod, "_warned_no_limit", False)
    run = lambda: compute_rewards(_Task(lambda ex, c: 1.0), [Example("p", "a")] * 2, ["x", "y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            t = threading.Thread(target=run)
            t.start()
            t.join()
    assert [str(w.message)[:32] for w in caught] == ["reward time limit needs the main"]


def test_reward_error_of_a_non_dataset_meta_names_the_prompt(monkeypatch, capsys):
    """A 3-item meta whose last item is not a 'file:line' string is task data, not a row."""
    monkeypatch.setattr(rewards_mod, "_errors_seen", 0)

    def boom(ex, c):
        raise RuntimeError("bug")

    compute_rewards(_Task(boom), [Example("q:1", "a", (1, 2, 3))], ["x"])
    assert capsys.readouterr().out.strip().endswith("bug [prompt 'q:1']")


class _SlowTask(_Task):
    reward_batch_timeout_s = 0.7


def test_a_batch_of_answers_that_all_time_out_stays_within_the_batch_limit(capsys):
    """Scoring was serial, up to reward.timeout_s per answer, while the other ranks wait in a
    collective: 128 answers that all time out took 640 s, past its 10-minute timeout. The
    batch limit bounds the whole batch: 0.3 s + 0.3 s + the 0.1 s left, then the answers not
    reached are not run (however slow the machine, never more than three calls)."""
    calls = []

    def sleeps(example, completion):
        calls.append(completion)
        time.sleep(30)  # interrupted by the per-answer limit

    rewards, status = compute_rewards(_SlowTask(sleeps), [Example("p", "a")] * 16, ["x"] * 16)
    assert rewards == [0.0] * 16 and status == [TIMED_OUT] * 16
    assert 1 <= len(calls) <= 3, calls
    assert f"the batch time limit (0.7 s) ran out with {16 - len(calls)} of 16 answers not " \
           "scored" in capsys.readouterr().out
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_batch_limit_stays_below_the_collective_timeout():
    """reward.batch_timeout_s defaults to half of model.dist_timeout_min and may not reach it."""
    import os

    from megatron_gspo.config.schema import load_config
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.tasks.datasets import build_task
    from megatron_gspo.tasks.tokenizer import load_tokenizer

    pytest.importorskip("transformers")
    fixture = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
    cfg = load_config(None, ["task.name=dataset", f"data.train_files={fixture}/train.jsonl",
                             "reward.name=exact", "model.dist_timeout_min=4"])
    assert build_task(cfg, load_tokenizer(fixture), 512)[0].reward_batch_timeout_s == 120
    with pytest.raises(ConfigError, match=r"reward.batch_timeout_s=600: not below the collective "
                                          r"timeout model.dist_timeout_min=10 \(600 s\)"):
        load_config(None, ["reward.batch_timeout_s=600"])
