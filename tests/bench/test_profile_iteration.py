"""bench.profile_iteration.step_breakdown: the parts of a train step, timed without leaving a trace."""

import pytest

from tests.megatron_gspo.jobs.trainers import make_trainer
from bench.profile_iteration import OPTIMIZER_PARTS, STEP_PARTS, step_breakdown


def test_step_breakdown_times_each_part_and_restores_the_methods(tmp_path):
    trainer = make_trainer(tmp_path, "train.num_minibatches=2")
    calls = []
    step = trainer.policy.step
    trainer.policy.step = lambda: calls.append(1) or step()  # an instance attribute already there
    steps_before = trainer.state.opt_step
    table = step_breakdown(trainer, 1)
    assert trainer.state.opt_step - steps_before == 2 and len(calls) == 2  # the run's own hook ran
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert list(rows) == [name for name, _, _ in STEP_PARTS + OPTIMIZER_PARTS] + [
        "rest (metrics, flips, replay set-up)", "train_step"]
    ms = {name: float(line.split(" | ")[1]) for name, line in rows.items()}
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["optimizer"] > 0
    assert sum(ms[name] for name, _, _ in STEP_PARTS) <= ms["train_step"] + 0.1
    inside = [ms[name] for name, _, _ in OPTIMIZER_PARTS]  # timed inside "optimizer"
    assert all(t > 0 for t in inside[1:]) and sum(inside) <= ms["optimizer"] + 0.1
    assert "train_step" not in trainer.__dict__ and "loss_fn" in trainer.__dict__
    assert not {"token_logprobs", "backward"} & set(trainer.policy.__dict__)
    assert not {"prepare_grads", "get_grad_norm", "step_with_ready_grads"} & set(
        trainer.policy.optimizer.optimizer.__dict__)


def test_sync_sites_counts_each_synchronizing_line(monkeypatch):
    """`sync_sites` turns torch's per-call sync warnings into a table by call site, and leaves
    the debug mode back at default even when the run raises."""
    import warnings

    import torch

    from bench.profile_iteration import sync_sites

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)

    def run():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # this line: 3 syncs
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("an unrelated warning")

    table = sync_sites(run, top=5)
    lines = table.splitlines()
    assert modes == ["warn", 0]  # back to what it was
    assert lines[2].startswith("| `") and lines[2].endswith(" | 3 |")
    assert "`tests/bench/test_profile_iteration.py:" in lines[2]
    assert lines[-1] == "| total (2 sites) | 4 |"

    def broken():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        sync_sites(broken, top=5)
    assert modes[-1] == 0


def test_call_sites_are_named_from_their_package_root():
    from bench.profile_iteration import REPO, site

    assert site(f"{REPO}/moe/model/policy.py", 3) == "moe/model/policy.py:3"
    assert site("/usr/lib/python3/dist-packages/torch/a.py", 1) == "torch/a.py:1"
    assert site("/x/.venv/lib/python3.11/site-packages/megatron/core/b.py", 2) == \
        "megatron/core/b.py:2"
    assert site("/tmp/site/megatron/core/transformer/moe/c.py", 9) == \
        "megatron/core/transformer/moe/c.py:9"  # a `pip install --target` folder
    assert site("/elsewhere/d.py", 4) == "/elsewhere/d.py:4"
    assert site(f"{REPO}/.venv/lib/python3.11/site-packages/megatron/e.py", 5) == \
        "megatron/e.py:5"  # a venv inside the repository: still the package's path


def test_would_sync_sites_count_the_calls_that_read_device_values():
    """On any device: item / bool / masked_select count at the line that called them; plain
    ops, and calls made inside torch's own functions, at their caller's line or not at all."""
    import torch

    from bench.profile_iteration import would_sync_sites

    def run():
        x = torch.arange(6.0)
        for _ in range(2):
            x.item() if x.numel() == 1 else float(x.sum())  # this line: 2 syncs
        y = x * 2 + 1  # no sync
        if y.max() > 3:  # 1 sync (bool)
            x.masked_select(x > 2)  # 1 sync
        torch.nn.functional.relu(y)

    lines = would_sync_sites(run, top=5).splitlines()
    assert lines[2].endswith(" | 2 |") and "test_profile_iteration.py:" in lines[2]
    assert lines[-1] == "| total (3 sites) | 4 |"


def test_would_sync_sees_the_calls_that_sync_by_their_arguments():
    """One-argument where, boolean-mask indexing, repeat_interleave by a repeats tensor without
    output_size count; their non-syncing forms do not."""
    import torch

    from bench.profile_iteration import WouldSync

    x, mask = torch.arange(6.0), torch.arange(6) > 2
    repeats = torch.tensor([1, 2, 0, 1, 1, 1])
    syncing = [lambda: torch.where(mask), lambda: x[mask], lambda: x.view(2, 3)[:, mask[:3]],
               lambda: x.repeat_interleave(repeats), lambda: torch.repeat_interleave(x, repeats),
               lambda: torch.repeat_interleave(repeats), lambda: x.repeat_interleave(repeats[:1]),
               lambda: torch.argwhere(mask),
               lambda: torch.equal(x, x), lambda: x.unique(), lambda: x.numpy()]
    silent = [lambda: torch.where(mask, x, 0.0), lambda: x[torch.tensor([0, 2])], lambda: x[1:],
              lambda: x.repeat_interleave(repeats, output_size=6), lambda: x.repeat_interleave(2),
              lambda: x.to(torch.float64), lambda: x.index_select(0, repeats)]
    for i, fn in enumerate(syncing + silent):
        with WouldSync() as mode:
            fn()
        assert len(mode.records) == (1 if i < len(syncing) else 0), i
