"""Sharded atomic checkpoints: round trip, latest pointer, crash safety, prune, RNG state."""

import os
import random
import re

import numpy as np
import pytest
import torch

from megatron_gspo.run import checkpoint as ckpt


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"policy": {"w": torch.randn(3, 4, generator=g), "b": torch.arange(5)},
            "extra": {"iteration": seed, "best_reward": 0.75, "history": [1, 2.5, "x"],
                      "tuple": (1, None)},
            "layout": (1, 1, 2)}


def _assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["policy"]["w"], b["policy"]["w"])
    assert torch.equal(a["policy"]["b"], b["policy"]["b"])
    assert a["policy"]["b"].dtype == b["policy"]["b"].dtype == torch.int64
    assert a["extra"] == b["extra"] and a["layout"] == b["layout"]


def test_round_trip_tensors_and_python_objects(tmp_path):
    root = str(tmp_path / "checkpoints")
    d = ckpt.save_checkpoint(root, 10, _state(1), rank=0)
    ckpt.save_checkpoint(root, 10, _state(2), rank=1)
    assert d == os.path.join(root, "step_000010")
    assert sorted(os.listdir(d)) == ["rank_00000.pt", "rank_00000.pt.sha256", "rank_00001.pt",
                                     "rank_00001.pt.sha256"]
    ckpt.mark_latest(root, 10)
    _assert_same(ckpt.load_checkpoint(root, rank=0), _state(1))
    _assert_same(ckpt.load_checkpoint(root, rank=1), _state(2))
    _assert_same(ckpt.load_checkpoint(d, rank=1), _state(2))  # a step dir works too
    _assert_same(ckpt.load_checkpoint(d + os.sep, rank=1), _state(2))  # with a trailing slash
    _assert_same(ckpt.load_checkpoint(root, rank=0, step=10), _state(1))


def test_latest_pointer(tmp_path):
    root = str(tmp_path)
    assert ckpt.latest_step(root) is None
    assert ckpt.latest_step(str(tmp_path / "missing")) is None
    ckpt.save_checkpoint(root, 5, _state(5))
    assert ckpt.latest_step(root) is None  # saved but not marked: not complete
    ckpt.mark_latest(root, 5)
    assert open(os.path.join(root, "latest")).read().strip() == "5"
    ckpt.save_checkpoint(root, 10, _state(10))
    assert ckpt.latest_step(root) == 5
    assert ckpt.load_checkpoint(root)["extra"]["iteration"] == 5
    ckpt.mark_latest(root, 10)
    assert ckpt.latest_step(root) == 10
    assert ckpt.load_checkpoint(root)["extra"]["iteration"] == 10
    with pytest.raises(FileNotFoundError, match="step_000020"):
        ckpt.mark_latest(root, 20)  # nothing saved there


def test_crash_mid_write_does_not_corrupt_latest(tmp_path, monkeypatch):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 10, _state(10))
    ckpt.mark_latest(root, 10)

    def crashing_save(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 20, _state(20))
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 10, _state(99))  # overwrite attempt of the good one
    monkeypatch.undo()
    assert os.listdir(os.path.join(root, "step_000020")) == []  # tmp cleaned, no final file
    # a hard kill would leave the tmp file behind: simulate it
    with open(os.path.join(root, "step_000020", ".rank_00000.pt.abc.tmp"), "wb") as f:
        f.write(b"garbage")
    assert ckpt.latest_step(root) == 10
    _assert_same(ckpt.load_checkpoint(root), _state(10))  # old file intact, not overwritten
    with pytest.raises(FileNotFoundError, match=r"rank_00000\.pt does not exist"):
        ckpt.load_checkpoint(os.path.join(root, "step_000020"))


def test_missing_checkpoint_errors_name_the_path(tmp_path):
    root = str(tmp_path / "run" / "checkpoints")
    with pytest.raises(FileNotFoundError, match="checkpoints does not exist"):
        ckpt.load_checkpoint(root)
    os.makedirs(root)
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load_checkpoint(root)
    assert root in str(e.value) and "no 'latest'" in str(e.value)
    ckpt.save_checkpoint(root, 3, _state(3))
    ckpt.mark_latest(root, 3)
    with pytest.raises(FileNotFoundError) as e:
        ckpt.load_checkpoint(root, rank=2)
    msg = str(e.value)
    assert os.path.join(root, "step_000003", "rank_00002.pt") in msg
    assert "rank_00000.pt" in msg  # lists what exists
    with pytest.raises(FileNotFoundError, match=r"step_000007.*\[latest, step_000003\]"):
        ckpt.load_checkpoint(root, step=7)


def test_mark_latest_refuses_a_step_without_rank_0(tmp_path):
    """A step dir that a killed save left without rank 0's file is never marked complete or
    latest: the previous step stays the one to resume."""
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, _state(1))
    ckpt.mark_latest(root, 1)
    ckpt.save_checkpoint(root, 2, _state(2), rank=1)  # rank 0 died before its file
    with pytest.raises(FileNotFoundError, match=r"cannot mark step 2 latest: .*rank_00000.pt"):
        ckpt.mark_latest(root, 2)
    assert ckpt.latest_step(root) == 1
    assert not os.path.exists(os.path.join(ckpt.step_dir(root, 2), "complete"))


def test_bad_latest_pointer_names_the_file(tmp_path):
    """A `latest` that holds no number, or points to a missing step, is an error naming it;
    resume falls back past the missing step to the complete ones (not past a garbled one)."""
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, _state(1))
    ckpt.mark_latest(root, 1)
    latest = os.path.join(root, "latest")
    with open(latest, "w") as f:
        f.write("ten\n")
    with pytest.raises(ValueError, match=re.escape(f"{latest}: expected a step number, got 'ten'")):
        ckpt.latest_step(root)
    with open(latest, "w") as f:
        f.write("7\n")
    with pytest.raises(FileNotFoundError, match=r"points to step 7, but .*step_000007 does not "
                                                r"exist; .* holds \[latest, step_000001\]"):
        ckpt.latest_step(root)
    assert ckpt.resume_candidates(root) == [1]
    assert ckpt.latest_problem(root) == f"{latest} points to step 7, whose dir " \
        f"{ckpt.step_dir(root, 7)} is gone"


def test_resume_candidates_are_latest_then_older_complete_steps(tmp_path):
    root = str(tmp_path)
    for s in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(root, s, _state(s))
        if s in (1, 2, 4):
            ckpt.mark_latest(root, s)  # 3 and 5 were written but never marked complete
    assert ckpt.resume_candidates(root) == [4, 2, 1]


def _draw() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(),
            torch.randint(0, 1000, (2,)).tolist())


def test_rng_state_round_trip_through_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    ckpt.save_checkpoint(str(tmp_path), 1, {"rng": ckpt.rng_state()})
    ckpt.mark_latest(str(tmp_path), 1)
    expected = _draw()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected  # really reseeded
    ckpt.set_rng_state(ckpt.load_checkpoint(str(tmp_path))["rng"])
    assert _draw() == expected


def test_set_rng_state_rejects_incomplete_state():
    with pytest.raises(ValueError, match="'numpy'"):
        ckpt.set_rng_state({"python": random.getstate(), "torch": torch.get_rng_state()})


def test_bad_step_and_rank(tmp_path):
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.save_checkpoint(str(tmp_path), -1, {})
    with pytest.raises(ValueError, match="rank='0'"):
        ckpt.save_checkpoint(str(tmp_path), 1, {}, rank="0")
    with pytest.raises(ValueError, match="step=True"):  # a bool is not step 1
        ckpt.save_checkpoint(str(tmp_path), True, {})
    with pytest.raises(ValueError, match="state: expected a dict, got list"):
        ckpt.save_checkpoint(str(tmp_path), 1, [1, 2])


def test_load_checks_step_and_rank(tmp_path):
    """A negative step or rank given to load_checkpoint is a ValueError naming it, not a
    search for `step_-00001` / `rank_-0001.pt`."""
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, _state(1))
    ckpt.mark_latest(root, 1)
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.load_checkpoint(root, step=-1)
    with pytest.raises(ValueError, match="rank=-1"):
        ckpt.load_checkpoint(root, rank=-1)


def test_step_with_a_step_dir_is_refused(tmp_path):
    """A step dir names its step: another `step` beside it is an error, not ignored."""
    d = ckpt.save_checkpoint(str(tmp_path), 1, _state(1))
    with pytest.raises(ValueError, match="step=2 given with a step dir"):
        ckpt.load_checkpoint(d, step=2)


def test_resume_candidates_without_latest_and_never_newer_than_latest(tmp_path):
    """No complete step means nothing to resume (steps saved but never marked do not count); a
    complete step newer than `latest` (latest moved back by hand) is not a candidate; with
    `latest` gone, every complete step is."""
    root = str(tmp_path)
    assert ckpt.resume_candidates(root) == []
    ckpt.save_checkpoint(root, 1, _state(1))
    assert ckpt.resume_candidates(root) == [] and ckpt.latest_problem(root) == ""
    for s in (1, 2, 3):
        ckpt.save_checkpoint(root, s, _state(s))
        ckpt.mark_latest(root, s)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("2\n")
    assert ckpt.resume_candidates(root) == [2, 1] and ckpt.latest_problem(root) == ""
    os.remove(os.path.join(root, "latest"))
    assert ckpt.resume_candidates(root) == [3, 2, 1] and ckpt.newest_step(root) == 3
    assert ckpt.latest_problem(root).endswith("latest is missing")


def test_only_exact_step_dir_names_are_steps(tmp_path):
    """A copy such as `step_000002.bak` (even one holding a `complete` marker) is neither a
    resume candidate nor read as a step dir."""
    import shutil

    root = str(tmp_path)
    for s in (1, 2):
        ckpt.save_checkpoint(root, s, _state(s))
        ckpt.mark_latest(root, s)
    backup = os.path.join(root, "step_000002.bak")
    shutil.copytree(ckpt.step_dir(root, 2), backup)
    ckpt.mark_latest(root, 1)
    assert ckpt.resume_candidates(root) == [1]
    with pytest.raises(FileNotFoundError, match="no 'latest' marker"):
        ckpt.load_checkpoint(backup)  # a root without `latest`, not step 2's dir


def test_numpy_integer_step_and_rank_are_accepted(tmp_path):
    """Steps and ranks that arrive as numpy integers name the same files as Python ints."""
    root = str(tmp_path)
    d = ckpt.save_checkpoint(root, np.int64(3), _state(3), rank=np.int32(1))
    assert d == ckpt.step_dir(root, 3) and os.path.isfile(ckpt.rank_file(d, 1))
    ckpt.save_checkpoint(root, 3, _state(3))
    ckpt.mark_latest(root, np.int64(3))
    _assert_same(ckpt.load_checkpoint(root, rank=np.int64(1), step=np.int64(3)), _state(3))


def test_load_honours_map_location(tmp_path):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, _state(1))
    ckpt.mark_latest(root, 1)
    assert ckpt.load_checkpoint(root, map_location="meta")["policy"]["w"].is_meta


@pytest.mark.parametrize("key", ["python", "numpy", "torch"])
def test_set_rng_state_names_each_missing_generator(key):
    """Each of the three required states, when missing, is a ValueError naming it (before
    anything is restored)."""
    state = ckpt.rng_state()
    del state[key]
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=f"lacks \\['{key}'\\]"):
        ckpt.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), before)


def test_listing_in_errors_leaves_out_tmp_files(tmp_path):
    """The "holds [...]" of a missing-file error lists real entries, not a killed save's .tmp."""
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, _state(1))
    ckpt.mark_latest(root, 1)
    open(os.path.join(root, ".latest.abc.tmp"), "w").close()
    with pytest.raises(FileNotFoundError, match=r"holds \[latest, step_000001\]$"):
        ckpt.load_checkpoint(root, step=4)


def test_cuda_rng_states_restore_for_the_devices_present(monkeypatch):
    """(CUDA faked) a state saved with 2 GPUs restores device 0 only on a 1-GPU process, and
    one saved without CUDA restores on a GPU process without error."""
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: set_calls.append((s, i)))
    base = {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}
    ckpt.set_rng_state(base)  # saved on a CPU-only machine
    assert set_calls == []
    s0, s1 = torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)
    ckpt.set_rng_state({**base, "cuda": [s0, s1]})
    assert [(s.tolist(), i) for s, i in set_calls] == [([1], 0)]


def _checksummed(directory, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    ckpt.write_checksum(path)
    return path


def test_verify_dir_checks_every_checksummed_file_split_over_the_ranks(tmp_path):
    """A resume with fewer ranks than wrote the checkpoint checks the missing ranks' shards too
    (a dist dir's `__1_0.distcp` on a 1-process resume), and a file whose checksum is there but
    which is gone is named."""
    d = str(tmp_path)
    _checksummed(d, "__0_0.distcp", b"a" * 100)
    other = _checksummed(d, "__1_0.distcp", b"b" * 100)
    ckpt.verify_dir(d)  # all good
    with open(other, "r+b") as f:
        f.write(b"X")
    with pytest.raises(ckpt.CheckpointError, match=r"__1_0.distcp is corrupt"):
        ckpt.verify_dir(d, rank=0, world_size=1)
    ckpt.verify_dir(d, rank=0, world_size=2)  # rank 1's share: the other rank checks it
    with pytest.raises(ckpt.CheckpointError, match=r"__1_0.distcp is corrupt"):
        ckpt.verify_dir(d, rank=1, world_size=2)
    os.remove(other)
    with pytest.raises(ckpt.CheckpointError, match=r"__1_0.distcp is missing"):
        ckpt.verify_dir(d)
    ckpt.verify_dir(str(tmp_path / "absent"))  # no dist dir: nothing to check


def test_prune_steps_keeps_the_newest_resume_candidates(tmp_path):
    """keep=2 of steps 1 (complete), 2 (half-written), 3 (complete), 4 (latest): 3 and 4 stay;
    keep=0 deletes nothing; a step newer than `latest` (a save in progress) is never touched."""
    root = str(tmp_path)
    for s in (1, 3, 4):
        ckpt.save_checkpoint(root, s, {"s": s}, rank=0)
        ckpt.mark_latest(root, s)
    os.makedirs(ckpt.step_dir(root, 2))  # no `complete` marker: a killed save
    os.makedirs(ckpt.step_dir(root, 5))  # being written now
    assert ckpt.prune_steps(root, 0) == []
    assert ckpt.prune_steps(root, 2) == [1, 2]
    assert sorted(os.listdir(root)) == ["latest", "step_000003", "step_000004", "step_000005"]
    assert ckpt.resume_candidates(root) == [4, 3]
    assert ckpt.prune_steps(root, 1) == [3] and ckpt.prune_steps(root, 1) == []
