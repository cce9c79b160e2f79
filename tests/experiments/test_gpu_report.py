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
