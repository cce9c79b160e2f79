"""tools/result_table.py (plot_run --table) on synthetic metrics.jsonl with hand-computed cells."""

import io
from importlib.metadata import version

import pytest

from tests.jsonl import write_metrics
from tools import plot_run
from tools import result_table


def _runs(tmp_path):
    """gspo: 2 seeds; evals at 0, 10, 20 (s0 0.30 0.40 0.50, s1 0.32 0.36 0.44); reward t/10
    (s1: +0.1, "nan" at t=5) at t = 0..9 written in reverse order. grpo: 1 seed, no reward."""
    def seed(evals, shift, nan_at=None):
        recs = [{"step": t, "reward/mean": "nan" if t == nan_at else t / 10 + shift}
                for t in reversed(range(10))]
        recs += [{"step": t, "eval/accuracy": a} for t, a in zip((0, 10, 20), evals)]
        return recs

    return [write_metrics(tmp_path / "gspo_s0", seed((0.30, 0.40, 0.50), 0.0)),
            write_metrics(tmp_path / "gspo_s1", seed((0.32, 0.36, 0.44), 0.1, nan_at=5)),
            write_metrics(tmp_path / "grpo_s0", [{"step": 0, "eval/accuracy": 0.2},
                                                 {"step": 5, "eval/accuracy": 0.25}])]


def test_cells_are_seed_mean_and_sample_std(tmp_path):
    runs = plot_run.load_runs(_runs(tmp_path), group_by_prefix=True)
    gspo, grpo = runs
    assert result_table.cell(gspo, "eval/accuracy", "start") == pytest.approx(
        (0.31, 0.0141421356, 2))
    assert result_table.cell(gspo, "eval/accuracy", "final") == pytest.approx(
        (0.47, 0.0424264069, 2))
    assert result_table.cell(gspo, "eval/accuracy", "best")[0] == pytest.approx(0.47)
    # reward in step order: s0 0.0..0.9; s1 0.1..1.0 without t=5 (9 values)
    assert result_table.cell(gspo, "reward/mean", "last10%")[0] == pytest.approx(0.95)
    assert result_table.cell(gspo, "reward/mean", "first20%")[0] == pytest.approx(0.1)
    assert result_table.cell(gspo, "reward/mean", "mean")[0] == pytest.approx(
        (0.45 + (5.5 - 0.6) / 9) / 2)
    assert result_table.cell(grpo, "eval/accuracy", "final") == (0.25, None, 1)
    assert result_table.cell(grpo, "reward/mean", "final") is None

    table = result_table.format_table(runs, ["eval/accuracy:final=final acc",
                                             "reward/mean:last10%"], header="HEADER")
    lines = table.splitlines()
    assert lines[0] == "HEADER" and "seeds per arm: 1, 2" in lines[1]
    assert lines[3:] == ["| | gspo | grpo |", "| --- | --- | --- |",
                         "| `eval/accuracy:start` | 0.31 ± 0.014 | 0.2 |",
                         "| final acc | 0.47 ± 0.042 | 0.25 |",
                         "| `reward/mean:last10%` | 0.95 ± 0.071 | - |"]


@pytest.mark.parametrize("spec", ["eval/accuracy", "eval/accuracy:median", ":final",
                                  "reward/mean:last%"])
def test_bad_stat_is_named(spec):
    with pytest.raises(ValueError, match="--stat " + repr(spec).replace("[", r"\[")):
        result_table.parse_stat(spec)


def test_machine_line_names_cpu_date_and_versions():
    line = result_table.machine_line(date="2026-11-23")
    with open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    assert line == (f"Measured on {cpu}, 2026-11-23, torch {version('torch')}, "
                    f"megatron-core {version('megatron-core')}.")


def test_readme_table_between_markers(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# X\nkeep\n<!-- table:main:begin -->\nold 0.164\n<!-- table:main:end -->"
                      "\ntail\n<!-- table:begin -->\nother\n<!-- table:end -->\n")
    args = [*_runs(tmp_path), "--group-by-prefix", "--table", "--readme", str(readme),
            "--marker", "main", "--stat", "eval/accuracy:final"]
    assert plot_run.main(args) == 0
    text = readme.read_text()
    printed = capsys.readouterr().out
    table = printed[printed.index("Measured on"):].rstrip("\n")
    assert text == ("# X\nkeep\n<!-- table:main:begin -->\n" + table +
                    "\n<!-- table:main:end -->\ntail\n<!-- table:begin -->\nother\n"
                    "<!-- table:end -->\n")
    assert "| `eval/accuracy:final` | 0.47 ± 0.042 | 0.25 |" in table
    assert plot_run.main([*args[:-4], "--marker", "nope"]) == 2
    assert "no <!-- table:nope:begin --> ... <!-- table:nope:end -->" in capsys.readouterr().err
    assert readme.read_text() == text  # unchanged on error
    assert plot_run.main([args[0], "--readme", str(readme)]) == 2  # --readme needs --table


def test_output_into_prints_and_writes_the_report_between_markers(tmp_path, capsys):
    from tools.result_table import output_into

    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- table:mem:begin -->\nOLD\n<!-- table:mem:end -->\ny\n")
    with output_into(str(readme), "mem"):
        print("line 1")
        print("line 2")
    assert capsys.readouterr().out.startswith("line 1\nline 2\n")
    text = readme.read_text()
    assert "OLD" not in text and "Measured on " in text
    assert "```\nline 1\nline 2\n```\n<!-- table:mem:end -->\ny\n" in text
    with output_into(None, "mem"):  # no README: printing only
        print("line 3")
    assert readme.read_text() == text and capsys.readouterr().out == "line 3\n"


def test_percent_reducers_fractional_and_zero():
    """lastP% / firstP% take a fractional P and always at least one value (P = 0 too)."""
    v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert result_table.reduce_values(v, "last12.5%") == 8.0  # ceil(1.0) = 1 value
    assert result_table.reduce_values(v, "first37.5%") == 2.0  # ceil(3.0) = 3 values
    assert result_table.reduce_values(v, "first0%") == 1.0
    assert result_table.reduce_values(v, "last0%") == 8.0
    assert result_table.parse_stat("reward/mean:last2.5%") == (
        "reward/mean", "last2.5%", "`reward/mean:last2.5%`")


def test_parse_stat_splits_on_last_colon_and_first_equals():
    """The reducer follows the key's last ':'; the label is all after the first '='."""
    assert result_table.parse_stat("a:b:final") == ("a:b", "final", "`a:b:final`")
    assert result_table.parse_stat("x:best=top = max") == ("x", "best", "top = max")
    assert result_table.parse_stat("x:final=") == ("x", "final", "`x:final`")  # empty label


def test_cell_counts_only_seeds_with_the_key(tmp_path):
    """A cell's third entry is how many seeds have the key, not the arm's seed count."""
    from tests.jsonl import write_metrics
    dirs = [write_metrics(tmp_path / "a_s0", [{"step": 0, "x": 1.0}, {"step": 1, "x": 3.0}]),
            write_metrics(tmp_path / "a_s1", [{"step": 0, "y": 1.0}]),
            write_metrics(tmp_path / "a_s2", [{"step": 0, "x": 5.0}]),
            write_metrics(tmp_path / "a_s3", [{"step": 0, "x": 10.0}])]
    (arm,) = plot_run.load_runs(dirs, group_by_prefix=True)
    assert result_table.cell(arm, "x", "final") == pytest.approx((6.0, 3.6055512755, 3))  # 3 5 10
    assert result_table.cell(arm, "y", "start") == (1.0, None, 1)


def test_table_start_row_once_and_seed_line(tmp_path):
    """A listed start stat is not duplicated; equal seed counts > 1 still report a spread."""
    from tests.jsonl import write_metrics
    dirs = [write_metrics(tmp_path / f"{arm}_s{s}", [{"step": 0, "eval/accuracy": 0.1 * (s + 1)}])
            for arm in ("a", "b") for s in (0, 1)]
    runs = plot_run.load_runs(dirs, group_by_prefix=True)
    lines = result_table.format_table(runs, ["eval/accuracy:start=start acc"],
                                      header="").splitlines()
    assert lines[0] == ""  # an empty header stays empty (no machine line)
    assert lines[1] == ("Mean ± sample standard deviation over seeds (seeds per arm: 2); "
                        "`KEY:REDUCER` as in `tools/result_table.py`.")
    assert lines[3:] == ["| | a | b |", "| --- | --- | --- |",
                         "| start acc | 0.15 ± 0.071 | 0.15 ± 0.071 |"]


@pytest.mark.parametrize("text", ["<!-- table:end -->\nx\n<!-- table:begin -->\n",
                                  "<!-- table:begin -->\nx\n", "x\n<!-- table:end -->\n"])
def test_replace_between_markers_needs_both_in_order(text):
    """A missing or out-of-order begin/end marker raises instead of mangling the file."""
    with pytest.raises(ValueError, match="no <!-- table:begin --> ... <!-- table:end --> pair"):
        result_table.replace_between_markers(text, "T")


def test_write_into_names_the_file_and_reports(tmp_path, capsys):
    """write_into's error names the unmarked file; success is printed."""
    readme = tmp_path / "R.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match=f"^{readme}: no <!-- table:m:begin -->"):
        result_table.write_into(str(readme), "T", "m")
    readme.write_text("<!-- table:m:begin -->\n<!-- table:m:end -->\n")
    result_table.write_into(str(readme), "T", "m")
    assert capsys.readouterr().out == f"wrote the table into {readme}\n"


def test_machine_line_fallbacks(monkeypatch):
    """No /proc/cpuinfo or no model name: the platform's name; a missing package is named."""
    import importlib.metadata

    def no_file(*a, **k):
        raise OSError("no cpuinfo")

    monkeypatch.setattr(result_table, "open", no_file, raising=False)
    assert result_table.cpu_name("fallback") == "fallback"
    monkeypatch.setattr(result_table, "open", lambda *a, **k: io.StringIO("processor\t: 0\n"),
                        raising=False)
    assert result_table.cpu_name("fallback") == "fallback"

    def fake_version(pkg):
        raise importlib.metadata.PackageNotFoundError(pkg)

    monkeypatch.setattr(result_table, "version", fake_version)
    assert result_table.machine_line(date="D").endswith(
        ", D, torch not installed, megatron-core not installed.")


def test_add_readme_args_defaults_to_the_tools_marker():
    """--marker defaults to the tool's own marker name; --readme to none."""
    import argparse
    ap = argparse.ArgumentParser()
    result_table.add_readme_args(ap, "bench_x")
    args = ap.parse_args([])
    assert (args.readme, args.marker) == (None, "bench_x")
    assert ap.parse_args(["--readme", "R.md", "--marker", "y"]).marker == "y"
