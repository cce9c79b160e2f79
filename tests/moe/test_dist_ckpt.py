"""Rank-local dist checkpoints (moe.dist_ckpt): saved with TP=2 on 2 gloo processes, resumed
with EP=2 (DP=2) and with 1 process, the next step's loss and parameters equal the uninterrupted
TP=2 run's."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.moe import parallel_worker as pw
from tests.moe.test_parallel import _port, reference  # noqa: F401  (module fixture)

LOSS_RTOL = 1e-5  # the same step under different layouts: float summation order only


@pytest.fixture(scope="module")
def tp2_run(reference, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("dist_ckpt")
    ckpt, out = str(d / "step_2"), str(d / "out.pt")
    mp.spawn(pw.checkpoint_worker, args=(2, _port(), reference, ckpt, out), nprocs=2,
             join=True)
    return ckpt, torch.load(out, weights_only=False)


@pytest.mark.slow
def test_each_rank_writes_its_own_shards_atomically(tp2_run):
    ckpt, _ = tp2_run
    names = sorted(os.listdir(ckpt))
    assert "metadata.json" in names and "common.pt" in names
    shards = [n for n in names if n.endswith(".distcp")]
    assert {n.split("_")[2] for n in shards} == {"0", "1"}  # files of rank 0 and of rank 1
    assert not os.path.exists(ckpt + ".tmp") and not os.path.exists(ckpt + ".old")


@pytest.mark.slow
def test_tp2_checkpoint_resumes_with_ep2(tp2_run):
    _, out = tp2_run
    assert out["ep2_updates"] == 3
    assert out["ep2_loss3"] == pytest.approx(out["tp2_loss3"], rel=LOSS_RTOL)
    for name, p in out["tp2_params3"].items():
        torch.testing.assert_close(out["ep2_params3"][name], p, atol=pw.DP_ATOL, rtol=0,
                                   msg=lambda m: f"EP=2 resumed, {name}: {m}")


@pytest.mark.slow
def test_tp2_checkpoint_resumes_in_one_process(single_process, tp2_run):
    from moe import dist_ckpt
    from moe.presets import get_preset
    from moe.sharding import gather_full_params

    ckpt, out = tp2_run
    policy, rows = pw.build_layout(get_preset("tiny"), tp=1, ep=1)
    dist_ckpt.load(policy, ckpt)
    assert pw.step_loss(policy, rows) == pytest.approx(out["tp2_loss3"], rel=LOSS_RTOL)
    pw.train_steps(policy, rows, 3, start=2)
    for name, p in gather_full_params(policy.model.module).items():
        torch.testing.assert_close(p, out["tp2_params3"][name], atol=pw.DP_ATOL, rtol=0,
                                   msg=lambda m: f"1-process resumed, {name}: {m}")


def test_weights_only_load_and_a_clear_error(single_process, tmp_path):
    """Same layout, 1 process: weights-only load refreshes bf16 masters; a missing or partial
    checkpoint names the directory."""
    from moe import dist_ckpt
    from moe.model import ParallelLayout
    from moe.optim import OptimSettings
    from moe.policy import MoEPolicy
    from moe.presets import get_preset

    preset = get_preset("tiny")

    def build(seed):
        return MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size,
                               seed=seed, dtype=torch.bfloat16, optim=OptimSettings(lr=LR))

    LR = 1e-3
    saved, fresh = build(1), build(2)
    dist_ckpt.save(saved, str(tmp_path / "ckpt"))
    dist_ckpt.load(fresh, str(tmp_path / "ckpt"), optimizer=False)
    for a, b in zip(saved.model.module.parameters(), fresh.model.module.parameters()):
        assert torch.equal(a, b) and torch.equal(b.main_param, a.float())
    assert fresh.optimizer.updates == 0
    os.remove(tmp_path / "ckpt" / "metadata.json")
    with pytest.raises(FileNotFoundError, match="ckpt: not a complete dist checkpoint"):
        dist_ckpt.load(fresh, str(tmp_path / "ckpt"))
