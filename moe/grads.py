"""Parallel-aware gradient norm for a TP/EP/DP-sharded megatron model.

Each distinct parameter element is counted once: a TP-partitioned tensor contributes its shard on
every TP rank, a TP-replicated tensor only on TP rank 0 (after DDP's reduce its grads are equal on
all TP ranks), and expert tensors (tagged `is_moe_expert` by `moe.model`; expert tensor parallel
is 1 here) contribute on every EP rank, since each EP rank holds different experts. DP replicas
hold identical reduced grads and are not summed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def global_grad_norm(params) -> float:
    """L2 norm of all grads over the whole (unsharded) model; same value on every rank."""
    from megatron.core import parallel_state as ps

    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if p.is_moe_expert:
            expert_sq += sq
        elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense_sq += sq
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
        dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    total = float(dense_sq) + float(expert_sq)
    return math.sqrt(total) if math.isfinite(total) else float("nan")
