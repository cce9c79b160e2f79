"""moe.dist_ckpt in one process: which files a rank wrote, re-saving over a checkpoint, and a
weights-only load of a checkpoint that has no optimizer state. Layout changes (TP=2 -> EP=2,
TP=2 -> 1 process) are in tests/moe/test_training_state.py."""

import os

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from moe import dist_ckpt


def _policy(seed: int, optim: bool = True, distributed: bool = False):
    from moe.policy import MoEPolicy
    from moe.presets import get_preset
    from moe.settings import OptimSettings, ParallelLayout

    preset = get_preset("tiny")
    return MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size, seed=seed,
                           optim=OptimSettings(distributed=distributed) if optim else None)


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
    from moe.presets import get_preset

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
