"""`moe.grads.global_grad_norm`: each distinct grad element once, squares summed in float64.

The 2-process layouts compare it with the 1-process model in test_parallel; here the rules
themselves, on hand-made parameters: which tensors count on a TP rank other than 0, which group
each partial sum is reduced over, float64 accumulation and the non-finite answer.
"""

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from tests.moe.grads import global_grad_norm


def param(*grad: float, expert: bool = False, tp_split: bool = False) -> torch.nn.Parameter:
    """An fp32 parameter holding `grad`, tagged as `moe.model.gpt` tags expert / TP-split tensors."""
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    p.grad = torch.tensor(grad, dtype=torch.float32)
    p.is_moe_expert = expert
    if tp_split:
        p.tensor_model_parallel = True
    return p


def params() -> dict:
    """One parameter of each kind; the grads' squares overflow fp32 (max ~3.4e38)."""
    frozen = torch.nn.Parameter(torch.ones(2))
    frozen.is_moe_expert = False  # no grad: skipped
    return dict(replicated=param(3e20, 4e20), split=param(2e20, tp_split=True),
                expert=param(1e20, 2e20, expert=True), frozen=frozen)


def sq(p) -> float:
    return sum(float(g) ** 2 for g in p.grad.double())


def test_one_process_counts_every_grad_in_float64(single_process):
    """fp32 grads of ~1e20 (squares past fp32's range) give the float64 norm, not inf/NaN; a
    parameter without a grad is skipped."""
    named = params()
    want = math.sqrt(sum(sq(p) for n, p in named.items() if n != "frozen"))
    assert global_grad_norm(named.values()) == pytest.approx(want, rel=1e-12)


def test_tp_rank_other_than_0_counts_its_shards_and_experts_only(single_process, monkeypatch):
    """Replicated dense grads are counted on TP rank 0 only (equal on every TP rank); TP
    shards and expert tensors on every rank."""
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)
    named = params()
    want = math.sqrt(sq(named["split"]) + sq(named["expert"]))
    assert global_grad_norm(named.values()) == pytest.approx(want, rel=1e-12)


def test_dense_sums_reduce_over_tp_and_expert_sums_over_ep(single_process, monkeypatch):
    """Several ranks: the dense partial sum is all-reduced over the TP group, the expert one
    over the EP group (here each group's other ranks hold the same sums: x2 over TP, x3 over
    EP), and the norm is taken from the reduced sums."""
    factors = {"tp-group": 2, "ep-group": 3}
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: "tp-group")
    monkeypatch.setattr(ps, "get_expert_model_parallel_group", lambda: "ep-group")
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 6)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: t.mul_(factors[group]))
    named = params()
    want = math.sqrt(2 * (sq(named["replicated"]) + sq(named["split"])) + 3 * sq(named["expert"]))
    assert global_grad_norm(named.values()) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_grad_gives_nan(single_process, bad):
    """inf or NaN anywhere: NaN (the optimizer's skip signal), never inf."""
    named = params()
    named["expert"].grad[0] = bad
    assert math.isnan(global_grad_norm(named.values()))
