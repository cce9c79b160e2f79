"""Dose-response report and calibration on small synthetic inputs: per-run numbers, the 95% t
interval, the rows and printed tables, the README splice and the log-log std interpolation."""

import json
import math
import types

import pytest

from experiments.replay_dose_response import calibrate, report, run
from tests.jsonl import write_jsonl


def test_run_stats_reads_each_metric_from_its_own_key():
    """start/final eval, NaN-skipping means, first-minibatch lr0, last-quarter reward, each key."""
    import tempfile
    import pathlib

    rows = [{"step": 0, "eval/accuracy": 0.2}, {"step": 0, "eval/accuracy": 0.25}]
    flips = [0.1, 0.3, float("nan"), 0.2, 0.2, 0.2, 0.2, 0.2]
    for i, flip in enumerate(flips):
        rows.append({"step": i + 1, "train/minibatch": i % 2, "moe/flip_rate/mean": flip,
                     "moe/flip_rate_all/mean": 0.05, "policy/log_ratio/abs_mean": 0.01 * (i + 1),
                     "reward/mean": i / 10, "rollout/logprob_mismatch/mean": 0.4,
                     "rollout/routing_mismatch/mean": 0.5, "policy/clip_frac/token": 0.1 * (i % 2)})
    rows.append({"step": 8, "eval/accuracy": 0.3})
    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / "m.jsonl"
        write_jsonl(p, rows)
        s = report.run_stats(str(p))
        write_jsonl(p, rows[:1] + rows[2:-1])  # one eval only: no final eval
        assert report.run_stats(str(p)) is None
        write_jsonl(p, rows[:2])  # evals but no optimizer step
        assert report.run_stats(str(p)) is None
    assert s["start_acc"] == 0.2 and s["final_acc"] == 0.3
    assert s["flip"] == pytest.approx(1.4 / 7)  # the NaN step is skipped, not averaged in
    assert s["flip_all"] == pytest.approx(0.05)
    assert s["lr0"] == pytest.approx((0.01 + 0.03 + 0.05 + 0.07) / 4)  # minibatch 0 steps
    assert s["reward"] == pytest.approx(0.65)  # last quarter: steps 7, 8
    assert (s["lp_mm"], s["route_mm"]) == pytest.approx((0.4, 0.5))
    assert s["clip"] == pytest.approx(0.05)  # over every step, not only first minibatches
    assert math.isnan(s["route_mm_all"])  # key never logged: NaN, not 0


def test_collect_takes_only_exact_run_names_with_a_final_eval(tmp_path):
    """Dirs like grpo_n0_s0_old and runs without a final eval are left out of the report."""
    good = [{"eval/accuracy": 0.2}, {"moe/flip_rate/mean": 0.1}, {"eval/accuracy": 0.3}]
    write_jsonl(tmp_path / "grpo_n0_s0" / "metrics.jsonl", good)
    write_jsonl(tmp_path / "grpo_n0_s1_old" / "metrics.jsonl", good)
    write_jsonl(tmp_path / "gspo_n0_s0" / "metrics.jsonl", good[:2])
    write_jsonl(tmp_path / "grpo_bf16_s3" / "metrics.jsonl", good)
    write_jsonl(tmp_path / "grpo_tis_bf16_s1" / "metrics.jsonl", good)
    (tmp_path / "grpo_f10_s0").mkdir()
    runs = report.collect(str(tmp_path))
    assert {k: sorted(v) for k, v in runs.items()} == {("grpo", "n0"): [0],
                                                        ("grpo_bf16", "mm"): [3],
                                                        ("grpo_tis_bf16", "mm"): [1]}


def test_ci_uses_the_t_quantile_of_n_minus_1_degrees_of_freedom():
    """Half-width = t(0.975, n-1) * sample sd / sqrt(n); one value has no interval."""
    m, h = report.ci([0.0, 1.0, 2.0, 3.0])
    assert m == 1.5 and h == pytest.approx(3.182 * math.sqrt(5 / 3) / 2, rel=1e-12)
    m, h = report.ci([0.5])
    assert m == 0.5 and math.isnan(h)


def test_ci_t_quantile_beyond_8_degrees_of_freedom_and_nan_values():
    """n = 10 uses t(0.975, 9) = 2.262, not 1.96; a NaN value (metric not logged) gives NaN."""
    m, h = report.ci([float(i) for i in range(10)])
    assert m == 4.5 and h == pytest.approx(2.262 * math.sqrt(82.5 / 9) / math.sqrt(10))
    assert all(math.isnan(v) for v in report.ci([0.1, float("nan"), 0.2]))
    assert all(math.isnan(v) for v in report.ci([]))  # no seed: nothing to report
    xs = [float(i) for i in range(40)]  # past the table (df 39 > 30): the normal 1.96
    assert report.ci(xs)[1] == pytest.approx(1.96 * math.sqrt(136.6666666666667) / math.sqrt(40))


def test_per_arm_table_failure_stops_the_report(tmp_path, monkeypatch):
    """tools.plot_run --table failing is an error, not a silently missing table."""
    from tools import plot_run

    monkeypatch.setattr(plot_run, "main", lambda argv: 1)
    with pytest.raises(SystemExit, match="plot_run --table failed"):
        report.per_arm_table(str(tmp_path), None)


def test_rows_survive_a_level_without_a_finished_grpo_run():
    """GSPO finished at f10 but GRPO did not (crashed, still running): NaN GRPO columns."""
    runs = {("grpo", "n0"): {0: _stats(0.3)}, ("gspo", "f10"): {0: _stats(0.4)}}
    f10 = {r["level"]: r for r in report.rows(runs, {"targets": {"0.1": 0.2}})}["f10"]
    assert f10["n"] == 0 and math.isnan(f10["flip"][0]) and math.isnan(f10["gap_gspo"][0])
    assert f10["acc_gspo"][0] == 0.4
    assert "| f10 | 0.2 | 0 | nan |" in report.table(list(
        report.rows(runs, {"targets": {"0.1": 0.2}})), 0.25)


def _stats(acc, flip=0.01, clip=0.02, lr0=0.003):
    return {"start_acc": 0.25, "final_acc": acc, "flip": flip, "flip_all": flip / 2,
            "clip": clip, "lr0": lr0}


def test_rows_name_levels_like_the_runner_and_take_grpo_seeds_and_r2_at_n0():
    """f29 for target 0.29 (not f28); seeds/flip from GRPO; GSPO's own clip; R2 acc from n0."""
    runs = {("grpo", "f29"): {0: _stats(0.3, flip=0.29, clip=0.1), 1: _stats(0.4, flip=0.31)},
            ("gspo", "f29"): {0: _stats(0.5, flip=0.9, clip=0.7, lr0=0.8)},
            ("grpo_r2", "n0"): {0: _stats(0.45)}, ("grpo", "n0"): {0: _stats(0.2)},
            ("grpo", "f99"): {0: _stats(0.1)}}
    rs = {r["level"]: r for r in report.rows(runs, {"targets": {"0.29": 0.2}})}
    n0, f99, f29 = rs["n0"], rs["f99"], rs["f29"]
    assert f29["std"] == 0.2 and math.isnan(f99["std"]) and n0["std"] == 0.0  # f99: uncalibrated
    assert f29["n"] == 2 and n0["n"] == 1
    assert f29["flip"][0] == pytest.approx(0.3) and f29["clip"][0] == pytest.approx(0.06)
    assert f29["gspo_clip"][0] == 0.7 and math.isnan(f29["gspo_clip"][1])
    assert f29["acc_grpo_r2"][0] == 0.45 and f29["acc_gspo"][0] == 0.5
    assert f29["gap_grpo_r2"][0] == pytest.approx(0.15)  # seed 0 only: 0.45 - 0.3
    assert f29["gap_gspo"][0] == pytest.approx(0.2)


def test_table_prints_each_column_in_its_header_order():
    """Every number lands under its header, the std keeps 4 significant digits."""
    nan = float("nan")
    row = {"level": "f03", "std": 0.15534, "n": 1, "flip": (0.03, nan), "flip_all": (0.02, nan),
           "lr0": (0.001, nan), "clip": (0.005, nan), "gspo_clip": (0.25, nan),
           "acc_grpo": (0.3, 0.01), "acc_grpo_r2": (0.31, nan), "acc_gspo": (0.32, nan),
           "gap_grpo_r2": (0.01, nan), "gap_gspo": (0.02, nan)}
    lines = report.table([row], 0.2566).splitlines()
    assert lines[0].startswith("Cold start held-out accuracy 0.257;")
    assert lines[2].count("|") == lines[3].count("|") == lines[4].count("|") == 14
    assert lines[4] == ("| f03 | 0.1553 | 1 | 0.0300 | 0.0200 | 0.0010 | 0.0050 | 0.250 "
                        "| 0.300 ± 0.010 | 0.310 | 0.320 | 0.010 | 0.020 |")


def test_mismatch_table_is_empty_without_bf16_runs():
    """No bf16-sampler arm ran: no table (main then adds no mismatch section)."""
    assert report.mismatch_table({("grpo", "n0"): {0: _stats(0.3)}}) == ""


def test_mismatch_table_row_columns_and_unpaired_seed():
    """Each number under its header; a bf16 seed without a GRPO n0 seed has no gap (not vs 0)."""
    mm = {"lp_mm": 0.01, "route_mm": 0.02, "route_mm_all": 0.03, "lr0": 0.04, "clip": 0.05,
          "final_acc": 0.35}
    lines = report.mismatch_table({("grpo", "n0"): {0: _stats(0.3)},
                                   ("grpo_tis_bf16", "mm"): {5: mm}}).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[1].count("|") == 10
    assert lines[2] == ("| GRPO + TIS (cap 2), bf16 sampler | 1 | 0.0100 | 0.0200 | 0.0300 "
                        "| 0.0400 | 0.0500 | 0.350 | nan |")


def test_calibration_table_columns_and_targets():
    """std | flip rate | abs log-ratio per grid point, then target -> std."""
    calib = {"grid": [{"std": 0.02, "flip_rate": 0.0123, "abs_log_ratio": 0.0456}],
             "targets": {"0.01": 0.0171, "0.125": 0.05}}
    assert report.calibration_table(calib) == (
        "| noise std | flip rate (loss positions) | abs log-prob change, response tokens |\n"
        "| --- | --- | --- |\n| 0.02 | 0.0123 | 0.0456 |\n\n"
        "Interpolated stds (target flip rate -> std): 1% -> 0.0171, 12% -> 0.05.")


def test_write_readme_replaces_between_markers_and_needs_both(tmp_path):
    """Text outside the markers is kept; a README missing the end marker is refused."""
    p = tmp_path / "README.md"
    p.write_text("a\n<!-- table:dose:begin -->\nold\n<!-- table:dose:end -->\ntail\n")
    report.write_readme(str(p), "new")
    assert p.read_text() == "a\n<!-- table:dose:begin -->\nnew\n<!-- table:dose:end -->\ntail\n"
    p.write_text("a\n<!-- table:dose:begin -->\nold\n")
    with pytest.raises(ValueError, match="lacks the"):
        report.write_readme(str(p), "new")


def test_main_averages_start_accuracy_and_refuses_an_empty_root(tmp_path):
    """Header start accuracy = mean over runs; no mismatch section without bf16 runs."""
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"grid": [], "targets": {}}))
    for seed, start in ((0, 0.2), (1, 0.3)):
        write_jsonl(tmp_path / f"grpo_n0_s{seed}" / "metrics.jsonl",
                    [{"eval/accuracy": start}, {"moe/flip_rate/mean": 0.1, "train/minibatch": 0,
                                                "moe/flip_rate_all/mean": 0.1,
                                                "policy/clip_frac/token": 0.0,
                                                "policy/log_ratio/abs_mean": 0.0},
                     {"eval/accuracy": 0.4}])
    (tmp_path / "notes").mkdir()  # not a run: kept out of the per-arm table
    readme = tmp_path / "README.md"
    readme.write_text("<!-- table:q:begin -->\n<!-- table:q:end -->\n"
                      "<!-- table:q_runs:begin -->\n<!-- table:q_runs:end -->\n")
    text = report.main(str(tmp_path), str(calib), str(readme), marker="q")
    assert "Cold start held-out accuracy 0.250;" in text and "mismatch" not in text
    assert (tmp_path / "table.md").read_text() == text + "\n"
    doc = readme.read_text()
    assert doc.startswith("<!-- table:q:begin -->\n" + text + "\n<!-- table:q:end -->\n")
    runs_table = doc.split("<!-- table:q_runs:begin -->")[1]
    assert "grpo" in runs_table and "notes" not in runs_table
    headed = report.main(str(tmp_path), str(calib), cold_start="cold start runs/x [run "
                         "0123456789ab, checkpoint step 380]: start accuracy 0.2539")
    assert headed.startswith("Cold start runs/x [run 0123456789ab, checkpoint step 380]: start "
                             "accuracy 0.2539.\nCold start held-out accuracy 0.250;")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no finished runs"):
        report.main(str(empty), str(calib))


GRID = [{"std": 0.001, "flip_rate": 0.0}, {"std": 0.02, "flip_rate": 0.01},
        {"std": 0.05, "flip_rate": 0.1}]


def test_interpolate_is_log_log_between_bracketing_points():
    """flip 0.02 between (0.01, 0.02) and (0.1, 0.05): std = 0.02 * 2.5 ** log10(2)."""
    assert calibrate.interpolate(GRID, 0.02) == pytest.approx(0.02 * 2.5 ** math.log10(2))
    assert calibrate.interpolate(GRID[::-1], 0.02) == pytest.approx(0.02 * 2.5 ** math.log10(2))
    assert calibrate.interpolate(GRID, 0.01) == pytest.approx(0.02)  # on a grid point
    with pytest.raises(ValueError, match="outside the grid"):  # zero-flip point left out
        calibrate.interpolate(GRID, 0.005)
    with pytest.raises(ValueError, match="outside the grid"):
        calibrate.interpolate(GRID, 0.2)


def test_calibrate_main_writes_every_target_the_runner_reads(tmp_path, monkeypatch):
    """Default --targets == run.TARGETS (run.levels looks each up by str(t))."""
    import megatron_gspo.config.schema
    import megatron_gspo.rollout.generate
    import megatron_gspo.run.setup

    cfg = types.SimpleNamespace(seed=0, rollout=types.SimpleNamespace(
        prompts_per_batch=2, group_size=2, max_new_tokens=4, temperature=1.0))
    rt = types.SimpleNamespace(train_set=[0, 1, 2], policy=types.SimpleNamespace(
        train=lambda mode: None), sampler=None, tokenizer=None, task=None, close=lambda: None)
    monkeypatch.setattr(megatron_gspo.config.schema, "load_config", lambda *a: cfg)
    monkeypatch.setattr(megatron_gspo.run.setup, "setup_runtime", lambda *a, **k: rt)
    monkeypatch.setattr(megatron_gspo.rollout.generate, "generate_rollouts", lambda *a, **k: None)
    monkeypatch.setattr(calibrate, "measure", lambda policy, batch, std, temperature: {
        "std": std, "flip_rate": std, "abs_log_ratio": 0.0})
    out = tmp_path / "calib.json"
    assert calibrate.main(["--config", "x.yaml", "--out", str(out)]) == 0
    calib = json.loads(out.read_text())
    assert [g["std"] for g in calib["grid"]] == list(calibrate.GRID)
    assert calib["targets"] == pytest.approx({str(t): t for t in run.TARGETS})
    assert run.levels(calib, quick=False)["f03"] == pytest.approx(0.03)
