"""bench/sensitivity.py times the routing-sensitivity metrics against what they ride on,
alternating, and reports the ratios."""

import re

import pytest

from bench import sensitivity as bench_sensitivity


def test_both_costs_are_timed_alternating_and_their_ratios_reported(capsys, monkeypatch):
    from megatron_gspo.algo import sensitivity

    calls = []
    real = sensitivity.route_sensitivity
    monkeypatch.setattr(sensitivity, "route_sensitivity",
                        lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    assert bench_sensitivity.main(["--rounds", "1", "--fraction", "0.5", "--set",
                                   "model.preset=tiny", "--set", "rollout.prompts_per_batch=4",
                                   "--set", "rollout.group_size=2"]) == 0
    assert calls == [0.5, 0.5]  # a warm-up round and a timed one
    out = capsys.readouterr().out
    assert "tiny (2 MoE layers), 8 sequences per rollout batch" in out
    assert re.search(r"\| route sensitivity \(3 forwards, fraction 0.5\) \| \d+\.\d{3} s \| "
                     r"one RL iteration \| \d+\.\d{3} s \| \d+\.\d\d \|", out)
    assert re.search(r"\| flip \"after\" forward with the router margin \| \d+\.\d ms \| "
                     r"without \| \d+\.\d ms \| \d+\.\d{3} \|", out)
    assert "| the margin's share of an iteration (4 measured steps) |" in out


def test_bad_arguments_are_refused():
    for argv in (["--rounds", "0"], ["--fraction", "0"], ["--fraction", "1.5"]):
        with pytest.raises(SystemExit):
            bench_sensitivity.parse_args(argv)
