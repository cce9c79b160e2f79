"""bench/sampling.py: both placements timed, alternating, in a table with their ratio."""

import re

import pytest

from bench import sampling as bench_sampling


def test_both_placements_alternate_and_the_report_has_their_ratio(capsys, monkeypatch):
    order = []
    real = bench_sampling.timed_step
    monkeypatch.setattr(bench_sampling, "timed_step", lambda logits, where, *a: order.append(
        (where, tuple(logits.shape))) or real(logits, where, *a))
    assert bench_sampling.main(["--batch", "3", "--vocab", "50", "--steps", "2", "--warmup", "1",
                                "--top-p", "0.9"]) == 0
    assert order == [("device", (3, 50)), ("host", (3, 50))] * 3
    out = capsys.readouterr().out
    for where in ("device", "host"):
        assert re.search(rf"\| {where} \| \d+\.\d{{3}} \| \d+\.\d{{3}} \|", out)
    assert re.search(r"median step, host / device: \d+\.\d\d", out)


def test_bad_sizes_are_named():
    with pytest.raises(SystemExit):
        bench_sampling.parse_args(["--vocab", "0"])
