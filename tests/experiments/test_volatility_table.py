"""experiments/routing_volatility/run.py (--plot-only) writes its generated tables into the
README's markers: depth table, cold start, clip fraction and final reward per run."""

import math
import os

import pytest

from experiments.routing_volatility import run as volatility
from tests.jsonl import write_metrics


def test_plot_only_writes_generated_tables(tmp_path, monkeypatch):
    root = tmp_path / "root"
    write_metrics(root / "runs/ablation/sft", [{"step": 380, "eval/accuracy": 0.2539,
                                                "sft/start_accuracy": 0.2539,
                                                "sft/band_step": 380.0}])
    for name, flip in (("lr1e-4_n2", 0.001), ("lr1e-4_n8", 0.004)):
        recs = [{"step": 0, "eval/accuracy": 0.2539}]
        for t in range(1, 11):
            recs.append({"step": t, "reward/mean": t / 10, "policy/clip_frac/token": flip * 10,
                         "moe/flip_rate/mean": 2.5 * flip,
                         **{f"moe/flip_rate/layer_{i:02d}": flip * (i + 1) for i in range(4)}})
        write_metrics(root / f"runs/routing_volatility/qwen3-moe-tiny/{name}", recs)
    (tmp_path / "README.md").write_text("x\n<!-- table:main:begin -->\nold\n"
                                        "<!-- table:main:end -->\ny\n")
    monkeypatch.setattr(volatility, "ROOT", str(root))
    monkeypatch.setattr(volatility, "HERE", str(tmp_path))
    assert volatility.main(["--plot-only", "--presets", "qwen3-moe-tiny", "--runs", "lr1e-4_n2",
                            "lr1e-4_n8", "--out", str(tmp_path / "figs")]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "\nold\n" not in text and "One run per column (no seed spread)" in text and text.endswith("<!-- table:main:end -->\ny\n")
    assert "lr1e-4_n2       0.0025      1.00          4.00  0.0010 0.0020 0.0030 0.0040" in text
    assert ("qwen3-moe-tiny (4 MoE layers); cold start runs/ablation/sft: start accuracy "
            "0.2539, entered the band at SFT step 380:") in text
    assert ("```\nqwen3-moe-tiny (4 MoE layers), GRPO, 30 rollout batches:\nrun " in text
            and "0.0040 0.0080 0.0120 0.0160\n```" in text)  # depth table fenced as code
    assert "| | lr1e-4_n2 | lr1e-4_n8 |" in text
    assert "| token clip fraction | 0.01 | 0.04 |" in text
    assert "| final training reward (last 3 rollout batches) | 1 | 1 |" in text


def test_depth_table_columns_from_hand_worked_layers(tmp_path):
    """Logged mean flip rate (not the layer average), Spearman over depth, deepest/shallowest
    third (2 of 6 layers here), per-layer means in layer order."""
    ys = [0.002, 0.004, 0.001, 0.003, 0.005, 0.007]
    write_metrics(tmp_path / "run_a", [{"step": 1, "moe/flip_rate/mean": 0.01, **{
        f"moe/flip_rate/layer_{i:02d}": y for i, y in enumerate(ys)}}])
    line = volatility.depth_table([str(tmp_path / "run_a")]).splitlines()[1]
    # ranks of ys: 1 3 0 2 4 5, sum d^2 = 10, rho = 1 - 6*10/(6*35) = 0.714; (0.006)/(0.003) = 2
    assert line == ("run_a           0.0100      0.71          2.00  "
                    "0.0020 0.0040 0.0010 0.0030 0.0050 0.0070")
    write_metrics(tmp_path / "run_b", [{"step": 1, "moe/flip_rate/mean": 0.01, **{
        f"moe/flip_rate/layer_{i:02d}": y for i, y in enumerate([1, 2, 3, 4, 6])}}])
    line = volatility.depth_table([str(tmp_path / "run_b")]).splitlines()[1]
    assert line.split()[3] == "6.00"  # 5 layers: thirds of 5 // 3 = 1 layer, 6 / 1


def test_spearman_hand_worked():
    """rho = 1 - 6 sum d^2 / (n (n^2 - 1)) on hand-worked rankings."""
    assert volatility.spearman([0, 1, 2, 3], [0.1, 0.2, 0.4, 0.3]) == pytest.approx(0.8)
    assert volatility.spearman([0, 1, 2, 3], [0.3, 0.2, 0.1, 0.0]) == pytest.approx(-1.0)


def test_spearman_ties_share_their_mean_rank():
    """A run with no flips in any layer has no depth correlation (was rho 1.00 from ties
    broken by position); ties share ranks: [0, 0, 0, 0.1] -> ranks 1 1 1 3, rho 3/sqrt(15)."""
    assert math.isnan(volatility.spearman([0, 1, 2, 3], [0.0, 0.0, 0.0, 0.0]))
    assert volatility.spearman([0, 1, 2, 3], [0.0, 0.0, 0.0, 0.1]) == pytest.approx(3 / 15 ** 0.5)


def test_sft_checkpoint_shares_the_ablations_for_tiny_and_makes_its_own_for_deep(tmp_path,
                                                                                monkeypatch):
    """qwen3-moe-tiny reuses runs/ablation/sft; other presets SFT into their own folder."""
    calls = []
    monkeypatch.setattr(volatility, "ROOT", str(tmp_path))
    monkeypatch.setattr(volatility, "cli", lambda *a: calls.append(a))
    assert volatility.sft_checkpoint("qwen3-moe-tiny") == "runs/ablation/sft"
    deep = "runs/routing_volatility/qwen3-moe-tiny-deep/sft"
    assert volatility.sft_checkpoint("qwen3-moe-tiny-deep") == deep
    assert [a[-2:] for a in calls] == [("model.preset=qwen3-moe-tiny", "run_dir=runs/ablation/sft"),
                                       ("model.preset=qwen3-moe-tiny-deep", f"run_dir={deep}")]
    (tmp_path / deep / "checkpoints" / "latest").mkdir(parents=True)
    assert volatility.sft_checkpoint("qwen3-moe-tiny-deep") == deep and len(calls) == 2


def _stub_sweep(monkeypatch) -> list:
    """The sweep with its CLI calls recorded (returned): no SFT, plots or tables."""
    from tools import plot_run
    from tools import result_table

    calls = []
    monkeypatch.setattr(volatility, "cli", lambda *a: calls.append(a))
    monkeypatch.setattr(volatility, "sft_checkpoint", lambda preset: f"SFT-{preset}")
    monkeypatch.setattr(volatility, "depth_table", lambda dirs: "depth")
    monkeypatch.setattr(volatility, "cold_start_line", lambda d: "cold")
    monkeypatch.setattr(plot_run, "main", lambda argv: 0)
    monkeypatch.setattr(plot_run, "load_runs", lambda dirs: [])
    monkeypatch.setattr(result_table, "format_table", lambda *a, **k: "table")
    monkeypatch.setattr(result_table, "write_into", lambda *a: None)
    return calls


def test_each_sweep_run_trains_grpo_from_its_presets_cold_start(tmp_path, monkeypatch):
    """Per run: the ablation's GRPO arm, the preset, its cold start, fresh, --steps, no evals or
    checkpoints, then the sweep point's lr and minibatch count."""
    calls = _stub_sweep(monkeypatch)
    assert volatility.main(["--presets", "qwen3-moe-tiny-deep", "--runs", "lr1e-4_n8",
                            "lr3e-5_n4", "--steps", "7", "--out", str(tmp_path)]) == 0
    grpo = os.path.join(volatility.ROOT, "experiments/ablation/grpo.yaml")
    head = ("train", "--config", grpo, "model.preset=qwen3-moe-tiny-deep",
            "init_checkpoint=SFT-qwen3-moe-tiny-deep")
    tail = ("resume=false", "train.steps=7", "train.eval_every=0", "train.save_every=0")
    d = "run_dir=runs/routing_volatility/qwen3-moe-tiny-deep/"
    assert calls == [(*head, d + "lr1e-4_n8", *tail, "optim.lr=1e-4", "train.num_minibatches=8"),
                     (*head, d + "lr3e-5_n4", *tail, "optim.lr=3e-5", "train.num_minibatches=4")]


def test_a_run_a_signal_stopped_is_resumed_not_refused(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM saves a checkpoint ('run the same command to resume'); the runner's
    resume=false is refused for a run dir holding checkpoints, so the re-run stopped there."""
    monkeypatch.setattr(volatility, "ROOT", str(tmp_path))
    calls = _stub_sweep(monkeypatch)
    stopped = tmp_path / "runs/routing_volatility/qwen3-moe-tiny/lr1e-4_n8/checkpoints"
    stopped.mkdir(parents=True)
    (stopped / "latest").write_text("12\n")
    assert volatility.main(["--presets", "qwen3-moe-tiny", "--runs", "lr1e-4_n8", "lr3e-5_n4",
                            "--out", str(tmp_path / "fig")]) == 0
    assert ["resume=false" in c for c in calls] == [False, True]
