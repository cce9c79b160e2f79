"""megatron_gspo.dist: the reduction each helper applies across ranks.

One process plays rank 0 of 2: `dist.all_reduce` is replaced by a peer that combines this rank's
tensor with the other rank's values (queued in `peer`, one entry per collective) by the op asked
for, as gloo would. The real 2-process run is in test_rank_sync.py (slow)."""

import pytest
import torch
import torch.distributed as dist

from megatron_gspo import dist as dist_utils

OPS = ((dist.ReduceOp.SUM, torch.add), (dist.ReduceOp.MAX, torch.maximum),
       (dist.ReduceOp.MIN, torch.minimum))


@pytest.fixture
def peer(monkeypatch):
    """The other rank's contributions, consumed in call order."""
    queue = []

    def all_reduce(t, op=dist.ReduceOp.SUM):
        combine = next(f for o, f in OPS if o == op)
        t.copy_(combine(t, torch.as_tensor(queue.pop(0), dtype=t.dtype)))

    monkeypatch.setattr(dist_utils, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    yield queue
    assert not queue  # every contribution was reduced


def test_all_ranks_is_true_only_when_every_rank_is(peer):
    peer.extend([[1], [0], [1]])
    assert dist_utils.all_ranks(True) is True
    assert dist_utils.all_ranks(True) is False
    assert dist_utils.all_ranks(False) is False


def test_max_over_ranks_is_the_largest_value(peer):
    peer.extend([[11], [2]])
    assert dist_utils.max_over_ranks(3) == 11
    assert dist_utils.max_over_ranks(5) == 5


def test_reduce_metrics_takes_max_min_and_mean_by_suffix(peer):
    """`*/max` by MAX, `*/min` by MIN, the rest averaged over the 2 ranks; keys come back in
    the caller's order (one collective per kind, keys sorted within it)."""
    peer.extend([[4.0], [3.0, 0.5], [3.0, 5.0]])  # /max keys, /min keys, the other keys
    metrics = {"y": 3.0, "x/max": 1.0, "x/min": 2.0, "x": 1.0, "a/min": 1.0}
    out = dist_utils.reduce_metrics(metrics)
    assert list(out) == list(metrics)
    assert out == {"y": 4.0, "x/max": 4.0, "x/min": 0.5, "x": 2.0, "a/min": 1.0}


def test_sum_over_ranks_sums_in_float64(peer):
    peer.append([0.25, 1.0])
    out = dist_utils.sum_over_ranks(torch.tensor([0.5, 1e-8], dtype=torch.float32))
    assert out.dtype == torch.float64
    assert out.tolist() == [0.75, torch.tensor(1e-8, dtype=torch.float32).item() + 1.0]


def test_one_process_sum_is_float64_and_communicates_nothing(monkeypatch):
    monkeypatch.setattr(dist_utils, "world_size", lambda: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("collective called"))
    t = torch.tensor([0.1], dtype=torch.float32)
    out = dist_utils.sum_over_ranks(t)
    assert out.dtype == torch.float64 and out.item() == t.item()
