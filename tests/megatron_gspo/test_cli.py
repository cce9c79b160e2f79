"""megatron_gspo.cli: argument order, exit statuses and what a finished command prints.

The command itself (`cli.run`, `megatron_gspo.run.export.export_run`) is replaced by a stub here; the
real runs behind the CLI are exercised in test_faults.py, jobs/test_rl.py, test_hf_run.py and
run/test_export.py."""

import json
import signal
from types import SimpleNamespace

import pytest

from megatron_gspo import cli
from megatron_gspo.errors import (CheckpointError, ConfigError, DataError, RunDirError,
                                  UnknownName, UserError)
from megatron_gspo.jobs.band import AccuracyBandError
from megatron_gspo.run.preempt import Preempted
from moe.platform.checks import DuplicateName, MissingDependency


@pytest.fixture
def ran(monkeypatch):
    """`ran.calls`: the (command, config) pairs `cli.main` ran; each run returns `ran.result`
    (raises it when it is an exception)."""
    ran = SimpleNamespace(calls=[], result={})

    def fake_run(command, cfg):
        ran.calls.append((command, cfg))
        if isinstance(ran.result, BaseException):
            raise ran.result
        return ran.result

    monkeypatch.setattr(cli, "run", fake_run)
    return ran


def test_overrides_may_come_before_and_after_the_config_option(ran, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("train:\n  steps: 3\nseed: 9\n")
    assert cli.main(["train", "optim.lr=0.5", "--config", str(path), "train.steps=4"]) == 0
    (command, cfg), = ran.calls
    assert (command, cfg.optim.lr, cfg.train.steps, cfg.seed) == ("train", 0.5, 4, 9)


def test_only_eval_test_and_reward_metrics_are_printed(ran, capsys):
    ran.result = {"eval/accuracy": 0.5, "reward/mean": 0.25, "train/loss": 1.0,
                  "test/accuracy": 0.375}
    assert cli.main(["eval"]) == 0
    assert json.loads(capsys.readouterr().out) == {"eval/accuracy": 0.5, "reward/mean": 0.25,
                                                   "test/accuracy": 0.375}


def test_eval_scores_the_validation_and_the_test_split(tmp_path, capsys):
    """`megatron-gspo eval` of a checkpoint: eval/... on the validation split (what a run's
    evals read), test/... on the test split; a run without a validation split scores the test
    split under both."""
    argv = ["eval", "model.preset=tiny", "task.kwargs.num_digits=1", "task.n_train=20",
            "task.n_test=6", "rollout.max_new_tokens=3", "wandb.mode=disabled",
            f"run_dir={tmp_path / 'e'}"]
    assert cli.main([*argv, "task.n_val=4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"eval/accuracy", "eval/reward_mean", "eval/format_ok", "test/accuracy",
                        "test/format_ok", "test/reward"}
    assert cli.main(argv) == 0
    legacy = json.loads(capsys.readouterr().out)
    assert legacy["eval/accuracy"] == legacy["test/accuracy"]


@pytest.mark.parametrize("error", [ConfigError("bad key"), DataError("bad row"),
                                   FileNotFoundError("no file"), RunDirError("taken"),
                                   CheckpointError("corrupt"),
                                   MissingDependency("needs pyarrow: pip install pyarrow"),
                                   UserError("out of memory in the rollout; lower ..."),
                                   UnknownName("unknown reward 'x'; valid names: ['exact']"),
                                   AccuracyBandError("sft.target_accuracy=[0.2, 0.4]: ..."),
                                   FloatingPointError("non-finite loss")])
def test_user_errors_exit_2_with_one_line(ran, capsys, error):
    ran.result = error
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err == f"megatron-gspo: error: {error}\n"


def test_every_project_error_is_one_user_error():
    """The CLI catches one base: every project error class is a UserError, and the few others
    it catches are types the project cannot subclass (moe's, the stdlib's)."""
    for cls in (ConfigError, DataError, RunDirError, CheckpointError, UnknownName,
                AccuracyBandError):
        assert issubclass(cls, UserError), cls
    assert cli.USER_ERRORS == (UserError, FileNotFoundError, MissingDependency, DuplicateName,
                               FloatingPointError)
    assert issubclass(UnknownName, KeyError) and issubclass(ConfigError, ValueError)
    assert str(UnknownName("plain 'text'")) == "plain 'text'"  # not KeyError's repr()


def test_an_unregistered_name_exits_2_before_the_command_runs(ran, capsys):
    """The CLI checks the registries' names (`megatron_gspo.run.names`) before it runs the
    command, so nothing is written."""
    assert cli.main(["train", "loss.name=ppo"]) == 2
    assert ran.calls == []
    assert capsys.readouterr().err == ("megatron-gspo: error: loss.name=ppo: unknown policy "
                                       "loss; valid: ['grpo', 'gspo', 'gspo_token']\n")


@pytest.fixture
def eval_job(monkeypatch):
    """The eval job over a stub runtime: `eval_job.closed` counts its closes, `eval_job.error`
    (when set) is what scoring the validation split raises."""
    from megatron_gspo.jobs import evaluate

    job = SimpleNamespace(closed=0, error=None)

    def close():
        job.closed += 1

    def score(rt, progress):
        if job.error is not None:
            raise job.error
        return {"eval/accuracy": 0.5}

    monkeypatch.setattr(evaluate, "setup_runtime", lambda cfg, spec: SimpleNamespace(close=close))
    monkeypatch.setattr(evaluate, "evaluate_runtime", score)
    monkeypatch.setattr(evaluate, "evaluate_test", lambda rt, step, progress: {})
    return job


def test_eval_of_untrained_weights_warns_with_the_fix(eval_job, capsys):
    """eval does not read run_dir's checkpoints: without init_checkpoint (or model.hf_path) it
    scored a fresh random init, silently; now a warning says so and names the setting."""
    assert cli.main(["eval", "run_dir=runs/x"]) == 0
    assert capsys.readouterr().err == (
        "megatron-gspo: warning: eval without init_checkpoint or model.hf_path scores untrained "
        "weights; init_checkpoint=runs/x evaluates that run\n")
    assert cli.main(["eval", "init_checkpoint=runs/x"]) == 0
    assert capsys.readouterr().err == ""


def test_eval_closes_its_runtime_however_it_ends(eval_job, capsys):
    """eval opened a runtime (sampler, an engine's memory) and never closed it; it does now,
    after its result and after an error (one line, exit 2)."""
    assert cli.main(["eval", "init_checkpoint=runs/x"]) == 0
    assert json.loads(capsys.readouterr().out) == {"eval/accuracy": 0.5}
    assert eval_job.closed == 1
    eval_job.error = ConfigError("rollout.max_new_tokens=0: too few")
    assert cli.main(["eval", "init_checkpoint=runs/x"]) == 2
    assert capsys.readouterr().err == "megatron-gspo: error: rollout.max_new_tokens=0: too few\n"
    assert eval_job.closed == 2


def test_export_runs_in_the_lifetime_of_the_jobs(monkeypatch, capsys):
    """export runs under the start-up signal handlers as the jobs do: a signal while it reads
    the checkpoint is one line and exit 128 + the signal (it was a traceback)."""
    from megatron_gspo.run import export
    from megatron_gspo.run.preempt import Interrupted

    seen = {}

    def fake_export(*args, **kwargs):
        seen["handler"] = getattr(signal.getsignal(signal.SIGTERM), "__qualname__", None)
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(export, "export_run", fake_export)
    assert cli.main(["export", "--run-dir", "r", "--to-hf", "o"]) == 128 + signal.SIGTERM
    assert seen["handler"] == "StartupSignals._raise"
    assert capsys.readouterr().err.count("\n") == 1


def test_only_rank_0_prints_the_error(ran, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    ran.result = ConfigError("bad key")
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err == ""


def test_only_rank_0_prints_the_result(ran, capsys, monkeypatch):
    """Under torchrun every data-parallel rank returns the metrics: one line, not one a rank."""
    monkeypatch.setenv("RANK", "1")
    ran.result = {"eval/accuracy": 0.5}
    assert cli.main(["train"]) == 0
    assert capsys.readouterr().out == ""


def test_preemption_exits_with_128_plus_the_signal(ran, capsys):
    ran.result = Preempted(signal.SIGTERM, "stopped at rollout batch 2 of 3")
    assert cli.main(["train"]) == 128 + signal.SIGTERM
    assert "stopped at rollout batch 2 of 3" in capsys.readouterr().err


def test_export_passes_its_options_and_refuses_a_bad_checkpoint(monkeypatch, capsys):
    from megatron_gspo.run import export

    seen = {}

    def fake_export(run_dir, out, hf_path=None, max_shard_bytes=None, plugins=()):
        seen.update(run_dir=run_dir, out=out, hf_path=hf_path, max_shard_bytes=max_shard_bytes,
                    plugins=plugins)
        if run_dir == "bad":
            raise ValueError("bad: step_000003 has no dist/ checkpoint")
        return {"files": 1}

    monkeypatch.setattr(export, "export_run", fake_export)
    assert cli.main(["export", "--run-dir", "r", "--to-hf", "o"]) == 0
    assert seen == {"run_dir": "r", "out": "o", "hf_path": None, "max_shard_bytes": 5 << 30,
                    "plugins": []}
    assert json.loads(capsys.readouterr().out) == {"files": 1}
    assert cli.main(["export", "--run-dir", "r", "--to-hf", "o", "--max-shard-bytes", "7",
                     "--plugin", "p.py"]) == 0
    assert (seen["max_shard_bytes"], seen["plugins"]) == (7, ["p.py"])
    assert cli.main(["export", "--run-dir", "bad", "--to-hf", "o"]) == 2
    assert "has no dist/ checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["export", "--run-dir", "r"])  # no --to-hf
    assert exit_.value.code == 2


def test_export_hides_megatrons_install_warnings(monkeypatch, capsys):
    """The Apex / TransformerEngine fallbacks megatron announces on import are hidden from
    export too, as from train (a successful export printed ~20 warning lines)."""
    import warnings

    from megatron_gspo.run import export

    def fake_export(*args, **kwargs):
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                      FutureWarning)  # torch's, from megatron's dist_checkpointing
        warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. "
                      "Please use `load` instead.", FutureWarning)
        return {}

    monkeypatch.setattr(export, "export_run", fake_export)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli.main(["export", "--run-dir", "r", "--to-hf", "o"]) == 0
    assert not seen
