"""experiments/long_response/run.py --plot-only: the README table from the runs' metrics, one
column per arm, every row's reducer valid, headed by where the cold start stopped."""

import os

from experiments.long_response import run as long_run
from tests.jsonl import write_metrics


def test_plot_only_writes_the_table_into_the_readme(tmp_path, monkeypatch):
    runs = tmp_path / "runs" / "long_response"
    write_metrics(runs / "sft", [{"step": 0, "eval/accuracy": 0.0},
                                 {"step": 460, "eval/accuracy": 0.297, "sft/start_accuracy": 0.297,
                                  "sft/band_step": 460.0}])
    for arm, clip in (("gspo", 0.4), ("grpo", 0.005)):
        write_metrics(runs / f"{arm}_s0", [
            {"step": 0, "eval/accuracy": 0.297},
            {"step": 4, "policy/clip_frac/token": clip, "reward/mean": 0.3,
             "response/truncated_frac": 0.02, "moe/flip_rate/layer_00": 0.002},
            {"step": 8, "policy/clip_frac/token": clip / 2, "reward/mean": 0.5,
             "response/truncated_frac": 0.05, "moe/flip_rate/layer_00": 0.004},
            {"step": 8, "eval/accuracy": 0.5 if arm == "gspo" else 0.45}])
    (tmp_path / "README.md").write_text("x\n<!-- table:main:begin -->\nSTALE-ROW\n"
                                        "<!-- table:main:end -->\n")
    monkeypatch.setattr(long_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(long_run, "HERE", str(tmp_path))
    assert long_run.main(["--plot-only", "--seeds", "0"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "STALE-ROW" not in text and "start accuracy 0.2970, entered the band at SFT step 460" in text
    assert "| | gspo | grpo |" in text
    assert "| eval accuracy, final (after 40 rollout batches) | 0.5 | 0.45 |" in text
    assert "| clipped tokens | 0.3 | 0.00375 |" in text
    assert "| truncated responses, worst batch | 0.05 | 0.05 |" in text
    assert "| train reward, last 10% of steps | 0.5 | 0.5 |" in text
    assert "| flip rate, layer 0 | 0.003 | 0.003 |" in text


def test_rerun_refuses_existing_run_dirs_before_running(tmp_path, monkeypatch, capsys):
    import pytest

    write_metrics(tmp_path / "runs" / "long_response" / "sft", [{"step": 0, "eval/accuracy": 0.3}])
    (tmp_path / "runs" / "long_response" / "sft" / "checkpoints" / "latest").mkdir(parents=True)
    (tmp_path / "runs" / "long_response" / "grpo_s1").mkdir()
    monkeypatch.setattr(long_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(long_run, "train", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit):
        long_run.main(["--seeds", "0", "1"])
    assert "run dirs exist: runs/long_response/grpo_s1;" in capsys.readouterr().err


def test_train_command_per_arm(tmp_path, monkeypatch):
    """GRPO is gspo.yaml + loss.name=grpo; each run: its seed, a fresh start, --steps when given,
    output into its own train.log."""
    import subprocess

    cmds = []

    def fake_run(cmd, cwd, check, stdout, stderr):
        stdout.write("log line\n")
        cmds.append(cmd)

    monkeypatch.setattr(long_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert long_run.train("grpo", 1, "sft", "runs/lr", 3) == os.path.join(str(tmp_path),
                                                                          "runs/lr/grpo_s1")
    long_run.train("gspo", 0, "sft", "runs/lr", None)
    gspo_yaml = os.path.join(long_run.HERE, "gspo.yaml")
    assert cmds[0][1:] == ["-m", "megatron_gspo.cli", "train", "--config", gspo_yaml,
                           "loss.name=grpo", "init_checkpoint=sft", "run_dir=runs/lr/grpo_s1",
                           "seed=1", "resume=false", "train.steps=3"]
    assert cmds[1][6:] == ["init_checkpoint=sft", "run_dir=runs/lr/gspo_s0", "seed=0",
                           "resume=false"]
    assert (tmp_path / "runs/lr/grpo_s1/train.log").read_text() == "log line\n"


def test_jobs_sets_how_many_runs_train_at_once(tmp_path, monkeypatch):
    """--jobs N gives the pool N workers; every arm x seed is trained once."""
    import concurrent.futures

    pools, jobs = [], []

    class Pool(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, max_workers):
            pools.append(max_workers)
            super().__init__(max_workers=max_workers)

    (tmp_path / "runs/long_response/sft/checkpoints/latest").mkdir(parents=True)
    monkeypatch.setattr(long_run, "ROOT", str(tmp_path))
    monkeypatch.setattr(long_run, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(long_run, "train", lambda *a: jobs.append(a[:2]) or str(tmp_path))
    monkeypatch.setattr(long_run.plot_run, "main", lambda argv: 0)
    monkeypatch.setattr(long_run, "write_table", lambda *a, **k: None)
    assert long_run.main(["--jobs", "3", "--seeds", "0", "1"]) == 0
    assert pools == [3] and sorted(jobs) == [("grpo", 0), ("grpo", 1), ("gspo", 0), ("gspo", 1)]
