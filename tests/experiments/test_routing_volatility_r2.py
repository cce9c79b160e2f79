"""experiments/routing_volatility_r2: every candidate, lever and arm is a valid config of the
intended kind, the screen's verdict reads the last minibatch, the report pairs arms by seed."""

import pytest

from experiments.replay_dose_response.report import ci
from experiments.routing_volatility_r2 import common, report, run, screen
from megatron_gspo.config.schema import load_config
from tests.experiments.test_positive_control import _run, _write


@pytest.mark.parametrize("candidate", sorted(common.CANDIDATES))
@pytest.mark.parametrize("arm", sorted(run.ARMS))
def test_every_candidate_lever_and_arm_is_a_valid_config(candidate, arm):
    for lever in common.SCREENED[candidate]:
        cfg = load_config(common.RL_YAML, [*common.CANDIDATES[candidate],
                                           *common.LEVERS[lever], *run.ARMS[arm]])
        assert cfg.task.n_val > 0 and cfg.task.n_test > 0 and cfg.train.flip_every == 1
        assert (cfg.loss.name, cfg.train.routing_replay) == (
            arm.split("_")[0], "r2" if arm.endswith("_r2") else "off")
        assert cfg.task.name == ("running_ops" if candidate.startswith("ops") else
                                 "running_sum")
        if "top1_hard" in candidate:  # a hard gate: no router lr lever (it gets no gradient)
            assert cfg.model.preset_overrides == {"topk": 1, "moe_ffn_hidden_size": 256,
                                                  "norm_topk_prob": True}
            assert cfg.optim.router_lr_mult == 1


def _result(values: dict) -> dict:
    """A screen result whose rollout batches log `values[minibatch]` (abs_mean, past_clip)."""
    steps = [{"iteration": it, "minibatch": m,
              "policy/routing_log_ratio/abs_mean": values[m][0] + 0.01 * it,
              "policy/routing_log_ratio/past_clip": values[m][1]}
             for it in range(2) for m in values]
    return {"steps": steps}


def test_the_screen_goes_on_the_last_minibatch_over_both_thresholds():
    """Mean over the rollout batches of the last minibatch: (0.045, 0.055) -> 0.05 and 6%."""
    go = _result({1: (0.0, 0.0), 2: (0.0, 0.0), 3: (0.045, 0.06)})
    assert screen.last_minibatch(go, "policy/routing_log_ratio/abs_mean") == \
        pytest.approx(0.05)
    assert screen.goes(go)
    assert not screen.goes(_result({1: (0.9, 0.9), 3: (0.035, 0.06)}))  # an earlier one
    assert not screen.goes(_result({3: (0.5, 0.04)}))  # large, but few tokens past 0.2


def test_the_report_pairs_the_arms_of_one_setting_by_seed(tmp_path):
    root = tmp_path / "runs"
    for seed, (g, r2) in enumerate([(0.4, 0.6), (0.5, 0.8), (0.1, 0.35)]):
        _write(root / "top4" / "noise_1" / f"grpo_s{seed}" / "metrics.jsonl",
               _run(0.1, final=g))
        _write(root / "top4" / "noise_1" / f"grpo_r2_s{seed}" / "metrics.jsonl",
               _run(0.0 if seed == 2 else 0.1, final=r2))
    _write(root / "top4" / "noise_1" / "grpo_r2_s7" / "metrics.jsonl", _run(0.1))  # unpaired
    _write(root / "screen" / "top4__none" / "grpo_s0" / "metrics.jsonl", _run(0.1))  # no arm
    n, _ = report.distill(str(root), str(tmp_path / "results"))
    assert n == 7
    runs = report.collect(str(tmp_path / "results"))
    assert set(runs) == {("top4", "noise_1")}
    line = next(ln for ln in report.answer_table(runs).splitlines() if "GRPO + R2 vs" in ln)
    m, h = ci([0.2, 0.3, 0.25])
    assert f"| 3 | {m:.3f} ± {h:.3f} | yes | 1 / 0 |" in line
    row = next(ln for ln in report.arms_table(runs[("top4", "noise_1")]).splitlines()
               if ln.startswith("| GRPO + R2 |"))
    assert "| 4 | 1 / 0 |" in row  # one collapsed (train reward), none below its start
