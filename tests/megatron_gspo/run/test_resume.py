"""A run's own checkpoints (megatron_gspo.run.resume) under an operator's abuse, end to end: resume
never overwrites good checkpoints (a `latest` gone, emptied, garbled or pointing at a step dir
that is gone; a shard or checksum damaged; a full disk during a save), never saves weights gone
NaN, refuses resume=force across models and optimizer-state formats in one line; the KL
reference of `init_checkpoint` (megatron_gspo.run.init) stays the step the run started from."""

import hashlib
import os
import shutil

import pytest
import torch

from megatron_gspo import cli as cli_module
from megatron_gspo.cli import main
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run.metrics import read_jsonl
from tests.jsonl import step_rows
from tests.megatron_gspo.run.test_faults import TINY, one_line_error, trainer


def _digests(root) -> dict:
    """sha256 of every file of the step dirs under checkpoint root `root`."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            if d != str(root):
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("damage, resumed_at", [("deleted", 3), ("emptied", 3),
                                                ("newest step dir deleted", 2)])
def test_a_missing_latest_resumes_the_newest_complete_step(tmp_path, capsys, damage,
                                                           resumed_at):
    """`checkpoints/latest` deleted (or emptied, or its step dir deleted): the re-run started
    from step 0 and rewrote the complete steps (or refused with no fallback). It resumes from
    the newest complete step now, with a warning, and the steps before it stay as they were."""
    run = tmp_path / "run"
    trainer(run, "train.steps=3").train()
    root = run / "checkpoints"
    if damage == "deleted":
        (root / "latest").unlink()
    elif damage == "emptied":
        (root / "latest").write_text("")
    else:
        shutil.rmtree(root / "step_000003")
    kept = _digests(root)
    capsys.readouterr()
    t = trainer(run, "train.steps=4")
    assert t.state.iteration == resumed_at
    assert f"resuming from the newest complete step, {resumed_at}" in capsys.readouterr().out
    t.train()
    now = _digests(root)
    assert {k: now.get(k) for k in kept} == kept
    assert ckpt.latest_step(str(root)) == 4


def _ref_params(t) -> dict:
    return {n: p.detach().clone() for n, p in t.ref_policy.model.module.named_parameters()}


def test_the_kl_reference_stays_the_step_the_run_started_from(tmp_path, capsys):
    """loss.kl_coef > 0: the frozen reference was rebuilt from init_checkpoint's *current*
    latest step at every start, so continuing the SFT run it points at moved the RL run's KL.
    The step read at the first start is recorded and the reference stays there; once it is
    gone the resume is refused naming it (resume=force takes the newest step, warned)."""
    sft = tmp_path / "sft"
    assert main(["sft", *TINY, f"run_dir={sft}"]) == 0  # saves step 2
    rl = [f"init_checkpoint={sft}", "loss.kl_coef=0.1"]
    first = trainer(tmp_path / "rl", *rl, "train.steps=1")
    want = _ref_params(first)
    first.train()
    assert main(["sft", *TINY, f"run_dir={sft}", "sft.steps=4"]) == 0  # the SFT run goes on
    resumed = trainer(tmp_path / "rl", *rl, "train.steps=2")
    got = _ref_params(resumed)
    assert resumed.state.iteration == 1 and all(torch.equal(want[n], got[n]) for n in want)
    resumed.train()
    shutil.rmtree(sft / "checkpoints" / "step_000002")
    capsys.readouterr()
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path / 'rl'}", *rl,
                         "train.steps=3")
    assert f"init_checkpoint={sft}: step 2, which {tmp_path / 'rl'} started from and keeps " \
           "as its KL reference (loss.kl_coef=0.1), is gone" in err
    forced = trainer(tmp_path / "rl", *rl, "train.steps=3", "resume=force")
    assert "step 2 is gone (resume=force): the KL reference is its newest step" in \
        capsys.readouterr().out
    forced.rt.close()


def test_a_resume_without_kl_needs_no_init_checkpoint(tmp_path):
    """With loss.kl_coef=0 the resumed weights are the run's own checkpoint's: deleting the SFT
    run that init_checkpoint named blocked the RL run's resume ('no such directory')."""
    sft = tmp_path / "sft"
    assert main(["sft", *TINY, f"run_dir={sft}"]) == 0
    trainer(tmp_path / "rl", f"init_checkpoint={sft}", "train.steps=1").train()
    shutil.rmtree(sft)
    resumed = trainer(tmp_path / "rl", f"init_checkpoint={sft}", "train.steps=2")
    assert resumed.state.iteration == 1 and resumed.ref_policy is None
    resumed.train()
    assert ckpt.latest_step(str(tmp_path / "rl" / "checkpoints")) == 2


def test_an_eval_of_a_run_pruning_its_steps_reads_the_newest_one(tmp_path, capsys,
                                                                 monkeypatch):
    """`eval init_checkpoint=RUN` while RUN trains with train.keep_checkpoints=1: the step being
    read was pruned under it (CheckpointingException: ... dist does not exist). The eval now
    reads the run's newest step instead."""
    from megatron.core import dist_checkpointing

    run = tmp_path / "run"
    trainer(run, "train.steps=1", "train.keep_checkpoints=1").train()
    root = run / "checkpoints"
    load, read = dist_checkpointing.load, []

    def pruned_while_read(sharded_state_dict, directory, *args, **kwargs):
        read.append(directory)
        if len(read) == 1:  # meanwhile the run saves step 2 and prunes step 1
            shutil.copytree(root / "step_000001", root / "step_000002")
            (root / "latest").write_text("2\n")
            shutil.rmtree(root / "step_000001")
        return load(sharded_state_dict, directory, *args, **kwargs)

    monkeypatch.setattr(dist_checkpointing, "load", pruned_while_read)
    capsys.readouterr()
    assert main(["eval", *TINY, f"init_checkpoint={run}"]) == 0
    assert read == [str(root / "step_000001" / "dist"), str(root / "step_000002" / "dist")]
    assert "step_000001 was removed while it was read (pruned by the run writing it); " \
           "reading its newest step" in capsys.readouterr().out


@pytest.mark.parametrize("saved, resumed", [
    ("model.dtype=bf16", "model.dtype=fp32"), ("model.dtype=fp32", "model.dtype=bf16"),
    ("optim.distributed=false", "optim.distributed=true")])
def test_resume_force_across_the_optimizer_state_format_is_one_line(tmp_path, capsys, saved,
                                                                    resumed):
    """resume=force across model.dtype (bf16 -> fp32: KeyError 'pre_wd_mult' in megatron's
    optimizer; fp32 -> bf16: KeyError ... fp32_param) or optim.distributed was a traceback."""
    run = tmp_path / "run"
    assert main(["train", *TINY, f"run_dir={run}", "train.steps=1", saved]) == 0
    latest = (run / "checkpoints" / "latest").read_text()
    capsys.readouterr()
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=2", resumed,
                         "resume=force")
    assert f"saved with {saved}, resuming with {resumed}" in err
    assert f"init_checkpoint={run} (weights only)" in err
    assert (run / "checkpoints" / "latest").read_text() == latest


def test_resume_force_from_bf16_to_fp16_keeps_the_optimizer_state(tmp_path):
    """Both keep fp32 masters: that change still resumes."""
    trainer(tmp_path / "run", "train.steps=1", "model.dtype=bf16").train()
    t = trainer(tmp_path / "run", "train.steps=2", "model.dtype=fp16", "resume=force")
    assert t.state.iteration == 1
    t.rt.close()


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
    rows = step_rows(run)
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

    from megatron_gspo.run.resume import save_state

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

    from megatron_gspo.run.resume import save_state

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
    assert first == [0, 1, 2] and not (run / "checkpoints").exists()  # 0: the test split's
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
    from moe.model import dist_ckpt

    run = tmp_path / "run"
    trainer(run, "train.steps=1").train()

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(dist_ckpt, "load", oom)
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


def test_a_step_without_dist_is_skipped_and_none_left_is_one_line(tmp_path, capsys):
    """The newest step's dist/ removed (or a step from before dist checkpoints): the resume
    falls back to the step before, with a warning naming it; with no step's dist/ left it
    refuses in one line, and nothing on disk changes."""
    run = tmp_path / "run"
    trainer(run, "train.steps=2", "train.save_every=1").train()
    root = run / "checkpoints"
    shutil.rmtree(root / "step_000002" / "dist")
    capsys.readouterr()
    assert trainer(run, "train.steps=3", "train.save_every=1").state.iteration == 1
    assert "step_000002/dist is not a dist checkpoint" in capsys.readouterr().out
    shutil.rmtree(root / "step_000001" / "dist")
    kept = _digests(root)
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "train.steps=3")
    assert "no readable checkpoint" in err and "tried [2, 1]" in err, err
    assert _digests(root) == kept
