"""experiments/gpu/README.md is exactly what its report script makes of results/."""

import os

from experiments.gpu import report


def test_readme_is_regenerated_from_the_results():
    with open(os.path.join(report.HERE, "README.md")) as f:
        assert f.read() == report.render(), "run: python -m experiments.gpu.report"


def test_goal_verdicts_follow_the_figures():
    train = {"rows": [{"B": 8, "T": 1024, "mfu": 0.31}], "profile": {"rows": []}}
    rollout = {"B": 64, "new_tokens": 512, "backends": {
        "lean": {"tokens_per_s": 100.0}, "megatron_engine_graphs": {"tokens_per_s": 950.0}}}
    lines = report.verdicts(train, rollout)
    assert "met; best 31.0%" in lines[0] and "not met; `megatron_engine_graphs` 9.50x" in lines[1]


def test_foreach_rows_pair_by_shape_and_skip_what_one_side_lacks():
    rows = lambda *xs: {"rows": [{"micro": m, "B": b, "T": t, "step_s": s}  # noqa: E731
                                 for m, b, t, s in xs]}
    train = rows((1, 8, 1024, 0.5), (4, 8, 1024, 1.0), (1, 2, 4096, 0.3))
    loops = rows((1, 8, 1024, 0.6), (4, 8, 1024, 1.5))
    lines = report.foreach_lines(train, loops)
    assert "| 1 x 8 x 1024 | 0.600 | 0.500 | 1.20x |" in lines
    assert "| 4 x 8 x 1024 | 1.500 | 1.000 | 1.50x |" in lines
    assert not any("4096" in line for line in lines)
    assert report.foreach_lines(train, None) == []
