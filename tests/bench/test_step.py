"""bench/step.py times our policy and HF's model on the same minibatch, alternating."""

import re

import pytest

from bench import step as bench_step


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
    chunks = []
    real = bench_step.current_routing
    monkeypatch.setattr(bench_step, "current_routing",
                        lambda *a, n_chunks=1, **k: chunks.append(n_chunks) or
                        real(*a, n_chunks=n_chunks, **k))
    assert bench_step.main(["--shapes", "5x12", "--rounds", "1", "--pi-old", "24",
                            "--skip-hf"]) == 0
    assert chunks == [1, 3] * 2  # warm-up round + 1; 24 tokens = 2 rows of 12 per forward
    out = capsys.readouterr().out
    assert "ours fwd ms" not in out
    assert re.search(r"\| 5 x 12 \| \d+\.\d \| \d+\.\d \| 3 \| \d+\.\d\d \|", out)
