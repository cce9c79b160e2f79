"""tools/bench_step.py times our policy and HF's model on the same minibatch, alternating."""

import re

import pytest

from tools import bench_step


def test_both_models_run_each_shape_and_the_ratio_is_reported(capsys, monkeypatch):
    calls = []
    real_timed = bench_step.timed
    monkeypatch.setattr(bench_step, "timed", lambda fn: calls.append(fn.__name__) or
                        real_timed(fn))
    assert bench_step.main(["--shapes", "2x12,3x9", "--rounds", "1"]) == 0
    assert calls == ["ours", "theirs"] * 3 * 2  # 2 warm-up rounds + 1, per shape
    out = capsys.readouterr().out
    assert re.search(r"\| 2 x 12 \|( \d+\.\d \|){4} \d+\.\d\d \|", out)
    assert re.search(r"\| 3 x 9 \|", out)


def test_bad_shapes_are_refused():
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--shapes", "4by135"])
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--shapes", "4x1"])
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--skip-hf"])


def test_pi_old_table_times_one_forward_against_token_budgeted_ones(capsys, monkeypatch):
    from moe import replay

    budgets = []
    real = replay.current_routing
    monkeypatch.setattr(replay, "current_routing",
                        lambda *a, max_tokens=0, **k: budgets.append(max_tokens) or
                        real(*a, max_tokens=max_tokens, **k))
    assert bench_step.main(["--shapes", "5x12", "--rounds", "1", "--pi-old", "24",
                            "--skip-hf"]) == 0
    assert budgets == [0, 24] * 2  # warm-up round + 1
    out = capsys.readouterr().out
    assert "ours fwd ms" not in out
    assert re.search(r"\| 5 x 12 \| \d+\.\d \| \d+\.\d \| 3 \| \d+\.\d\d \|", out)
