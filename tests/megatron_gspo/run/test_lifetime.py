"""One run lifetime for both jobs (megatron_gspo.run.loop): RL and SFT resume, preempt and finish
through the same loop, end to end from the CLI on the tiny model. The loop's decisions one by one
are in test_loop.py."""

import json
import os
import signal

import pytest
import torch

from megatron_gspo.cli import main
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs.rl import Trainer, TrainerState
from megatron_gspo.jobs.sft import SFTJob, SFTState
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run import loop, setup
from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.run.test_faults import TINY, digit_first

ARGS = [*TINY, "train.steps=3", "sft.steps=3", "train.eval_every=2", "sft.eval_every=2"]
JOBS = {"train": (Trainer, "rollout batch", "train.steps", "rollout batches"),
        "sft": (SFTJob, "SFT step", "sft.steps", "SFT steps")}


@pytest.fixture
def learnable(monkeypatch):
    """Every run's task rewards a leading digit (groups with reward variance, so RL moves)."""
    real = setup.build_task

    def build_task(*args, **kwargs):
        task, *splits = real(*args, **kwargs)
        object.__setattr__(task, "reward", digit_first)  # a frozen dataclass
        return task, *splits

    monkeypatch.setattr(setup, "build_task", build_task)


@pytest.fixture
def loops(monkeypatch) -> list:
    """The jobs `RunLoop.run` ran, by class name, in order."""
    ran, real = [], loop.RunLoop.run
    monkeypatch.setattr(loop.RunLoop, "run", lambda self: ran.append(
        type(self.job).__name__) or real(self))
    return ran


def sigterm_during(monkeypatch, job_class, step: int) -> None:
    """SIGTERM to this process during step `step` (1-based) of a `job_class` run."""
    real, calls = job_class.iteration, []

    def iteration(self):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(job_class, "iteration", iteration)


def rows(run_dir) -> list[dict]:
    """metrics.jsonl without wall-clock values (times, throughput)."""
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(("time/", "perf/"))}
            for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]


def resume(kind: str, run_dir):
    """The job of `kind` on `run_dir` with its loop built: resumed from its newest checkpoint."""
    cfg = load_config(None, [*ARGS, f"run_dir={run_dir}"])
    if kind == "train":
        return Trainer.from_config(cfg)
    rt = setup.setup_runtime(cfg, job="sft")
    job = SFTJob(rt)
    job.loop = loop.RunLoop(rt, job)
    return job


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_a_sigterm_saves_and_exits_128_plus_it_and_the_rerun_matches_an_uninterrupted_run(
        tmp_path, capsys, monkeypatch, learnable, loops, kind):
    """Both jobs, the same loop: SIGTERM during step 2 of 3 saves step 2 and exits with
    128 + SIGTERM and one line; the same command resumes (a row logged after the checkpoint is
    dropped, no step logged twice) and ends with the rows, weights and job state of an
    uninterrupted run; a third run says it already finished and trains nothing."""
    job_class, unit, key, units = JOBS[kind]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main([kind, *ARGS, f"run_dir={straight}"]) == 0
    with monkeypatch.context() as m:
        sigterm_during(m, job_class, step=2)
        code = main([kind, *ARGS, f"run_dir={cut}"])
    assert code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == (
        f"megatron-gspo: stopped at {unit} 2 of 3; checkpoint saved in {cut}; run the same "
        "command to resume")
    assert ckpt.latest_step(str(cut / "checkpoints")) == 2
    with open(cut / "metrics.jsonl", "a") as f:  # logged after the checkpoint: dropped
        f.write(json.dumps({"step": 99, "x": 1}) + "\n")
    assert main([kind, *ARGS, f"run_dir={cut}"]) == 0
    assert loops == [job_class.__name__] * 3
    got, want = rows(cut), rows(straight)
    assert [r["step"] for r in got] == sorted({r["step"] for r in got}) and 99 not in \
        [r["step"] for r in got]
    assert any("eval/accuracy" in r for r in want[1:]) and got == want

    a, b = resume(kind, straight), resume(kind, cut)
    if kind == "train":
        assert isinstance(b.state, TrainerState) and b.state == a.state
        assert (b.state.iteration, b.state.opt_step) == (3, 6)
    else:
        assert isinstance(b.state, SFTState) and b.state.step == a.state.step == 3
        assert torch.equal(b.state.gen.get_state(), a.state.gen.get_state())
    want_w = dict(a.rt.policy.model.module.named_parameters())
    for n, p in b.rt.policy.model.module.named_parameters():
        assert torch.equal(p, want_w[n]), n
    capsys.readouterr()
    assert b.loop.run() == {}  # releases the run dir
    a.rt.close()
    assert f"{cut} already finished 3 of {key}=3 {units}; nothing to do (raise {key} to " \
           "continue it)" in capsys.readouterr().out
    assert rows(cut) == want
