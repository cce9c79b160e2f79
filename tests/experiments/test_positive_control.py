"""experiments/positive_control: the screen's statistics against float64 references, the
report's per-run numbers and pairing, the runner's arms."""

import json
import math

import pytest
import torch

from experiments.positive_control import report, run, screen
from megatron_gspo.config.schema import load_config


def test_perturbation_stats_match_a_direct_float64_count():
    g = torch.Generator().manual_seed(0)
    clean_BT = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    noisy_BT = clean_BT + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    resp_BT = torch.zeros(4, 6, dtype=torch.bool)
    resp_BT[0, 2:] = resp_BT[1, 1:3] = resp_BT[2, 5] = True  # row 3: no response
    got = screen.perturbation_stats(clean_BT.float(), noisy_BT.float(), resp_BT)
    d = [(noisy_BT[b, t] - clean_BT[b, t]).item() for b in range(4) for t in range(6)
         if resp_BT[b, t]]
    seq = [sum((noisy_BT[b, t] - clean_BT[b, t]).item() for t in range(6) if resp_BT[b, t])
           / int(resp_BT[b].sum()) for b in range(3)]
    assert got["abs_log_ratio"] == pytest.approx(sum(map(abs, d)) / len(d), rel=1e-6)
    assert got["tokens_past_grpo_clip"] == pytest.approx(sum(abs(x) > 0.2 for x in d) / len(d))
    assert got["seq_abs_log_ratio"] == pytest.approx(sum(map(abs, seq)) / 3, rel=1e-6)
    assert got["seqs_past_gspo_clip"] == pytest.approx(sum(abs(x) > 3e-4 for x in seq) / 3)


def test_at_flip_rate_interpolates_log_log_and_is_nan_outside():
    grid = [{"flip_rate": 0.05, "v": 0.01}, {"flip_rate": 0.2, "v": 0.04},
            {"flip_rate": 0.0, "v": 0.0}]
    want = math.exp(math.log(0.01) + 0.5 * (math.log(0.04) - math.log(0.01)))
    assert screen.at_flip_rate(grid, "v", 0.1) == pytest.approx(want)
    assert math.isnan(screen.at_flip_rate(grid, "v", 0.5))


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(reward_last: float, start=0.3, final=0.5, lr0=0.0):
    rows = [{"step": 0, "test/accuracy": start, "eval/accuracy": 0.9}]
    for step in range(1, 9):
        r = reward_last if step > 6 else 0.2
        rows.append({"step": step, "reward/mean": r, "train/minibatch": (step - 1) % 2,
                     "policy/clip_frac/token": 0.1, "policy/log_ratio/abs_mean": lr0,
                     "rollout/routing_mismatch/mean": 0.25})
    rows.append({"step": 8, "test/accuracy": final})
    return rows


def test_run_stats_reads_the_test_split_and_calls_a_dead_last_quarter_a_collapse(tmp_path):
    _write(tmp_path / "a" / "metrics.jsonl", _run(0.0, final=0.0, lr0=0.05))
    _write(tmp_path / "b" / "metrics.jsonl", _run(0.05))
    a = report.run_stats(str(tmp_path / "a" / "metrics.jsonl"))
    b = report.run_stats(str(tmp_path / "b" / "metrics.jsonl"))
    assert (a["split"], a["start"], a["final"], a["collapsed"]) == ("test", 0.3, 0.0, True)
    assert b["collapsed"] is False and b["final"] == 0.5
    assert a["lr0"] == pytest.approx(0.05) and a["route_mm"] == pytest.approx(0.25)


def test_the_arms_table_pairs_each_arm_with_grpo_at_its_level_by_seed(tmp_path):
    """Runs distilled into results/ JSON, then paired by seed with GRPO at the same level."""
    lever = tmp_path / "engine"
    for seed, (g, r3) in enumerate([(0.4, 0.6), (0.5, 0.8), (0.1, 0.2)]):
        _write(lever / f"grpo_n0.3_s{seed}" / "metrics.jsonl", _run(0.1, final=g))
        _write(lever / f"grpo_r3_n0.3_s{seed}" / "metrics.jsonl", _run(0.1, final=r3))
    _write(lever / "grpo_r3_n0.3_s7" / "metrics.jsonl", _run(0.1, final=1.0))  # unpaired
    assert report.distill(str(tmp_path), str(tmp_path / "results")) == 7
    runs = report.collect(str(tmp_path / "results" / "engine"))
    assert set(runs) == {("grpo", 0.3), ("grpo_r3", 0.3)}
    line = next(ln for ln in report.arms_table(runs, {}).splitlines() if "GRPO + R3" in ln)
    diffs = [0.2, 0.3, 0.1]
    m, h = report.ci(diffs)
    assert f"{m:.3f} ± {h:.3f}" in line and "| 4 |" in line


@pytest.mark.parametrize("arm", sorted(run.ARMS))
@pytest.mark.parametrize("lever", sorted(run.LEVERS))
def test_every_arm_and_lever_is_a_valid_config(arm, lever):
    key, how = run.LEVERS[lever]
    cfg = load_config(run.os.path.join(run.HERE, "rl.yaml"),
                      [*run.ARMS[arm], *how, f"{key}=0.3"])
    assert cfg.task.n_val > 0 and cfg.task.n_test > 0  # the band reads validation
    assert (cfg.rollout.use_sampler_logprobs, cfg.train.routing_replay) == (
        "_sl" in arm, "r3" if arm.endswith("r3") else "r2" if arm.endswith("r2") else "off")


def test_the_rescore_series_pairs_both_test_accuracies(tmp_path):
    """Runs that logged `test/accuracy_trainer` keep it at the first and last step; the rescore
    answer pairs R3 with its arm by seed through the engine and through the trainer's
    decoder, and a final below the start counts as the second kind of collapse."""
    from experiments.positive_control import rescore

    lever = tmp_path / "engine"
    for seed, (sl, r3) in enumerate([(0.1, 0.5), (0.2, 0.5), (0.1, 0.6)]):
        for arm, final in (("gspo_sl", sl), ("gspo_sl_r3", r3)):
            rows = _run(0.1, final=final)
            rows[0]["test/accuracy_trainer"] = 0.4
            rows[-1]["test/accuracy_trainer"] = final + 0.2
            _write(lever / f"{arm}_n0.3_s{seed}" / "metrics.jsonl", rows)
    assert report.distill(str(tmp_path), str(tmp_path / "results")) == 6
    runs = report.collect(str(tmp_path / "results" / "engine"))
    assert runs[("gspo_sl", 0.3)][0]["final_trainer"] == pytest.approx(0.3)
    assert runs[("gspo_sl", 0.3)][0]["below_start"] is True  # 0.1 < 0.3
    line = next(ln for ln in rescore.answer_table(runs).splitlines() if "GSPO + R3" in ln)
    m, h = report.ci([0.4, 0.3, 0.5])
    assert line.count(f"{m:.3f} ± {h:.3f} | yes") == 2  # the same gaps both ways
    row = next(ln for ln in rescore.arms_table(runs).splitlines() if "| GSPO, pi_old" in ln)
    assert "| 3 | 0 / 3 | 0.300 ± 0.000 / 0.400 ± 0.000 |" in row
