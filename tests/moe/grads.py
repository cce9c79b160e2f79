"""Test helpers: reduce a policy's grads as training does, and their parallel-aware norm for a
TP/EP/DP-sharded megatron model (the reference megatron's optimizer norm is checked against).

Each distinct parameter element is counted once: a TP-partitioned tensor contributes its shard on
every TP rank, a TP-replicated tensor only on TP rank 0 (after DDP's reduce its grads are equal on
all TP ranks), and expert tensors (tagged `is_moe_expert` by `moe.model.gpt`; expert tensor parallel
is 1 here) contribute on every EP rank, since each EP rank holds different experts. DP replicas
hold identical reduced grads and are not summed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def reduce_grads(policy) -> float:
    """Reduce the policy's grads across DP/TP as `MoEPolicy.step` does before the optimizer
    (megatron's finalize: into each parameter's `main_grad`) and return their global norm.
    Call `policy.zero_grad()` before the next backward."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([policy.model])
    params = [p for p in policy.model.module.parameters() if p.requires_grad]
    return global_grad_norm(params, grad=lambda p: p.main_grad)


def reduced_grads(policy) -> dict[str, torch.Tensor]:
    """The local reduced grads by parameter name (copies), after `reduce_grads`."""
    return {n: p.main_grad.clone() for n, p in policy.model.module.named_parameters()}


def global_grad_norm(params, grad=lambda p: p.grad) -> float:
    """L2 norm of all grads over the whole (unsharded) model; same value on every rank."""
    from megatron.core import parallel_state as ps

    params = [p for p in params if grad(p) is not None]
    device = grad(params[0]).device if params else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for p in params:
        sq = grad(p).detach().double().pow(2).sum()
        if p.is_moe_expert:
            expert_sq += sq
        elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense_sq += sq
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    total = float(dense_sq) + float(expert_sq)
    return math.sqrt(total) if math.isfinite(total) else float("nan")


def dense_cache(ids_BTLK: torch.Tensor, valid_BT: torch.Tensor, num_experts: int):
    """A `moe.routing.replay.RoutingReplayCache` from batch-first ids [B, T, L, K] (a forced routing)."""
    from moe.routing.replay import RoutingReplayCache, ids_dtype

    return RoutingReplayCache(ids_BTLK[valid_BT.bool()].to(ids_dtype(num_experts)),
                              valid_BT.bool(), num_experts)
