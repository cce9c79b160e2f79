"""tools/plot_run.py on synthetic metrics.jsonl files with hand-computed summaries."""

import os

import numpy as np
import pytest

from tools import plot_run
from tests.jsonl import write_metrics

FIGURES = ("reward.png", "eval_accuracy.png", "clip_fraction.png", "flip_rate_layers.png",
           "flip_rate_mean.png", "flip_vs_depth.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _gspo_s0():
    """20 steps; reward "nan" at step 3; eval every 5 steps, "inf" at 19; layer_03 "nan" at 0."""
    recs = []
    for t in range(20):
        r = {"step": t, "time": 10.0 * t, "reward/mean": "nan" if t == 3 else t / 20,
             "policy/clip_frac/token": 0.01 if t % 2 == 0 else 0.03}
        if t % 5 == 0:
            r["eval/accuracy"] = 0.2 + t / 100
        if t == 19:
            r["eval/accuracy"] = "inf"
        layers = [0.1 * (l + 1) + 0.01 * (t % 2) for l in range(4)]
        for l, v in enumerate(layers):
            r[f"moe/flip_rate/layer_{l:02d}"] = "nan" if (l == 3 and t == 0) else v
        r["moe/flip_rate/mean"] = float(np.mean(layers))
        recs.append(r)
    return recs


def _gspo_s1():
    """20 steps; reward key absent at step 7; constant clip and flip rates; last eval at 19
    below the best."""
    recs = []
    for t in range(20):
        r = {"step": t, "policy/clip_frac/token": 0.02, "moe/flip_rate/mean": 0.5}
        if t != 7:
            r["reward/mean"] = t / 20 + 0.1
        if t % 5 == 0:
            r["eval/accuracy"] = 0.3 + t / 100
        if t == 19:
            r["eval/accuracy"] = 0.4
        for l in range(4):
            r[f"moe/flip_rate/layer_{l:02d}"] = 0.2 * (l + 1)
        recs.append(r)
    return recs


def _grpo_s0():
    """10 steps; no eval, no moe keys; clip fraction 0 on even steps."""
    return [{"step": t, "reward/mean": 0.5, "policy/clip_frac/token": 0.0 if t % 2 == 0 else 1e-4}
            for t in range(10)]


@pytest.fixture
def dirs(tmp_path):
    return [write_metrics(tmp_path / "gspo_s0", _gspo_s0()),
            write_metrics(tmp_path / "gspo_s1", _gspo_s1()),
            write_metrics(tmp_path / "grpo_s0", _grpo_s0())]


# hand-computed per-run statistics
S0 = {"final_reward": (0.90 + 0.95) / 2, "best_eval_acc": 0.35, "final_eval_acc": 0.35,
      "clip_frac_token": 0.02,
      "flip_rate_mean": 0.255,
      "flip_rate_layers": {0: 0.105, 1: 0.205, 2: 0.305, 3: 0.4 + 0.01 * 10 / 19}}
S1 = {"final_reward": (0.90 + 0.95) / 2 + 0.1, "best_eval_acc": 0.45, "final_eval_acc": 0.4,
      "clip_frac_token": 0.02,
      "flip_rate_mean": 0.5, "flip_rate_layers": {0: 0.2, 1: 0.4, 2: 0.6, 3: 0.8}}
G0 = {"final_reward": 0.5, "best_eval_acc": None, "final_eval_acc": None, "clip_frac_token": 5e-5,
      "flip_rate_mean": None, "flip_rate_layers": {}}


def _check_row(row, want):
    for k in ("final_reward", "best_eval_acc", "final_eval_acc", "clip_frac_token",
              "flip_rate_mean"):
        if want[k] is None:
            assert row[k] is None, k
        else:
            assert row[k] == pytest.approx(want[k], abs=1e-12), k
    assert sorted(row["flip_rate_layers"]) == sorted(want["flip_rate_layers"])
    for i, v in want["flip_rate_layers"].items():
        assert row["flip_rate_layers"][i] == pytest.approx(v, abs=1e-12), i


def test_summary_per_run(dirs):
    rows = plot_run.summarize(plot_run.load_runs(dirs))
    assert [r["label"] for r in rows] == ["gspo_s0", "gspo_s1", "grpo_s0"]
    assert [r["last_step"] for r in rows] == [19, 19, 9]
    for row, want in zip(rows, (S0, S1, G0)):
        assert row["n_seeds"] == 1
        _check_row(row, want)


def test_group_by_prefix_averages_seeds(dirs):
    runs = plot_run.load_runs(dirs, group_by_prefix=True)
    assert [r["label"] for r in runs] == ["gspo", "grpo"]
    assert len(runs[0]["seeds"]) == 2 and len(runs[1]["seeds"]) == 1
    gspo, grpo = plot_run.summarize(runs)
    assert gspo["n_seeds"] == 2
    mean = {k: (S0[k] + S1[k]) / 2 for k in ("final_reward", "best_eval_acc", "final_eval_acc",
                                             "clip_frac_token", "flip_rate_mean")}
    mean["flip_rate_layers"] = {i: (S0["flip_rate_layers"][i] + S1["flip_rate_layers"][i]) / 2
                                for i in range(4)}
    _check_row(gspo, mean)
    _check_row(grpo, G0)
    # per-step curve: only the steps both seeds logged (3 is nan in s0, 7 is absent in s1)
    steps, m, lo, hi = plot_run.series(runs[0], "reward/mean")
    want_steps = [t for t in range(20) if t not in (3, 7)]
    assert steps.tolist() == want_steps
    t = np.array(want_steps, dtype=np.float64)
    np.testing.assert_allclose(m, t / 20 + 0.05, atol=1e-12)
    np.testing.assert_allclose(lo, t / 20, atol=1e-12)
    np.testing.assert_allclose(hi, t / 20 + 0.1, atol=1e-12)


def test_main_writes_small_valid_pngs(dirs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs"
    assert plot_run.main(dirs + ["--out", str(out), "--smooth", "3"]) == 0
    for name in FIGURES:
        path = out / name
        assert path.is_file(), name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        assert path.stat().st_size < 200_000, (name, path.stat().st_size)
    text = capsys.readouterr().out
    assert "gspo_s1" in text and "grpo_s0" in text and "per-layer mean flip rate" in text
    assert "0.925" in text  # gspo_s0 final reward


def test_main_skips_figures_without_keys(dirs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "figs"
    assert plot_run.main([dirs[2], "--out", str(out), "--labels", "grpo"]) == 0
    assert sorted(os.listdir(out)) == ["clip_fraction.png", "reward.png"]
    text = capsys.readouterr().out
    assert "skipping eval_accuracy.png" in text and "skipping flip_vs_depth.png" in text


def test_missing_metrics_file_names_path(dirs, tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty_run"):
        plot_run.load_runs([dirs[0], str(empty)])
    assert plot_run.main([str(empty), "--out", str(tmp_path / "o")]) == 2
    assert str(empty / "metrics.jsonl") in capsys.readouterr().err


def test_bad_inputs_raise(dirs, tmp_path):
    with pytest.raises(ValueError, match="--labels has 1 entries"):
        plot_run.load_runs(dirs[:2], labels=["a"])
    with pytest.raises(ValueError, match="duplicate run label 'x'.*pass --labels$"):
        plot_run.load_runs(dirs[:2], labels=["x", "x"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 0}\n{oops\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        plot_run.load_runs([str(bad)])
    # a truncated final line (crash mid-write) is tolerated
    (bad / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 0.25}\n{"step": 1, "rew')
    (run,) = plot_run.load_runs([str(bad)])
    assert run["seeds"][0] == {"reward/mean": {0: 0.25}}


def test_seed_prefix_and_smooth():
    assert plot_run.seed_prefix("gspo_s0") == "gspo"
    assert plot_run.seed_prefix("grpo-seed12") == "grpo"
    assert plot_run.seed_prefix("gspo_replay_s3") == "gspo_replay"
    assert plot_run.seed_prefix("baseline") == "baseline"
    np.testing.assert_allclose(plot_run.smooth([1.0, 2.0, 3.0, 4.0], 2), [1.0, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(plot_run.smooth([1.0, 5.0], 1), [1.0, 5.0])
