"""Small collectives the RL loop needs to keep ranks in step (no-ops on one process)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def reduce_int(value: int, op: str = "max") -> int:
    """`value` reduced over all ranks with "max" or "min" (an agreed flag, a step count)."""
    if not distributed():
        return int(value)
    flag = torch.tensor([int(value)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(flag, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return int(flag.item())
