"""RL training in bf16 (fp32 masters) through the trainer: the lr schedule is logged as
`train/lr`, and a resumed run continues masters, Adam state and schedule exactly."""

import os

import pytest

from tests.megatron_gspo.run.test_faults import overwrite_two_floats
import torch

from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.jobs.trainers import make_trainer, params

BF16 = ["model.dtype=bf16", "optim.warmup_steps=3", "optim.lr_decay_style=linear",
        "optim.min_lr=1e-4", "optim.lr_decay_steps=8"]  # pinned: the first half runs 1 of 2 steps


def masters(trainer):
    return [p.detach().clone() for p in trainer.policy.optimizer.master_params()]


def test_bf16_run_logs_the_schedule_and_resumes_exactly(tmp_path):
    straight = make_trainer(tmp_path, "train.steps=2", *BF16, name="straight")
    straight.train()
    rows = [r for r in read_jsonl(os.path.join(straight.cfg.run_dir, "metrics.jsonl"))
            if "train/lr" in r]
    lr, floor, total = 3e-3, 1e-4, 2 * 4  # BASE: optim.lr=3e-3, 4 minibatches per iteration
    want = [lr * k / 3 if k <= 3 else floor + (lr - floor) * (1 - (k - 3) / (total - 3))
            for k in range(1, total + 1)]
    assert [r["train/lr"] for r in rows] == pytest.approx(want, rel=1e-9)
    assert all(r["train/skipped"] == 0.0 for r in rows)
    assert {p.dtype for p in straight.policy.model.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in straight.policy.optimizer.master_params()} == {torch.float32}

    first = make_trainer(tmp_path, "train.steps=1", *BF16, name="resumed")
    first.train()
    resumed = make_trainer(tmp_path, "train.steps=2", *BF16, name="resumed")
    assert resumed.policy.optimizer.updates == 4
    resumed.train()
    for a, b in zip(masters(straight), masters(resumed)):
        assert torch.equal(a, b)
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)
    rows_b = read_jsonl(os.path.join(resumed.cfg.run_dir, "metrics.jsonl"))
    assert rows_b[-1]["train/lr"] == rows[-1]["train/lr"]
    assert rows_b[-1]["policy/loss"] == rows[-1]["policy/loss"]


def test_corrupt_dist_shard_is_caught_and_resume_falls_back(tmp_path, capsys):
    """The policy's dist checkpoint files carry sha256 sidecars like the rank files: a damaged
    shard of the latest step makes resume fall back to the step before."""
    from megatron_gspo.run import checkpoint as ckpt

    run = make_trainer(tmp_path, "train.steps=2")
    run.train()
    dist_dir = os.path.join(run.cfg.run_dir, "checkpoints", "step_000002", "dist")
    shard = os.path.join(dist_dir, "__0_0.distcp")
    assert os.path.isfile(shard + ckpt.CHECKSUM_SUFFIX)
    overwrite_two_floats(shard)
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0.distcp is corrupt"):
        ckpt.verify_file(shard)
    resumed = make_trainer(tmp_path, "train.steps=2")
    assert resumed.state.iteration == 1  # fell back to step 1
    assert "skipping checkpoint step 2" in capsys.readouterr().out
