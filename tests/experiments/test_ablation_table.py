"""experiments/ablation/run.py writes its result table (tools/result_table.py) into the README's
markers, headed by the machine and the cold start's band record."""

import os

from experiments.ablation import run as ablation_run
from tests.jsonl import write_metrics


def test_write_table_into_readme_markers(tmp_path, monkeypatch, capsys):
    sft = write_metrics(tmp_path / "sft", [{"step": 0, "eval/accuracy": 0.01},
                                           {"step": 870, "eval/accuracy": 0.2578,
                                            "sft/start_accuracy": 0.2578, "sft/band_step": 870.0}])
    runs = [write_metrics(tmp_path / f"{arm}_s{s}", [
        {"step": 0, "eval/accuracy": 0.2578},
        {"step": 1, "policy/clip_frac/token": clip + s / 100, "moe/flip_rate/layer_00": 0.001},
        {"step": 2, "eval/accuracy": 0.3 + s / 10}]) for arm, clip in (("gspo", 0.2), ("grpo", 0.01))
        for s in (0, 1)]
    (tmp_path / "README.md").write_text("a\n<!-- table:main:begin -->\nstale\n"
                                        "<!-- table:main:end -->\nb\n")
    monkeypatch.setattr(ablation_run, "HERE", str(tmp_path))
    ablation_run.write_table(runs, "main", sft)
    text = (tmp_path / "README.md").read_text()
    assert "stale" not in text and text.startswith("a\n<!-- table:main:begin -->\nMeasured on ")
    assert f"Cold start {sft}: start accuracy 0.2578, entered the band at SFT step 870." in text
    assert "| eval accuracy at the start (SFT checkpoint) | 0.258 ± 0 | 0.258 ± 0 |" in text
    assert "| eval accuracy, final | 0.35 ± 0.071 | 0.35 ± 0.071 |" in text
    assert "| clipped tokens | 0.205 ± 0.0071 | 0.015 ± 0.0071 |" in text
    assert "| flip rate, layer 0 | 0.001 ± 0 | 0.001 ± 0 |" in text
    assert "| policy entropy | - | - |" in text and text.endswith("<!-- table:main:end -->\nb\n")
    ablation_run.write_table(runs, "stress", sft)  # no markers for this variant: printed
    assert "note: " in capsys.readouterr().out and (tmp_path / "README.md").read_text() == text


def test_write_table_names_the_cold_start_relative_to_the_repo(tmp_path, monkeypatch):
    """The header's cold-start path drops the repo root (no machine-specific absolute path)."""
    sft = write_metrics(tmp_path / "runs" / "sft", [{"step": 5, "eval/accuracy": 0.3}])
    run = write_metrics(tmp_path / "runs" / "gspo_s0", [{"step": 0, "eval/accuracy": 0.3}])
    monkeypatch.setattr(ablation_run, "ROOT", str(tmp_path))
    (tmp_path / "README.md").write_text("<!-- table:main:begin -->\n<!-- table:main:end -->\n")
    ablation_run.write_table([run], "main", sft, readme=str(tmp_path / "README.md"))
    text = (tmp_path / "README.md").read_text()
    assert "Cold start runs/sft: no band record (accuracy 0.3000 at step 5)." in text
    assert str(tmp_path) not in text


def test_set_without_tag_is_refused_before_anything_runs(monkeypatch, capsys):
    """--set changes the runs: without --tag they would overwrite the default variant."""
    import pytest

    monkeypatch.setattr(ablation_run, "cli", lambda *a: pytest.fail("ran something"))
    with pytest.raises(SystemExit):
        ablation_run.main(["--set", "optim.lr=3e-4"])
    assert "give them a --tag" in capsys.readouterr().err


def test_plot_only_variant_paths(tmp_path, monkeypatch):
    """Profile + tag: runs and figures under ablation_gpu_small_stress, the profile's own SFT
    (no tag), README marker gpu_small_stress."""
    import pytest

    seen = {}
    monkeypatch.setattr(ablation_run, "cli", lambda *a: pytest.fail("--plot-only ran " + a[0]))
    monkeypatch.setattr(ablation_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(ablation_run, "cold_start_line", lambda d: seen.setdefault("cold", d))
    monkeypatch.setattr(ablation_run.plot_run, "main",
                        lambda argv: seen.setdefault("plot", argv) and 0)  # exit status 0
    monkeypatch.setattr(ablation_run, "write_table",
                        lambda runs, marker, sft: seen.setdefault("table", (runs, marker, sft)))
    assert ablation_run.main(["--plot-only", "--profile", "gpu-small", "--tag", "stress",
                              "--arms", "grpo", "--seeds", "0", "1"]) == 0
    runs = [os.path.join(str(tmp_path), f"runs/ablation_gpu_small_stress/grpo_s{s}")
            for s in (0, 1)]
    sft = os.path.join(str(tmp_path), "runs/ablation_gpu_small/sft")
    assert seen["cold"] == sft and seen["table"] == (runs, "gpu_small_stress", sft)
    assert seen["plot"] == [*runs, "--out", os.path.join(ablation_run.HERE,
                                                         "figures_gpu_small_stress"),
                            "--group-by-prefix"]


def _stub_runner(tmp_path, monkeypatch) -> list:
    """The runner rooted at tmp_path with its CLI calls recorded (returned), no plots or table."""
    calls = []
    monkeypatch.setattr(ablation_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(ablation_run, "cli", lambda *a: calls.append(a))
    monkeypatch.setattr(ablation_run, "cold_start_line", lambda d: "cold")
    monkeypatch.setattr(ablation_run.plot_run, "main", lambda argv: 0)
    monkeypatch.setattr(ablation_run, "write_table", lambda *a: None)
    return calls


def test_training_commands_per_arm_and_seed(tmp_path, monkeypatch):
    """Each arm's own YAML; profile overrides, then --set (later wins), then the shared cold
    start, run dir, seed, fresh start and --steps; a stale metrics.jsonl is removed first."""
    calls = _stub_runner(tmp_path, monkeypatch)
    (tmp_path / "runs/ablation_gpu_small/sft/checkpoints/latest").mkdir(parents=True)
    stale = write_metrics(tmp_path / "runs/ablation_gpu_small_t/grpo_r2_s1", [{"step": 9}])
    assert ablation_run.main(["--profile", "gpu-small", "--arms", "gspo", "grpo_r2", "--seeds",
                              "1", "--steps", "5", "--tag", "t", "--set", "optim.lr=3e-4"]) == 0
    base = ablation_run.profile_overrides("gpu-small")
    assert not os.path.exists(os.path.join(stale, "metrics.jsonl"))
    assert calls == [("train", "--config", os.path.join(ablation_run.HERE, f"{arm}.yaml"), *base,
                      "optim.lr=3e-4", "init_checkpoint=runs/ablation_gpu_small/sft",
                      f"run_dir=runs/ablation_gpu_small_t/{arm}_s1", "seed=1", "resume=false",
                      "train.steps=5") for arm in ("gspo", "grpo_r2")]


def test_an_arm_a_signal_stopped_is_resumed_and_keeps_its_metrics(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM saves the arm's checkpoint and says 'run the same command to resume';
    the runner deleted its metrics.jsonl, then asked for resume=false, which the run dir
    refuses while it holds checkpoints: the metrics were lost and the arm could not go on."""
    calls = _stub_runner(tmp_path, monkeypatch)
    (tmp_path / "runs/ablation/sft/checkpoints/latest").mkdir(parents=True)
    stopped = write_metrics(tmp_path / "runs/ablation/gspo_s0", [{"step": 9}])
    (tmp_path / "runs/ablation/gspo_s0/checkpoints").mkdir()
    (tmp_path / "runs/ablation/gspo_s0/checkpoints/latest").write_text("9\n")
    assert ablation_run.main(["--arms", "gspo", "--seeds", "0"]) == 0
    assert os.path.exists(os.path.join(stopped, "metrics.jsonl"))
    assert "resume=false" not in calls[0] and "run_dir=runs/ablation/gspo_s0" in calls[0]
