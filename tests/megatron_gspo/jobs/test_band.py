"""Accuracy bands: SFT stops in sft.target_accuracy, RL refuses a start outside
train.start_accuracy, and both fields are validated (megatron_gspo.jobs.band); both as the run
loop's band (megatron_gspo.run.loop.Band)."""

import os

import pytest

from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.jobs.band import (AccuracyBandError, SFTBand, StartBand,
                                     check_start_accuracy, cold_start_line)
from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.metrics import read_jsonl
from tests.jsonl import write_metrics

BASE = ["model.preset=tiny", "task.name=addition", "task.kwargs.num_digits=1", "task.n_train=60",
        "task.n_eval=40", "rollout.prompts_per_batch=4", "rollout.group_size=4",
        "rollout.max_new_tokens=3", "train.num_minibatches=2", "train.save_every=0",
        "wandb.mode=disabled", "sft.batch_size=16", "sft.lr=1e-2"]


@pytest.mark.parametrize("key", ["sft.target_accuracy", "train.start_accuracy"])
@pytest.mark.parametrize("value,fragment", [
    ("[0.45,0.25]", "0 <= low < high <= 1"), ("[0.3,0.3]", "0 <= low < high <= 1"),
    ("[-0.1,0.3]", "0 <= low < high <= 1"), ("[0.2,1.5]", "0 <= low < high <= 1"),
    ("[.nan,0.3]", "0 <= low < high <= 1"), ("[0.2]", "expected [low, high]"),
    ("[0.1,0.2,0.3]", "expected [low, high]"), ("[x,0.3]", "expected [low, high]"),
    ("[true,0.2,0.4]", "expected [low, high]"), ("[0.2,0.4,false]", "expected [low, high]"),
    ("[false,0.4]", "expected [low, high]"),  # a bool is no accuracy, though float(False) is 0
    ("0.3", "expected list | null")])
def test_bad_band_is_a_config_error_naming_it(key, value, fragment):
    with pytest.raises(ConfigError, match=r"^" + key.replace(".", r"\.") + "=") as e:
        load_config(None, [f"{key}={value}"])
    assert fragment in str(e.value)


def test_band_values_and_eval_interval():
    cfg = load_config(None, ["sft.target_accuracy=[0, '0.5']", "train.start_accuracy=[0.25, 1]"])
    assert cfg.sft.target_accuracy == [0.0, 0.5] and cfg.train.start_accuracy == [0.25, 1.0]
    assert load_config(None, []).sft.target_accuracy is None  # default: the old fixed steps
    with pytest.raises(ConfigError, match=r"sft\.target_accuracy=.*needs sft\.eval_every > 0"):
        load_config(None, ["sft.target_accuracy=[0.2,0.4]", "sft.eval_every=0"])


def test_start_check_names_accuracy_and_band():
    cfg = load_config(None, ["train.start_accuracy=[0.25,0.45]", "init_checkpoint=runs/x"])
    check_start_accuracy(cfg, {"eval/accuracy": 0.25})  # edges are inside
    check_start_accuracy(cfg, {"eval/accuracy": 0.45})
    check_start_accuracy(load_config(None, []), {"eval/accuracy": 0.99})  # no band: no check
    with pytest.raises(AccuracyBandError) as e:
        check_start_accuracy(cfg, {"eval/accuracy": 0.656})
    assert str(e.value).startswith("train.start_accuracy=[0.25, 0.45]: init_checkpoint=runs/x "
                                   "has held-out accuracy 0.6560, outside the band")
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)  # CLI: one line, exit 2


def test_band_rule_over_a_sequence_of_evals():
    cfg = load_config(None, ["sft.target_accuracy=[0.25,0.45]", "run_dir=r"])
    band = SFTBand(cfg)
    assert [band.update(s, a) for s, a in ((0, 0.0), (10, 0.24))] == [False, False]
    assert band.update(20, 0.25) and band.record() == {"sft/start_accuracy": 0.25,
                                                       "sft/band_step": 20.0}
    band = SFTBand(cfg)
    band.update(10, 0.2)
    with pytest.raises(AccuracyBandError, match=r"jumped from 0\.2000 at step 10 to 0\.4600 at "
                                                r"step 20, past the band"):
        band.update(20, 0.46)
    with pytest.raises(AccuracyBandError, match=r"before SFT already has held-out accuracy 0\.5"):
        SFTBand(cfg).update(0, 0.5)


def _scripted_eval(monkeypatch, accuracies):
    import megatron_gspo.jobs.sft as sft

    it = iter(accuracies)
    monkeypatch.setattr(sft, "evaluate_runtime", lambda rt: {"eval/accuracy": next(it)})


@pytest.mark.parametrize("accuracies,fragment", [
    ([0.0, 0.1, 0.2], r"not reached in sft\.steps=4 \(held-out accuracy 0\.2000 at step 4; "
                      r"checkpoint saved in .*\); raise sft\.steps"),
    ([0.0, 0.1, 0.9], r"jumped from 0\.1000 at step 2 to 0\.9000 at step 4, past the band")])
def test_sft_outside_the_band_fails_and_keeps_the_checkpoint(tmp_path, monkeypatch, accuracies,
                                                              fragment):
    from megatron_gspo.jobs.sft import run_sft

    _scripted_eval(monkeypatch, accuracies)
    cfg = load_config(None, [*BASE, f"run_dir={tmp_path}", "sft.steps=4", "sft.eval_every=2",
                             "sft.target_accuracy=[0.3,0.6]"])
    with pytest.raises(AccuracyBandError, match=fragment):
        run_sft(cfg)
    assert ckpt.latest_step(os.path.join(tmp_path, "checkpoints")) == 4
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["eval/accuracy"] for r in rows if "eval/accuracy" in r] == accuracies


def test_real_sft_stops_in_band_and_rl_checks_its_start(tmp_path):
    """Real SFT to the band; the checkpoint records where; RL from it passes the same band and
    refuses one that excludes its accuracy before any RL step."""
    from megatron_gspo.jobs.sft import run_sft
    from megatron_gspo.jobs.rl import Trainer

    sft_dir = tmp_path / "sft"
    cfg = load_config(None, [*BASE, f"run_dir={sft_dir}", "sft.steps=80", "sft.eval_every=4",
                             "sft.lr_decay_style=linear", "sft.target_accuracy=[0.05,0.6]"])
    out = run_sft(cfg)
    evals = [(r["step"], r["eval/accuracy"]) for r in read_jsonl(sft_dir / "metrics.jsonl")
             if "eval/accuracy" in r]
    first = next(s for s, a in evals if a >= 0.05)
    assert 0 < first < 80 and evals[-1][0] == first  # stopped at the first eval in the band
    assert out["sft/band_step"] == first and 0.05 <= out["sft/start_accuracy"] <= 0.6
    assert ckpt.latest_step(os.path.join(sft_dir, "checkpoints")) == first
    extra = ckpt.load_checkpoint(os.path.join(sft_dir, "checkpoints"), rank=0)["extra"]
    assert extra["band"] == {"sft/start_accuracy": evals[-1][1], "sft/band_step": first}
    assert run_sft(cfg)["sft/band_step"] == first  # re-running: done, nothing trained
    line = cold_start_line(str(sft_dir))  # the run, the step RL loads, its band record
    assert line.startswith(f"cold start {sft_dir} [run ") and \
        f", checkpoint step {first}, band on the test split]: start accuracy " \
        f"{evals[-1][1]:.4f}, entered the band at SFT step {first}; test accuracy " in line

    acc = out["sft/start_accuracy"]
    rl = [*BASE, f"init_checkpoint={sft_dir}", "train.steps=1", "train.eval_every=0"]
    refused = load_config(None, [*rl, f"run_dir={tmp_path / 'refused'}",
                                 f"train.start_accuracy=[{acc + 0.01},1]"])
    with pytest.raises(AccuracyBandError, match=rf"held-out accuracy {acc:.4f}, outside the band"):
        Trainer.from_config(refused).train()
    rows = read_jsonl(tmp_path / "refused" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0] and not os.path.exists(tmp_path / "refused" /
                                                                   "checkpoints")
    ok = load_config(None, [*rl, f"run_dir={tmp_path / 'ok'}", "train.start_accuracy=[0.05,0.6]"])
    Trainer.from_config(ok).train()
    rows = read_jsonl(tmp_path / "ok" / "metrics.jsonl")
    assert rows[0]["eval/accuracy"] == acc and any("reward/mean" in r for r in rows)
    assert sum("eval/accuracy" in r for r in rows) == 1  # eval_every 0: only the start check


def test_band_edges_are_inside_for_sft():
    """Guards SFTBand.update's `accuracy > high` (not >=): an eval exactly at the upper edge is
    in the band (SFT stops there), as check_start_accuracy treats it."""
    cfg = load_config(None, ["sft.target_accuracy=[0.25,0.5]", "run_dir=r"])
    band = SFTBand(cfg)
    assert band.update(0, 0.0) is False
    assert band.update(10, 0.5) is True
    assert band.record() == {"sft/start_accuracy": 0.5, "sft/band_step": 10.0}


def test_start_check_without_init_checkpoint_names_the_initial_policy():
    """A refused start from a fresh policy (no init_checkpoint) says so, not
    "init_checkpoint=None"."""
    cfg = load_config(None, ["train.start_accuracy=[0.25,0.45]"])
    with pytest.raises(AccuracyBandError, match=r"^train\.start_accuracy=\[0\.25, 0\.45\]: the "
                                                r"initial policy \(no init_checkpoint\) has "
                                                r"held-out accuracy 0\.1000, outside"):
        check_start_accuracy(cfg, {"eval/accuracy": 0.1})


def test_sft_band_first_eval_cases():
    """Step 0 exactly at the upper edge is in the band (stop there, not "already above"); a
    first eval after step 0 above the band (a resumed run without an eval on record) is a jump
    with no "from" part, not "before SFT"."""
    cfg = load_config(None, ["sft.target_accuracy=[0.25,0.5]", "run_dir=r", "sft.eval_every=5",
                             "sft.lr=1e-3"])
    band = SFTBand(cfg)
    assert band.update(0, 0.5) is True
    assert band.record() == {"sft/start_accuracy": 0.5, "sft/band_step": 0.0}
    with pytest.raises(AccuracyBandError, match=r"held-out accuracy jumped to 0\.9000 at step "
                                                r"10, past the band") as e:
        SFTBand(cfg).update(10, 0.9)
    assert str(e.value).endswith("smaller sft.eval_every (now 5) or sft.lr (now 0.001)")


def test_sft_band_without_target_and_before_entering():
    """No sft.target_accuracy: update never stops SFT (and still tracks the last eval); before
    the band is entered record() is {} (nothing for the checkpoint to keep)."""
    band = SFTBand(load_config(None, ["run_dir=r"]))
    assert band.update(10, 0.99) is False and band.last == (10, 0.99) and band.record() == {}
    band = SFTBand(load_config(None, ["sft.target_accuracy=[0.25,0.5]", "run_dir=r"]))
    assert band.update(10, 0.1) is False and band.record() == {}
    assert "held-out accuracy 0.1000 at step 10" in str(band.exhausted())


def test_cold_start_line_reads_the_latest_record(tmp_path):
    """The latest band record wins; without one, the latest eval; without metrics, a line
    saying so (no crash)."""
    assert cold_start_line(str(tmp_path)) == f"cold start {tmp_path}: no band record (no eval " \
                                             "logged)"
    write_metrics(tmp_path, [{"step": 0, "eval/accuracy": 0.0},
                             {"step": 10, "eval/accuracy": 0.125}, {"step": 11, "sft/loss": 1.0}])
    assert cold_start_line(str(tmp_path)).endswith("no band record (accuracy 0.1250 at step 10)")
    write_metrics(tmp_path, [
        {"step": 20, "eval/accuracy": 0.3, "sft/start_accuracy": 0.3, "sft/band_step": 20.0},
        {"step": 30, "eval/accuracy": 0.35, "sft/start_accuracy": 0.35, "sft/band_step": 30.0}])
    assert cold_start_line(str(tmp_path)).endswith("start accuracy 0.3500, entered the band at "
                                                   "SFT step 30")


def test_a_start_refused_by_the_band_does_not_lock_in_its_config(tmp_path):
    """The band error says to make another cold start or change the band; the run it refused
    saved nothing, so its record must not refuse the corrected re-run as 'another config'
    (it did: run.json held the refused init's keys). A run with checkpoints keeps its record."""
    from megatron_gspo.run.rundir import RUN_FILE
    from megatron_gspo.jobs.rl import Trainer

    run = [*BASE, f"run_dir={tmp_path}", "train.steps=1", "train.eval_every=0"]
    refused = load_config(None, [*run, "train.start_accuracy=[0.99,1]"])
    with pytest.raises(AccuracyBandError, match="outside the band"):
        Trainer.from_config(refused).train()
    assert not os.path.exists(tmp_path / RUN_FILE)
    assert not os.path.exists(tmp_path / "train_config.yaml")
    fixed = load_config(None, [*run, "optim.lr=2e-4", "train.start_accuracy=[0,1]"])
    Trainer.from_config(fixed).train()  # another semantic config: was a RunDirError
    assert os.path.exists(tmp_path / RUN_FILE)


def test_a_refused_rerun_of_a_finished_run_without_checkpoints_loses_nothing(tmp_path):
    """A run with train.save_every=0 finishes with no checkpoint; the same command again with
    a band that refuses its start deleted that run's record (forget_run) and its metrics rows
    (the start-from-step-0 cleanup). Now the record stays and the rows move aside."""
    from megatron_gspo.run.rundir import RUN_FILE
    from megatron_gspo.jobs.rl import Trainer

    run = [*BASE, f"run_dir={tmp_path}", "train.steps=1", "train.eval_every=0"]
    Trainer.from_config(load_config(None, run)).train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    refused = load_config(None, [*run, "train.start_accuracy=[0.99,1]"])
    with pytest.raises(AccuracyBandError, match="outside the band"):
        Trainer.from_config(refused).train()
    assert (tmp_path / RUN_FILE).exists() and (tmp_path / "train_config.yaml").exists()
    assert read_jsonl(tmp_path / "metrics.prev1.jsonl") == rows


def test_rl_start_band_checks_the_initial_policy_only_and_never_stops_rl():
    """StartBand (RL's band in the run loop): step 0 is `check_start_accuracy`; later evals
    are not checked; RL never stops inside it, and its end asks nothing."""
    band = StartBand(load_config(None, ["train.start_accuracy=[0.25,0.45]"]))
    assert band.update(0, 0.3) is False
    with pytest.raises(AccuracyBandError, match=r"held-out accuracy 0\.1000, outside the band"):
        band.update(0, 0.1)
    assert band.update(5, 0.99) is False  # mid-run evals: no check
    assert band.record() == {} and band.finish() is None
    assert StartBand(load_config(None, [])).update(0, 0.99) is False  # no band: no check


def test_sft_band_finish_is_the_exhausted_budget_only_with_a_band():
    """The run loop calls finish() after SFT's last step: an error only with a band set (SFT
    stops on entering it, so reaching the end means it did not)."""
    assert SFTBand(load_config(None, ["run_dir=r"])).finish() is None
    band = SFTBand(load_config(None, ["sft.target_accuracy=[0.25,0.5]", "run_dir=r"]))
    band.update(10, 0.1)
    with pytest.raises(AccuracyBandError, match=r"not reached in sft\.steps=.*held-out "
                                                r"accuracy 0\.1000 at step 10"):
        band.finish()


def split_evals(monkeypatch, val_accuracies, test_accuracy=0.9, n_val=12, n_test=20):
    """The greedy eval (`megatron_gspo.run.setup.evaluate`) replaced by one that says which
    split it was given (by size: n_val validation prompts, n_test test prompts, recorded in
    the returned list) and returns the next of `val_accuracies` for validation, `test_accuracy`
    for test."""
    from megatron_gspo.run import setup

    calls, val = [], iter(val_accuracies)

    def evaluate(sampler, tokenizer, task, examples, *, max_new_tokens, batch_size=128):
        split = {n_val: "val", n_test: "test"}[len(examples)]
        calls.append(split)
        acc = next(val) if split == "val" else test_accuracy
        return {"eval/accuracy": acc, "eval/reward_mean": acc, "eval/format_ok": 1.0}
    monkeypatch.setattr(setup, "evaluate", evaluate)
    return calls


def test_the_band_reads_the_validation_split_and_the_test_split_chooses_nothing(
        tmp_path, monkeypatch, capsys):
    """SFT's band and RL's start band read the validation split; the test split (above the
    band here: a band reading it would refuse the run) is evaluated at the first and last
    step only, beside `eval/accuracy`, and the cold start records its test accuracy."""
    from megatron_gspo.jobs.rl import Trainer
    from megatron_gspo.jobs.sft import run_sft

    calls = split_evals(monkeypatch, [0.1, 0.2, 0.3])
    sft_dir = tmp_path / "sft"
    split = ["task.n_val=12", "task.n_test=20"]
    out = run_sft(load_config(None, [*BASE, *split, f"run_dir={sft_dir}", "sft.steps=20",
                                     "sft.eval_every=2", "sft.target_accuracy=[0.25,0.45]"]))
    assert calls == ["val", "test", "val", "val", "test"]  # step 0, 2, 4 (in the band)
    assert (out["sft/band_step"], out["sft/start_accuracy"]) == (4, 0.3)
    rows = read_jsonl(sft_dir / "metrics.jsonl")
    tested = [(r["step"], r["eval/accuracy"], r["test/accuracy"]) for r in rows
              if "test/accuracy" in r]
    assert tested == [(0, 0.1, 0.9), (4, 0.3, 0.9)]
    assert all(0 <= r["test/reward"] <= 1 for r in rows if "test/accuracy" in r)
    assert "WARNING: no validation split" not in capsys.readouterr().out
    line = cold_start_line(str(sft_dir))
    assert line.startswith(f"cold start {sft_dir} [run ") and ", checkpoint step 4]: " in line
    assert line.endswith("start accuracy 0.3000, entered the band at SFT step 4; test "
                         "accuracy 0.9000")

    calls = split_evals(monkeypatch, [0.3])
    Trainer.from_config(load_config(None, [
        *BASE, *split, f"init_checkpoint={sft_dir}", f"run_dir={tmp_path / 'rl'}",
        "train.steps=1", "train.eval_every=0", "train.start_accuracy=[0.25,0.45]"])).train()
    assert calls == ["val", "test", "test"]  # the start check, then test at steps 0 and 2
    rows = read_jsonl(tmp_path / "rl" / "metrics.jsonl")
    assert rows[0]["step"] == 0 and (rows[0]["eval/accuracy"], rows[0]["test/accuracy"]) == \
        (0.3, 0.9)
    assert rows[-1]["step"] == 2 and rows[-1]["test/accuracy"] == 0.9


def test_without_a_validation_split_the_band_reads_the_test_split_and_says_so(
        tmp_path, monkeypatch, capsys):
    """task.n_val=0 (every config from before the validation split): evals and the band read
    the test split, as they did, and set-up warns that the band chooses on it."""
    from megatron_gspo.jobs.sft import run_sft

    calls = split_evals(monkeypatch, [], test_accuracy=0.3)
    out = run_sft(load_config(None, [*BASE, "task.n_eval=20", f"run_dir={tmp_path / 'sft'}",
                                     "sft.steps=4", "sft.eval_every=2",
                                     "sft.target_accuracy=[0.25,0.45]"]))
    assert out["sft/band_step"] == 0 and calls == ["test", "test"]
    assert "WARNING: no validation split (task.n_val=0, no data.val_files / data.val_fraction)" \
           ": sft.target_accuracy chooses on the test split" in capsys.readouterr().out
    assert "band on the test split" in cold_start_line(str(tmp_path / "sft"))
