"""tools/plot_run.py input handling, summary statistics and CLI checks (mutation pass)."""

import os

import pytest

from tests.jsonl import write_metrics
from tools import plot_run


def test_read_metrics_skips_bools_and_stepless_records_and_keeps_last_duplicate(tmp_path):
    """Bools and stepless records are skipped; a repeated step keeps its last value."""
    d = write_metrics(tmp_path / "r", [{"step": 0, "x": 1.0, "flag": True},
                                       {"x": 9.0}, {"step": "nan", "x": 8.0},
                                       {"step": 0, "x": 2.0}, {"step": 1.0, "x": 3}])
    assert plot_run.read_metrics(os.path.join(d, "metrics.jsonl")) == {"x": {0: 2.0, 1: 3.0}}


def test_non_object_record_raises_naming_it(tmp_path):
    """A JSON line that is not an object is an error naming its record number."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="expected a JSON object as record 2 .* got list"):
        plot_run.load_runs([str(d)])


def test_jsonl_path_is_accepted_and_labelled_by_its_folder(tmp_path):
    """A path to metrics.jsonl itself loads that file, labelled by its folder's name."""
    d = write_metrics(tmp_path / "gspo_s3", [{"step": 4, "reward/mean": 0.5}])
    (run,) = plot_run.load_runs([os.path.join(d, "metrics.jsonl")])
    assert run["label"] == "gspo_s3" and run["seeds"] == [{"reward/mean": {4: 0.5}}]


def test_no_run_dirs_is_an_error():
    """An empty run list raises instead of producing an empty table."""
    with pytest.raises(ValueError, match="no run directories"):
        plot_run.load_runs([])


def _skewed(tmp_path):
    """3 steps: clip 0, 0, 0.3 (mean 0.1, median 0); flip mean 0.1, 0.2, 0.6 (mean 0.3);
    layers 00 and 02 only; reward 0.2, 0.4, 0.9; eval 0.5 then 0.25."""
    return write_metrics(tmp_path / "skew", [
        {"step": t, "policy/clip_frac/token": c, "moe/flip_rate/mean": f, "reward/mean": r,
         "moe/flip_rate/layer_00": f, "moe/flip_rate/layer_02": 2 * f}
        for t, c, f, r in ((0, 0.0, 0.1, 0.2), (1, 0.0, 0.2, 0.4), (2, 0.3, 0.6, 0.9))
    ] + [{"step": 0, "eval/accuracy": 0.5}, {"step": 2, "eval/accuracy": 0.25}])


def test_summary_means_are_means_not_medians(tmp_path):
    """Clip fraction and flip rate are means over steps (skewed values tell mean from median)."""
    (row,) = plot_run.summarize(plot_run.load_runs([_skewed(tmp_path)]))
    assert row["clip_frac_token"] == pytest.approx(0.1)
    assert row["flip_rate_mean"] == pytest.approx(0.3)
    assert row["flip_rate_layers"] == pytest.approx({0: 0.3, 2: 0.6})
    assert row["final_reward"] == pytest.approx(0.9)  # last 10% of 3 values: one
    assert (row["best_eval_acc"], row["final_eval_acc"]) == (0.5, 0.25)


def test_format_summary_exact_text(tmp_path):
    """The printed summary: every column at 4 significant digits, per-layer rates at 3."""
    runs = plot_run.load_runs([_skewed(tmp_path)])
    assert plot_run.format_summary(plot_run.summarize(runs)).splitlines() == [
        "label  n_seeds  last_step  final_reward  best_eval_acc  final_eval_acc  "
        "clip_frac_token  flip_rate_mean",
        "skew   1        2          0.9           0.5            0.25            "
        "0.1              0.3           ",
        "per-layer mean flip rate:",
        "  skew: L00=0.3 L02=0.6"]
    assert plot_run.format_summary([{**plot_run.summarize(runs)[0], "final_reward": 1 / 3,
                                     "flip_rate_layers": {7: 1 / 3}}]).splitlines()[1:] == [
        "skew   1        2          0.3333        0.5            0.25            "
        "0.1              0.3           ",
        "per-layer mean flip rate:", "  skew: L07=0.333"]
    rows = plot_run.summarize(runs) + [{**plot_run.summarize(runs)[0], "label": "bare",
                                        "flip_rate_layers": {}}]
    assert plot_run.format_summary(rows).splitlines()[-2:] == [  # no line for a run without
        "per-layer mean flip rate:", "  skew: L00=0.3 L02=0.6"]  # per-layer rates
    assert plot_run.seed_prefix("grpo_replay") == "grpo_replay"  # no seed suffix: kept whole


def test_layer_keys_take_the_index_from_the_name(tmp_path):
    """layer_keys sorts by the layer number in the key, gaps kept (00, 02, 10)."""
    other = write_metrics(tmp_path / "b", [{"step": 0, "moe/flip_rate/layer_10": 1}])
    runs = plot_run.load_runs([_skewed(tmp_path), other])
    assert plot_run.layer_keys(runs) == [(0, "moe/flip_rate/layer_00"),
                                         (2, "moe/flip_rate/layer_02"),
                                         (10, "moe/flip_rate/layer_10")]


def test_main_rejects_bad_smooth_and_missing_output(tmp_path, capsys):
    """--smooth 0 and a call with neither --out nor --table are usage errors (exit 2)."""
    d = _skewed(tmp_path)
    assert plot_run.main([d, "--table", "--smooth", "0"]) == 2
    assert "--smooth must be >= 1" in capsys.readouterr().err
    assert plot_run.main([d]) == 2
    assert "give --out OUT_DIR" in capsys.readouterr().err


def test_main_out_and_table_does_both(tmp_path, capsys):
    """--out with --table writes the figures and prints the summary and the table."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs"
    assert plot_run.main([_skewed(tmp_path), "--out", str(out), "--table"]) == 0
    assert (out / "reward.png").is_file()
    text = capsys.readouterr().out
    assert "per-layer mean flip rate:" in text
    assert "| `eval/accuracy:start` | 0.5 |" in text


def test_numeric_strings_count_and_stats_use_step_order(tmp_path):
    """Numeric strings are values; per-seed stats follow step order, not file order."""
    d = write_metrics(tmp_path / "r", [{"step": 5, "eval/accuracy": "0.2"},
                                       {"step": "1", "eval/accuracy": 0.6},
                                       {"step": 3, "eval/accuracy": 0.4}])
    (row,) = plot_run.summarize(plot_run.load_runs([d]))
    assert row["final_eval_acc"] == 0.2 and row["best_eval_acc"] == 0.6


def test_arm_last_step_is_over_all_seeds(tmp_path):
    """An arm's last_step is the latest step any of its seeds logged."""
    dirs = [write_metrics(tmp_path / "a_s0", [{"step": 3, "x": 1}]),
            write_metrics(tmp_path / "a_s1", [{"step": 8, "x": 1}])]
    (row,) = plot_run.summarize(plot_run.load_runs(dirs, group_by_prefix=True))
    assert row["last_step"] == 8


def test_main_table_uses_labels_and_every_stat(tmp_path, capsys):
    """--labels name the table's columns and each repeated --stat adds a row."""
    d = _skewed(tmp_path)
    assert plot_run.main([d, "--table", "--labels", "mine", "--stat", "reward/mean:final",
                          "--stat", "policy/clip_frac/token:mean=clip"]) == 0
    out = capsys.readouterr().out
    assert "| | mine |" in out and "| `reward/mean:final` | 0.9 |" in out
    assert "| clip | 0.1 |" in out


def test_same_seed_label_twice_is_an_error_when_grouping(tmp_path):
    """Two dirs named gspo_s0 are not two seeds of gspo (one seed would count twice)."""
    a = write_metrics(tmp_path / "a" / "gspo_s0", [{"step": 0, "x": 1.0}])
    b = write_metrics(tmp_path / "b" / "gspo_s0", [{"step": 0, "x": 3.0}])
    with pytest.raises(ValueError, match="duplicate run label 'gspo_s0'.*pass --labels$"):
        plot_run.load_runs([a, b], group_by_prefix=True)
    (arm,) = plot_run.load_runs([a, b], labels=["gspo_s0", "gspo_s1"], group_by_prefix=True)
    assert arm["label"] == "gspo" and len(arm["seeds"]) == 2
