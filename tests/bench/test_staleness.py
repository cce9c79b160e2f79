"""bench/staleness.py measures each side in alternating blocks and reports k's ratios to the
synchronous loop (no timing asserted)."""

import re

from bench import staleness as bench_staleness


def test_both_sides_run_in_alternating_blocks_and_the_ratios_are_reported(capsys, monkeypatch):
    """Lean backend, 2 rounds of 3-iteration blocks: each side trains 6 iterations (4
    measured), blocks alternate, and the k = 1 side trained on batches one version old."""
    order, real = [], bench_staleness.build_sides

    def spy(args, tmp):
        sides = real(args, tmp)
        for k, trainer in sides.items():
            iteration = trainer.iteration

            def counted(k=k, iteration=iteration):
                order.append(k)
                return iteration()
            trainer.iteration = counted
        return sides

    monkeypatch.setattr(bench_staleness, "build_sides", spy)
    assert bench_staleness.main(["--backend", "lean", "--rounds", "2", "--block", "3",
                                 "--prompts", "2", "--group-size", "2", "--minibatches", "1",
                                 "--max-new-tokens", "2"]) == 0
    assert order == [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
    out = capsys.readouterr().out
    assert re.search(r"^\| 0 \| \d+\.\d{3} \| \d\.\d{3} \| \d\.\d{3} \| .* \| 1\.00x \| "
                     r"1\.00x \|$", out, re.M)
    assert re.search(r"^\| 1 \| \d+\.\d{3} \| \d\.\d{3} \| \d\.\d{3} \| .* \| \d+\.\d\dx \| "
                     r"\d+\.\d\dx \|$", out, re.M)
    assert "(4 measured each)" in out
