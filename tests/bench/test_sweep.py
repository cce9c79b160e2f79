"""bench/sweep.py: ratios, table and figure from side-by-side summaries (no model runs)."""

import os

import pytest

from bench import sweep as bench_sweep
from bench.throughput import NoStopTokenizer, parse_args


def summary(rollout_tps, train_tps, old_s, train_s):
    best = {"rollout_tps": rollout_tps, "train_tps": train_tps, "old_s": old_s,
            "train_s": train_s}
    return {"best": best, "rollout_tps": 0.0}  # the sweep reads only the best iteration


def point(length, ours_rollout):
    res = {"ours": summary(ours_rollout, 300.0, 0.5, 2.0), "trl": summary(200.0, 150.0, 1.0, 4.0),
           "flip": summary(ours_rollout, 250.0, 0.5, 3.0)}
    return {"prompts": 4, "group": 4, "length": length, "res": res,
            "ratios": bench_sweep.ratios(res)}


def test_ratios_are_ours_over_trl_and_flip_over_plain():
    r = point(8, 100.0)["ratios"]
    assert r == {"rollout": 0.5, "train": 2.0, "pi_old": 2.0, "flip_cost": 1.5}


def test_table_and_small_png(tmp_path):
    points = [point(8, 100.0), point(32, 400.0)]
    text = bench_sweep.table(points)
    assert "| 4x4 (16) | 8 | 0.50 | 2.00 | 2.00 | 1.50 | 100 | 200 | 300 | 150 |" in text
    assert "| 4x4 (16) | 32 | 2.00 |" in text
    path = tmp_path / "sweep.png"
    bench_sweep.plot(points, str(path))
    assert 0 < os.path.getsize(path) < 200_000


@pytest.mark.parametrize("argv", [["--batches", "3x3"], ["--lengths", "8,x"],
                                  ["--lengths", "0"]])
def test_bad_sweep_arguments_exit_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit):
        bench_sweep.parse_args(argv)
    assert "--" in capsys.readouterr().err


def test_forced_length_tokenizer_has_no_stop_ids():
    from megatron_gspo.tasks.toy import CharTokenizer

    tok = NoStopTokenizer(CharTokenizer())
    assert tok.stop_ids == frozenset() and tok.eos_id == CharTokenizer().eos_id
    assert parse_args(["--force-length", "--flip-cost"]).force_length


def test_main_writes_the_table_between_the_readme_markers(tmp_path, monkeypatch):
    res = point(8, 100.0)["res"]
    res.update(cpu="Test CPU", versions="torch x")
    monkeypatch.setattr(bench_sweep, "run_point", lambda *a: res)
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- table:sweep_x:begin -->\nOLD\n<!-- table:sweep_x:end -->\nb\n")
    assert bench_sweep.main(["--lengths", "8", "--batches", "4x4", "--out", str(tmp_path),
                             "--readme", str(readme), "--marker", "sweep_x"]) == 0
    text = readme.read_text()
    assert "OLD" not in text and "machine: Test CPU, device cpu; torch threads 1; torch x;" in text
    assert "| 4x4 (16) | 8 | 0.50 | 2.00 | 2.00 | 1.50 |" in text and text.endswith("end -->\nb\n")


def test_ours_alone_gives_model_tflops_and_mfu():
    """--skip-trl (a GPU sweep): no TRL ratios; train model TFLOP/s = best train tokens/s x
    FLOPs per token, MFU against --peak-tflops."""
    from bench.throughput_table import model_flops_line

    res = {"ours": summary(100.0, 2000.0, 0.5, 2.0), "trl": None,
           "flip": summary(100.0, 1500.0, 0.5, 3.0), "train_flops_per_token": 3_000_000_000}
    p = {"prompts": 8, "group": 8, "length": 128, "res": res, "ratios": bench_sweep.ratios(res)}
    assert p["ratios"] == {"flip_cost": 1.5}
    text = bench_sweep.ours_table([p], peak_tflops=12.0)
    assert "| 8x8 (64) | 128 | 100 | 2000 | 6 | 50.00 | 1.50 |" in text
    assert "| 6 | - |" in bench_sweep.ours_table([p], peak_tflops=None)
    line = model_flops_line(2000.0, 3_000_000_000, 12.0)
    assert "6 model TFLOP/s" in line and "MFU 50.00% of 12 TFLOP/s" in line
    assert "MFU" not in model_flops_line(2000.0, 3_000_000_000, None)
    with pytest.raises(SystemExit):
        parse_args(["--peak-tflops", "0"])
    assert bench_sweep.parse_args(["--skip-trl", "--peak-tflops", "989"]).skip_trl


def test_a_sweep_stopped_after_some_points_leaves_them_in_the_readme(tmp_path, monkeypatch):
    """gpu_session.sh's sweep runs under a time limit: each finished point is written (sweep.md,
    sweep.json, the README's table) before the next starts, headed "N of M points"; the complete
    sweep's table has no such head."""
    res = point(8, 100.0)["res"]
    res.update(cpu="Test CPU", versions="torch x")
    calls = []

    def run_point(*a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the sweep stops during its second point
        return res

    monkeypatch.setattr(bench_sweep, "run_point", run_point)
    readme = tmp_path / "README.md"
    readme.write_text("a\n<!-- table:sweep_x:begin -->\nOLD\n<!-- table:sweep_x:end -->\nb\n")
    argv = ["--lengths", "8,32", "--batches", "4x4", "--out", str(tmp_path), "--readme",
            str(readme), "--marker", "sweep_x"]
    with pytest.raises(KeyboardInterrupt):
        bench_sweep.main(argv)
    text = readme.read_text()
    assert "OLD" not in text and text.count("| 4x4 (16) |") == 1 and "| 4x4 (16) | 8 |" in text
    assert "**1 of 2 points**" in text and text.endswith("end -->\nb\n")
    assert "**1 of 2 points**" in (tmp_path / "sweep.md").read_text()
    monkeypatch.setattr(bench_sweep, "run_point", lambda *a: res)
    assert bench_sweep.main(argv) == 0
    text = readme.read_text()
    assert text.count("| 4x4 (16) |") == 2 and "points**" not in text
