"""moe.model.dist_ckpt in one process: which files a rank wrote, re-saving over a checkpoint, a
weights-only load of a checkpoint that has no optimizer state, and checkpoints of megatron's
per-expert layout (written before the stacked expert weights). Layout changes (TP=2 -> EP=2,
TP=2 / EP=2 -> 1 process) are in tests/moe/model/test_training_state.py."""

import os

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.transformer.moe.experts import SequentialMLP

from moe.model import dist_ckpt
from tests.moe import parallel_worker as pw
from tests.moe.model.test_experts import as_stacked, params


def _policy(seed: int, optim: bool = True, distributed: bool = False, **kwargs):
    from moe.model.policy import MoEPolicy
    from moe.model.presets import get_preset
    from moe.model.settings import OptimSettings, ParallelLayout

    preset = get_preset("tiny")
    return MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=seed,
                           optim=OptimSettings(lr=1e-2, distributed=distributed) if optim
                           else None, **kwargs)


def _train(policy, steps: int) -> None:
    tokens_BT, valid_BT, readout_BTV = pw.batch(policy.preset.vocab_size)
    for _ in range(steps):
        policy.zero_grad()
        policy.backward(pw.loss_fn(policy.logits(tokens_BT, valid_BT), valid_BT, readout_BTV))
        assert policy.step()[0]


def _assert_same_weights(a, b) -> None:
    for (name, p), q in zip(a.model.module.named_parameters(), b.model.module.parameters()):
        assert torch.equal(p, q), name


def test_files_written_by_splits_shards_by_rank_and_gives_rank_0_the_common_files(tmp_path):
    """Each rank checksums its own `__<rank>_<writer>.distcp` shards; rank 0 also the common
    state and metadata; checksum sidecars and other files belong to nobody."""
    names = [".metadata", "__0_0.distcp", "__0_0.distcp.sha256", "__0_1.distcp", "__1_0.distcp",
             "__10_0.distcp", "common.pt", "metadata.json", "metadata.json.sha256", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    written = {r: [os.path.basename(p) for p in dist_ckpt.files_written_by(str(tmp_path), r)]
               for r in (0, 1, 2, 10)}
    assert written == {0: [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt",
                           "metadata.json"],
                       1: ["__1_0.distcp"], 2: [], 10: ["__10_0.distcp"]}
    assert dist_ckpt.files_written_by(str(tmp_path / "missing"), 0) == []
    assert dist_ckpt.is_dist_checkpoint(str(tmp_path))
    os.remove(tmp_path / "metadata.json")
    assert not dist_ckpt.is_dist_checkpoint(str(tmp_path))


def test_saving_over_a_checkpoint_replaces_it(single_process, tmp_path):
    """A second save into the same directory (given with a trailing slash; beside it a crashed
    attempt's `.tmp`, and the `.old` of a save killed after publishing its checkpoint) leaves
    exactly the new checkpoint: no `.tmp`, no `.old`."""
    first, second, fresh = (_policy(seed, optim=False) for seed in (1, 2, 3))
    ckpt = str(tmp_path / "ckpt")
    dist_ckpt.save(first, ckpt)
    for leftover in ("ckpt.tmp", "ckpt.old"):
        os.makedirs(tmp_path / leftover)
        (tmp_path / leftover / "__0_0.distcp").write_bytes(b"a shard")
    dist_ckpt.save(second, ckpt + "/")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    dist_ckpt.load(fresh, ckpt)
    _assert_same_weights(second, fresh)


@pytest.mark.parametrize("distributed", [False, True])
def test_weights_only_load_of_a_checkpoint_without_optimizer(single_process, tmp_path,
                                                             distributed):
    """A checkpoint saved without an optimizer loads weights-only into a policy that has one,
    which keeps its own (fresh) optimizer; a full load of it is refused."""
    from moe.model.presets import get_preset

    saved, fresh = _policy(1, optim=False), _policy(2, distributed=distributed)
    ckpt = str(tmp_path / "ckpt")
    dist_ckpt.save(saved, ckpt)
    assert dist_ckpt.embedding_rows(ckpt) == saved.model.module.embedding.word_embeddings \
        .weight.shape[0] == get_preset("tiny").vocab_size
    dist_ckpt.load(fresh, ckpt, optimizer=False)
    _assert_same_weights(saved, fresh)
    assert fresh.optimizer.updates == 0
    with pytest.raises(CheckpointException, match="optimizer"):
        dist_ckpt.load(fresh, ckpt)


def test_full_params_refuses_a_multi_process_job(monkeypatch, tmp_path):
    monkeypatch.setattr(dist_ckpt.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist_ckpt.dist, "get_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="runs in one process, not 2"):
        dist_ckpt.full_params(str(tmp_path), preset=None)


def test_a_per_expert_checkpoint_resumes_into_stacked_experts(single_process, tmp_path):
    """A checkpoint of megatron's per-expert `SequentialMLP` (the layout before the stacked
    expert weights: the same keys and global shapes) loads as it is: the weights, and the Adam
    state, so the next step is the per-expert run's own next step; `full_params` (what the
    Hugging Face export reads) gives its weights stacked."""
    from moe.model.presets import get_preset

    old, new = _policy(1, experts=SequentialMLP), _policy(2)
    _train(old, 2)
    ckpt = str(tmp_path / "per_expert")
    dist_ckpt.save(old, ckpt)
    saved = as_stacked(params(old))
    dist_ckpt.load(new, ckpt)
    assert params(new).keys() == saved.keys()
    assert all(torch.equal(p, saved[n]) for n, p in params(new).items())
    assert new.optimizer.updates == 2
    _train(old, 1)
    _train(new, 1)
    for name, p in as_stacked(params(old)).items():
        torch.testing.assert_close(params(new)[name], p, atol=1e-7, rtol=1e-6, msg=name)
    full = dist_ckpt.full_params(ckpt, get_preset("tiny"))
    assert all(torch.equal(full[n], saved[n]) for n in saved)


def test_a_per_expert_distributed_optimizer_state_is_refused(single_process, tmp_path):
    """The distributed optimizer's state is laid out by the parameters (megatron's buckets),
    which the stacked layout changed: loading it from a per-expert checkpoint would put other
    experts' Adam moments and masters in place, so it is refused in one line naming the
    weights-only load, which works; the stacked layout's own checkpoints load whole."""
    old, new = _policy(1, distributed=True, experts=SequentialMLP), _policy(2, distributed=True)
    _train(old, 1)
    ckpt = str(tmp_path / "per_expert")
    dist_ckpt.save(old, ckpt)
    with pytest.raises(ValueError, match=r"per_expert was written with per-expert expert "
                                         r"weights \(before the stacked ones\), .*; load its "
                                         r"weights only \(optimizer=False\)"):
        dist_ckpt.load(new, ckpt)
    assert dist_ckpt.layout_error(_policy(3), ckpt) is None  # non-distributed: it loads
    dist_ckpt.load(new, ckpt, optimizer=False)
    saved = as_stacked(params(old))
    assert all(torch.equal(p, saved[n]) for n, p in params(new).items())
    _train(new, 1)
    dist_ckpt.save(new, str(tmp_path / "stacked"))
    resumed = _policy(3, distributed=True)
    dist_ckpt.load(resumed, str(tmp_path / "stacked"))
    assert resumed.optimizer.updates == 1
    _assert_same_weights(new, resumed)
