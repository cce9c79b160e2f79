"""Sharded atomic checkpoints: round trip, latest pointer, crash safety, prune, RNG state."""

import os
import random
import re

import numpy as np
import pytest
import torch

from megatron_gspo import checkpoint as ckpt


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
    """A `latest` that holds no number, or points to a missing step, is an error naming it."""
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
        ckpt.resume_candidates(root)


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
