"""An operator's abuse of a run dir, end to end (test_faults.py has the basic refusals): shards
gone from the latest checkpoint, weights gone NaN."""

import os

import pytest

from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo import cli as cli_module
from megatron_gspo.cli import main
from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.test_faults import TINY, one_line_error, trainer


def test_a_shard_gone_from_the_latest_step_falls_back_to_the_previous_one(tmp_path, capsys):
    run = tmp_path / "run"
    t = trainer(run, "train.steps=2")
    t.train()
    t.rt.close()
    dist_dir = os.path.join(ckpt.step_dir(str(run / "checkpoints"), 2), "dist")
    shard = sorted(n for n in os.listdir(dist_dir) if n.endswith(".distcp"))[0]
    os.remove(os.path.join(dist_dir, shard))  # e.g. a partial copy of the run dir
    resumed = trainer(run, "train.steps=2")
    assert resumed.state.iteration == 1
    out = capsys.readouterr().out
    assert f"skipping checkpoint step 2: checkpoint file {dist_dir}/{shard} is missing" in out
    resumed.rt.close()


def test_weights_gone_nan_stop_the_run_before_a_save_and_keep_the_last_good_step(tmp_path):
    """An update that leaves a weight NaN (an lr too high, fp16 overflow): the next minibatch's
    NaN log-probs are a skipped step (train/skipped), not a traceback from the loss, and the run
    stops with a FloatingPointError naming it before saving: `latest` stays the good step."""
    run = tmp_path / "run"
    t = trainer(run, "train.steps=3")
    step, calls = t.policy.step, []

    def step_then_poison():
        out = step()
        calls.append(1)
        if len(calls) == 3:  # rollout batch 2's first minibatch
            next(t.policy.model.module.parameters()).data.fill_(float("nan"))
        return out

    t.policy.step = step_then_poison
    with pytest.raises(FloatingPointError, match=r"not finite after rollout batch 2.*untouched"):
        t.train()
    root = str(run / "checkpoints")
    assert ckpt.latest_step(root) == 1 and not os.path.isdir(ckpt.step_dir(root, 2))
    rows = read_jsonl(str(run / "metrics.jsonl"))
    assert [r["train/skipped"] for r in rows] == [0, 0, 0, 1]
    assert rows[-1]["policy/loss"] == "nan"


def test_a_non_finite_run_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_module, "run", lambda *a: (_ for _ in ()).throw(
        FloatingPointError("11 consecutive optimizer steps had a non-finite loss")))
    err = one_line_error(capsys, "train", f"run_dir={tmp_path}")
    assert "non-finite loss" in err


def test_disk_filling_during_the_dist_save_is_a_checkpoint_error(tmp_path):
    """The disk fills while megatron's dist_checkpointing writes the policy shards (a file size
    limit here; seen as ENOSPC on a full tmpfs): torch raises its CheckpointException, a
    traceback from the CLI. Now a CheckpointError naming the dir and the OS reason; the
    half-written `dist.tmp` is removed and `latest` stays on the previous step."""
    import resource
    import signal

    from megatron_gspo.run.setup import save_state

    run = tmp_path / "run"
    t = trainer(run, "train.steps=1")
    t.train()
    t = trainer(run, "train.steps=1")
    root = str(run / "checkpoints")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    try:
        with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*step_000002/dist: (File "
                                                       r"too large|.*OSError)"):  # mcore 0.19
            save_state(t.rt, 2, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, sigxfsz)
        t.rt.close()
    assert ckpt.latest_step(root) == 1
    assert not os.path.exists(os.path.join(ckpt.step_dir(root, 2), "dist.tmp"))


def test_a_sigterm_to_the_process_group_still_saves(tmp_path):
    """torchrun forwards SIGTERM to each worker's process group (so does `kill -- -PGID`, and
    schedulers signal every process): it also ends the multiprocessing Manager megatron's
    dist_checkpointing writer keeps from the first save on, so the save the SIGTERM asks for
    failed ('Broken pipe') and `latest` stayed on the last periodic step."""
    import signal
    import time

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_gspo.run.setup import save_state

    run = tmp_path / "run"
    t = trainer(run, "train.steps=1")
    t.train()  # a first save starts the writer's Manager
    manager = getattr(filesystem_async._results_queue, "_manager", None)
    if manager is None:
        pytest.skip("this megatron-core keeps no results-queue Manager")
    os.kill(manager._process.pid, signal.SIGTERM)
    for _ in range(100):
        if not manager._process.is_alive():
            break
        time.sleep(0.05)
    t = trainer(run, "train.steps=1")
    try:
        save_state(t.rt, 2, {})
    finally:
        t.rt.close()
    assert ckpt.latest_step(str(run / "checkpoints")) == 2


def test_a_start_from_scratch_does_not_log_its_steps_twice(tmp_path):
    """No checkpoint to resume (killed before the first save, a start refused by
    train.start_accuracy after its step-0 eval, save_every=0): the run starts over at step 0,
    and the rows of the attempt before were kept, so every step was logged twice."""
    run = tmp_path / "run"
    t = trainer(run, "train.steps=1", "train.save_every=0")
    t.train()
    first = [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))]
    assert first == [1, 2] and not (run / "checkpoints").exists()
    trainer(run, "train.steps=1", "train.save_every=0").train()
    assert [r["step"] for r in read_jsonl(str(run / "metrics.jsonl"))] == first


def test_a_garbled_latest_or_checksum_is_one_line_or_a_fallback(tmp_path, capsys):
    """`latest` holding no number was a ValueError traceback from the CLI; a checksum sidecar
    that is not JSON a JSONDecodeError traceback. Now one line naming `latest`, and a corrupt
    step (skipped, the run resumes from the previous one) for the sidecar."""
    run = tmp_path / "run"
    t = trainer(run, "train.steps=2")
    t.train()
    root = run / "checkpoints"
    (root / "step_000002" / "rank_00000.pt.sha256").write_text("{")
    resumed = trainer(run, "train.steps=2")
    assert resumed.state.iteration == 1
    assert "skipping checkpoint step 2: checksum file" in capsys.readouterr().out
    resumed.rt.close()
    (root / "latest").write_text("2 or 1")
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=2")
    assert f"{root}/latest: expected a step number, got '2 or 1'" in err
    err = one_line_error(capsys, "eval", *TINY, f"init_checkpoint={run}")
    assert f"init_checkpoint={run}: {root}/latest: expected a step number" in err


def test_resume_force_onto_another_model_is_one_line(tmp_path, capsys):
    """resume=force with model.num_layers changed: megatron's shape-mismatch exception was a
    traceback; now one line naming the saved and the built model, as init_checkpoint does."""
    run = tmp_path / "run"
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=1"]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=2",
                         "resume=force", "model.num_layers=1")
    assert "holds preset 'tiny', this run builds 'tiny' (1 layers)" in err
    assert "shape mismatch" in err


def test_a_resume_that_runs_out_of_memory_is_not_called_another_model(tmp_path, monkeypatch):
    """Only a shape / key mismatch is 'this run builds another model'; any other failure of the
    load (out of memory, I/O) keeps its own exception and traceback."""
    from megatron_gspo.run import setup as runtime

    run = tmp_path / "run"
    trainer(run, "train.steps=1").train()

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runtime.dist_ckpt, "load", oom)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        trainer(run, "train.steps=2")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):  # the same from init_checkpoint
        trainer(tmp_path / "other", f"init_checkpoint={run}")


def test_keep_checkpoints_bounds_the_step_dirs_and_the_run_resumes(tmp_path):
    """train.keep_checkpoints=2 with a save every rollout batch: 2 step dirs stay, and a resume
    with another keep (a non-semantic key) continues from the newest."""
    run = tmp_path / "run"
    trainer(run, "train.steps=3", "train.save_every=1", "train.keep_checkpoints=2").train()
    root = str(run / "checkpoints")
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == \
        ["step_000002", "step_000003"]
    t = trainer(run, "train.steps=4", "train.save_every=1", "train.keep_checkpoints=1")
    assert t.state.iteration == 3
    t.train()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000004"]
