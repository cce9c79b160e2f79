"""Resume never overwrites good checkpoints (issue 30): a `latest` gone, emptied or pointing at a
step dir that is gone, a KL reference whose source run moved on, an eval racing a run that prunes
its steps, resume=force across model.dtype."""

import hashlib
import os
import shutil

import pytest
import torch

from megatron_gspo.run import checkpoint as ckpt
from tests.megatron_gspo.test_faults import TINY, one_line_error, trainer


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
    from megatron_gspo.cli import main

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
    from megatron_gspo.cli import main

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

    from megatron_gspo.cli import main

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
    from megatron_gspo.cli import main

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
