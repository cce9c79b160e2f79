"""Instruments (megatron_gspo.jobs.instruments): the trainer calls them at fixed points, the
config's `instruments:` list turns them on and off without changing what is trained, a name
is checked before anything is written, and the `expert_load` instrument logs its keys and
files the counts of every real token."""

import json
import os
import subprocess
import sys

import pytest

from megatron_gspo import cli
from megatron_gspo.config.schema import DEFAULT_INSTRUMENTS
from megatron_gspo.jobs.instruments import INSTRUMENTS, Instrument, register_instrument
from megatron_gspo.run.metrics import read_jsonl
from moe.platform.checks import DuplicateName
from tests.megatron_gspo.jobs.trainers import BASE, make_trainer
from tests.processes import communicate_or_kill

RUN = ["train.steps=2", "train.num_minibatches=2", "train.save_every=1", "train.eval_every=1"]
TRAINED = ("policy/loss", "train/grad_norm", "reward/mean", "policy/entropy", "eval/accuracy")


class Spy(Instrument):
    """Records each rollout batch's real tokens and the hooks' order; adds `spy/...` keys."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.tokens, self.calls = [], []
        trainer.spy = self

    def on_rollout(self, batch, iteration):
        self.tokens.append(int(batch.valid_BT.sum()))
        self.calls.append(("rollout", iteration))
        return {"spy/rollout_tokens": self.tokens[-1]}

    def before_update(self, step):
        self.calls.append(("before_update", step.index, step.done.finite))
        return {}

    def on_step(self, step):
        self.calls.append(("step", step.index, step.stepped))
        return {"spy/step": step.index}

    def on_iteration(self, batch, row):
        return {"spy/saw_perf": float("perf/train_tokens_per_s" in row)}

    def on_eval(self, metrics):
        return {"spy/eval_accuracy": metrics["eval/accuracy"]}


def instruments(*names) -> str:
    return f"instruments=[{','.join(names)}]"


@pytest.mark.parametrize("pack", [True, False])
def test_expert_load_counts_every_real_token_and_the_hooks_run_in_order(
        single_process, tmp_path, monkeypatch, pack):
    """Packed and padded: `moe/expert_load/layer_XX/...` in each rollout batch's last row
    (only there), one expert_load.jsonl row per rollout batch at that row's step, counting
    each real token K times in every layer (the spy counts the batch's real tokens), its
    max / mean the row's; the hooks run in order, a plugin-style instrument after the
    built-ins sees their keys, and its eval metrics join the eval's."""
    monkeypatch.setitem(INSTRUMENTS, "spy", Spy)
    trainer = make_trainer(tmp_path, *RUN, f"train.pack={pack}",
                           instruments(*DEFAULT_INSTRUMENTS, "spy"))
    trainer.train()
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    last = [r for r in rows if r.get("train/minibatch") == 1]
    assert [r["step"] for r in last] == [2, 4]
    assert all(("moe/expert_load/layer_00/max_over_mean" in r) == (r in last) for r in rows)
    filed = read_jsonl(str(tmp_path / "run" / "expert_load.jsonl"))
    assert [f["step"] for f in filed] == [2, 4]
    preset = trainer.policy.preset
    assert [f["tokens"] for f in filed] == trainer.spy.tokens
    for f, row in zip(filed, last):
        assert len(f["load"]) == preset.num_layers
        assert all(len(layer) == preset.num_experts and sum(layer) == preset.topk * f["tokens"]
                   for layer in f["load"])
        layer0 = f["load"][0]
        assert row["moe/expert_load/layer_00/max_over_mean"] == pytest.approx(
            max(layer0) / (sum(layer0) / len(layer0)))
        assert row["spy/rollout_tokens"] == f["tokens"] and row["spy/saw_perf"] == 1.0
    assert [c[0] for c in trainer.spy.calls] == ["rollout", "before_update", "step",
                                                 "before_update", "step"] * 2
    assert [r["spy/step"] for r in rows if "spy/step" in r] == [0, 1, 2, 3]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(r["spy/eval_accuracy"] == r["eval/accuracy"] for r in evals)


def test_a_resumed_run_files_each_rollout_batch_once(single_process, tmp_path):
    """A row filed after the checkpoint a run resumes from (a crash before the next save) is
    dropped, so the resumed run's own row is the only one of its step; a run starting afresh
    moves an earlier attempt's rows aside."""
    path = tmp_path / "run" / "expert_load.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"step": 2, "time": 0, "tokens": 1, "load": [[1]]}) + "\n")
    make_trainer(tmp_path, *RUN[1:], "train.steps=1").train()
    assert read_jsonl(str(tmp_path / "run" / "expert_load.prev1.jsonl"))[0]["tokens"] == 1
    assert [f["tokens"] > 1 for f in read_jsonl(str(path))] == [True]
    with open(path, "a") as f:
        f.write(json.dumps({"step": 4, "time": 0, "tokens": 1, "load": [[1]]}) + "\n")
    make_trainer(tmp_path, *RUN).train()
    filed = read_jsonl(str(path))
    assert [f["step"] for f in filed] == [2, 4] and filed[1]["tokens"] > 1


def test_instruments_off_by_config_train_the_same_steps(single_process, tmp_path):
    """No instrument: none of their keys and no expert_load.jsonl, and the same losses, grad
    norms, rewards and evals as the run with every built-in one (their forwards are no-grad
    and draw from their own generators)."""
    with_all = make_trainer(tmp_path, *RUN, "train.route_sensitivity_every=1", name="all")
    with_all.train()
    make_trainer(tmp_path, *RUN, "train.route_sensitivity_every=1", instruments(),
                 name="none").train()
    full = read_jsonl(str(tmp_path / "all" / "metrics.jsonl"))
    bare = read_jsonl(str(tmp_path / "none" / "metrics.jsonl"))
    measured = ("moe/", "perf/", "alert/", "policy/routing_log_ratio", "time/sensitivity")
    assert any(k.startswith(measured) for r in full for k in r)
    assert not any(k.startswith(measured) for r in bare for k in r)
    assert not (tmp_path / "none" / "expert_load.jsonl").exists()
    assert [r["step"] for r in full] == [r["step"] for r in bare]
    for a, b in zip(full, bare):
        assert {k: a[k] for k in TRAINED if k in a} == {k: b[k] for k in TRAINED if k in b}


def test_an_unknown_or_repeated_instrument_is_one_line_and_exit_2(single_process, tmp_path,
                                                                 capsys):
    for given, says in (("nope", "instruments: 'nope' is not a registered instrument; valid: "),
                        ("flips,flips", "instruments: 'flips' is given twice")):
        run_dir = tmp_path / given.replace(",", "_")
        assert cli.main(["train", *BASE, f"instruments=[{given}]", f"run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megatron-gspo: error: {says}") and err.count("\n") == 1
        assert not run_dir.exists()


def test_a_second_instrument_of_a_name_is_refused_naming_both(monkeypatch):
    monkeypatch.setitem(INSTRUMENTS, "spy", Spy)
    with pytest.raises(DuplicateName, match=r"instrument 'spy' is already registered by .*Spy"):
        register_instrument("spy")(type("Other", (Instrument,), {}))
    with pytest.raises(DuplicateName, match="instrument 'flips' is already registered"):
        register_instrument("flips")(Spy)


SPY_PLUGIN = '''
from megatron_gspo.jobs.instruments import Instrument, register_instrument


@register_instrument("row_tokens")
class RowTokens(Instrument):
    def on_rollout(self, batch, iteration):
        return {"spy/row_tokens": float(batch.valid_BT.sum())}
'''


@pytest.mark.slow
@pytest.mark.parametrize("pack", ["true", "false"])
def test_tensor_parallel_ranks_count_each_token_once(tmp_path, pack):
    """`torchrun` tp=2 with sequence parallelism, packed (each rank's routing gathered whole)
    and padded (each rank's column shard): expert_load.jsonl counts the rollout batch's real
    tokens once, as a plugin instrument counts its rows (the same rows on both ranks)."""
    (tmp_path / "spy.py").write_text(SPY_PLUGIN)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron_gspo.cli", "train", *BASE, "model.preset=qwen3-moe-tiny",
           "model.tp=2", "model.sequence_parallel=true", f"train.pack={pack}", "train.steps=2",
           "train.num_minibatches=2", "train.save_every=0", f"plugins=[{tmp_path / 'spy.py'}]",
           "instruments=[expert_load,row_tokens]", f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    _, err = communicate_or_kill(proc, 600)
    assert proc.returncode == 0, err[-3000:]
    last = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if "spy/row_tokens" in r]
    filed = read_jsonl(str(run_dir / "expert_load.jsonl"))
    assert [f["step"] for f in filed] == [r["step"] for r in last] == [2, 4]
    assert [f["tokens"] for f in filed] == [r["spy/row_tokens"] for r in last]
