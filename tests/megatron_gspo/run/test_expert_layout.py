"""Runs whose checkpoints hold megatron's per-expert expert weights (`SequentialMLP`: what runs
wrote before the stacked expert weights of `moe.model.experts`): resume and export read them as they
are; the distributed optimizer's state, laid out by the old parameters, is refused in one line
naming the way on, which works (docs/checkpoints.md)."""

import functools

import pytest
from megatron.core.transformer.moe.experts import SequentialMLP

import moe.model.policy
from megatron_gspo.cli import main
from moe.model.gpt import build_gpt_moe
from tests.megatron_gspo.run.test_faults import TINY, one_line_error


@pytest.fixture
def per_expert(monkeypatch):
    """Until `undo()`: policies are built with megatron's per-expert experts."""
    monkeypatch.setattr(moe.model.policy, "build_gpt_moe",
                        functools.partial(build_gpt_moe, experts=SequentialMLP))
    return monkeypatch


def test_a_per_expert_run_resumes_and_exports(tmp_path, capsys, per_expert):
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=1"]) == 0
    per_expert.undo()
    capsys.readouterr()
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=2"]) == 0
    out_text = capsys.readouterr().out
    assert "[  2/2]" in out_text and "[  1/2]" not in out_text  # resumed after step 1
    assert (run / "checkpoints" / "latest").read_text().strip().endswith("2")
    assert main(["export", "--run-dir", str(run), "--to-hf", str(out)]) == 0
    assert (out / "config.json").is_file()


def test_a_per_expert_distributed_optimizer_run_is_one_line_naming_the_way_on(
        tmp_path, capsys, per_expert):
    run, new = tmp_path / "run", tmp_path / "new"
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=1",
                 "optim.distributed=true"]) == 0
    per_expert.undo()
    latest = (run / "checkpoints" / "latest").read_text()
    capsys.readouterr()
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=2",
                         "optim.distributed=true")
    assert "written with per-expert expert weights (before the stacked ones)" in err
    assert f"start a new run_dir with init_checkpoint={run} (weights only)" in err
    assert (run / "checkpoints" / "latest").read_text() == latest
    assert main(["train", *TINY, f"run_dir={new}", f"init_checkpoint={run}", "train.steps=1",
                 "optim.distributed=true"]) == 0
