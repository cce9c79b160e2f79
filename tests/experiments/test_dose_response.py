"""Dose-response runner: the run grid and the report's paired gaps on synthetic metrics."""

import math

import pytest

from experiments.replay_dose_response import report, run
from tests.jsonl import write_metrics


def test_grid_runs_r2_once_per_seed_and_the_mismatch_arms_at_noise_0():
    lv = {"n0": 0.0, "f01": 0.01, "f03": 0.03, "f10": 0.1}
    grid = run.jobs(lv, [0, 1, 2], mismatch=True)
    assert len(grid) == 3 * (4 * 2 + 1) + 3 * 3
    assert {lvl for arm, lvl, _, _ in grid if arm == "grpo_r2"} == {"n0"}
    assert {(lvl, std) for arm, lvl, std, _ in grid if arm in run.MISMATCH_ARMS} == {("mm", 0.0)}
    assert len(set(grid)) == len(grid)


def test_levels_take_the_chosen_targets_of_the_calibration():
    calib = {"targets": {"0.01": 0.015, "0.03": 0.044, "0.1": 0.155}}
    assert run.levels(calib, quick=False) == {"n0": 0.0, "f01": 0.015, "f03": 0.044,
                                              "f10": 0.155}
    assert run.levels(calib, quick=False, targets=[0.1]) == {"n0": 0.0, "f10": 0.155}
    assert run.levels(calib, quick=True) == {"n0": 0.0, "f10": 0.155}


def write_run(root, name, final_acc, flip, clip=0.01, lr0=0.002):
    d = root / name
    d.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    for step in range(1, 5):
        rows.append({"step": step, "train/minibatch": (step - 1) % 2, "moe/flip_rate/mean": flip,
                     "moe/flip_rate_all/mean": flip / 2, "policy/clip_frac/token": clip,
                     "policy/log_ratio/abs_mean": lr0 if (step - 1) % 2 == 0 else 9.0,
                     "reward/mean": 0.3, "rollout/logprob_mismatch/mean": 0.01})
    rows.append({"step": 4, "eval/accuracy": final_acc})
    write_metrics(d, rows)


def test_report_pairs_gaps_by_seed(tmp_path):
    accs = {("grpo", "n0"): (0.30, 0.34), ("grpo_r2", "n0"): (0.32, 0.40),
            ("gspo", "n0"): (0.30, 0.30), ("grpo", "f10"): (0.20, 0.26),
            ("gspo", "f10"): (0.25, 0.27)}
    for (arm, level), (a0, a1) in accs.items():
        write_run(tmp_path, f"{arm}_{level}_s0", a0, 0.1 if level == "f10" else 0.003)
        write_run(tmp_path, f"{arm}_{level}_s1", a1, 0.1 if level == "f10" else 0.003)
    write_run(tmp_path, "grpo_r3_bf16_s0", 0.36, 0.003)
    runs = report.collect(str(tmp_path))
    rs = report.rows(runs, {"targets": {"0.1": 0.17}})
    assert [r["level"] for r in rs] == ["n0", "f10"]
    n0, f10 = rs
    assert f10["std"] == 0.17 and f10["flip"][0] == pytest.approx(0.1)
    assert f10["lr0"][0] == pytest.approx(0.002)  # first minibatches only
    # R2 (run at n0 only) vs GRPO at f10, paired: gaps 0.12 and 0.14
    half = 12.706 * math.sqrt(2e-4) / math.sqrt(2)
    assert f10["gap_grpo_r2"][0] == pytest.approx(0.13)
    assert f10["gap_grpo_r2"][1] == pytest.approx(half)
    assert f10["gap_gspo"][0] == pytest.approx(0.03)
    assert n0["gap_gspo"][0] == pytest.approx(-0.02)
    text = report.table(rs, 0.25)
    assert "| f10 | 0.17 | 2 |" in text
    mm = report.mismatch_table(runs)
    assert "GRPO + R3, bf16 sampler | 1 |" in mm and mm.endswith("| 0.360 | 0.060 |")  # 0.36 - 0.30 (seed 0)


def test_a_run_a_signal_stopped_is_resumed_not_taken_as_finished(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM saves a checkpoint (and `latest`) at the current rollout batch: the
    runner took any `latest` as a finished run and reported it with fewer batches."""
    calls = []
    monkeypatch.setattr(run, "ROOT", str(tmp_path))
    monkeypatch.setattr(run, "py", lambda *a, **k: calls.append(a))
    d = tmp_path / "runs" / "grpo_n0_s0"
    (d / "checkpoints").mkdir(parents=True)
    (d / "train_config.yaml").write_text("seed: 0\ntrain:\n  steps: 50\n  eval_every: 25\n")
    (d / "metrics.jsonl").write_text('{"step": 40}\n')
    (d / "checkpoints" / "latest").write_text("20\n")
    job = ("grpo", "n0", 0.0, 0)
    run.run_one(job, "runs", [])
    assert len(calls) == 1 and (d / "metrics.jsonl").exists()  # resumed, not wiped
    (d / "checkpoints" / "latest").write_text("50\n")
    run.run_one(job, "runs", [])
    assert len(calls) == 1  # finished: skipped
