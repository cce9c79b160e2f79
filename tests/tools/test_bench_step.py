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
