"""Training state on 2 gloo processes, one spawn (tests/moe/parallel_worker.training_worker):

- megatron's distributed optimizer on DP=2 (masters and Adam moments sharded over the ranks)
  gives the 1-process optimizer's parameters after 3 clipped updates; in bf16 exactly the
  unsharded optimizer's; its dist checkpoint resumes exactly;
- rank-local dist checkpoints (moe.model.dist_ckpt) saved with TP=2 resume with EP=2 (DP=2) and in 1
  process, and the EP=2 one in 1 process: the next step's loss and parameters equal the
  uninterrupted run's.
"""

import os

import pytest
import torch

from tests.moe import parallel_worker as pw
from tests.moe.platform.test_parallel import TIMEOUT_S, reference  # noqa: F401  (module fixture)

LOSS_RTOL = 1e-5  # the same step under different layouts: float summation order only


@pytest.fixture(scope="module")
def run(reference, tmp_path_factory):  # noqa: F811
    d = tmp_path_factory.mktemp("training_state")
    pw.spawn(pw.training_worker, (2, pw.free_port(), reference, str(d), str(d / "out.pt")),
             nprocs=2, timeout_s=TIMEOUT_S)
    out = torch.load(d / "out.pt", weights_only=False)
    out["ref_trained"] = torch.load(reference, weights_only=False)["trained"]
    return out


@pytest.mark.slow
def test_distributed_optimizer_dp2_matches_single_process(run):
    # each rank holds about half of the masters (+ bucket padding)
    assert run["dp2_local_master_numel"] <= run["dp2_total_numel"] // 2 + 64
    for name, p in run["ref_trained"].items():  # measured max |diff| 4.3e-7
        torch.testing.assert_close(run["dp2_params3"][name], p, atol=pw.DP_ATOL, rtol=0,
                                   msg=lambda m: f"DP=2 distributed, {name}: {m}")
        assert torch.equal(run["dp2_resumed_params3"][name], run["dp2_params3"][name]), name
    sharded, unsharded = run["dp2_bf16"]
    assert all(torch.equal(sharded[n], unsharded[n]) for n in sharded)


@pytest.mark.slow
def test_each_rank_writes_its_own_shards_atomically(run):
    ckpt = run["tp2_ckpt"]
    names = sorted(os.listdir(ckpt))
    assert "metadata.json" in names  # and common.pt before megatron-core 0.19
    shards = [n for n in names if n.endswith(".distcp")]
    assert {n.split("_")[2] for n in shards} == {"0", "1"}  # files of rank 0 and of rank 1
    assert not os.path.exists(ckpt + ".tmp") and not os.path.exists(ckpt + ".old")


@pytest.mark.slow
def test_tp2_checkpoint_resumes_with_ep2(run):
    assert run["ep2_updates"] == 3
    assert run["ep2_loss3"] == pytest.approx(run["tp2_loss3"], rel=LOSS_RTOL)
    for name, p in run["tp2_params3"].items():
        torch.testing.assert_close(run["ep2_params3"][name], p, atol=pw.DP_ATOL, rtol=0,
                                   msg=lambda m: f"EP=2 resumed, {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["tp2", "ep2"])
def test_checkpoint_resumes_in_one_process(single_process, run, saved):
    """The TP=2 and the EP=2 (4 of the 8 experts per rank) checkpoints in one process: the
    same 3rd step. Each stacked expert weight is one global [layers, E, out, in] tensor of the
    checkpoint, whichever EP size wrote it."""
    from megatron.core import dist_checkpointing

    from moe.model import dist_ckpt
    from moe.model.presets import get_preset
    from moe.model.sharding import gather_full_params

    preset = get_preset("tiny")
    meta = dist_checkpointing.load_tensors_metadata(run[f"{saved}_ckpt"])
    F, H = preset.moe_ffn_hidden_size, preset.hidden_size
    assert meta["decoder.layers.mlp.experts.experts.linear_fc1.weight"].global_shape == (
        preset.num_layers, preset.num_experts, 2 * F, H)
    policy, rows = pw.build_layout(preset, tp=1, ep=1)
    dist_ckpt.load(policy, run[f"{saved}_ckpt"])
    assert pw.step_loss(policy, rows) == pytest.approx(run[f"{saved}_loss3"], rel=LOSS_RTOL)
    pw.train_steps(policy, rows, 3, start=2)
    for name, p in gather_full_params(policy.model.module).items():
        torch.testing.assert_close(p, run[f"{saved}_params3"][name], atol=pw.DP_ATOL, rtol=0,
                                   msg=lambda m: f"1-process resumed, {name}: {m}")


def test_weights_only_load_and_a_clear_error(single_process, tmp_path):
    """Same layout, 1 process: weights-only load refreshes bf16 masters; a missing or partial
    checkpoint names the directory."""
    from moe.model import dist_ckpt
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import OptimSettings, ParallelLayout

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
