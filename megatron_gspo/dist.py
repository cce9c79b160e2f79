"""Agreeing across ranks on data-dependent control flow (docs/pitfalls.md#collectives).

A loop whose trip count depends on a rank's own data (sampling until every row hit a stop token,
eval chunks over a rank's examples) must take the same number of trips on every rank that shares
collectives with it, or the ranks' collectives get out of step and the job hangs until the
process-group timeout. Under expert parallelism every decode step runs the MoE layer's
all-to-all, and here experts are sharded EP ways over the tp*dp ranks, so that all-to-all spans
data-parallel ranks, which sample different prompts.

The agreement is over the whole world (`dist.group.WORLD`): it is a superset of every TP, EP and
DP group, so it is correct for any layout, and one scalar all-reduce per decode step is
negligible next to the step's forward. Under pure DP (no collective in the forward) it makes
ranks that finished early decode padding until the slowest is done, which is where they would
otherwise wait anyway (the next gradient all-reduce). With one process nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Number of ranks (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _reduce_int(value: int, op) -> int:
    if world_size() == 1:
        return int(value)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return int(t.item())


def all_ranks(flag: bool) -> bool:
    """True iff `flag` is true on every rank (collective: every rank must call it)."""
    return bool(_reduce_int(int(bool(flag)), dist.ReduceOp.MIN))


def max_over_ranks(value: int) -> int:
    """The largest `value` over all ranks (collective: every rank must call it)."""
    return _reduce_int(value, dist.ReduceOp.MAX)


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Scalar metrics over all ranks: MAX for `*/max` keys, MIN for `*/min`, the mean otherwise
    (identical keys on every rank; collective: every rank must call it)."""
    if world_size() == 1 or not metrics:
        return metrics
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for suffix, op in (("/max", dist.ReduceOp.MAX), ("/min", dist.ReduceOp.MIN),
                       ("", dist.ReduceOp.SUM)):
        keys = sorted(k for k in metrics if k not in out and k.endswith(suffix))
        if not keys:
            continue
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64,
                              device=device)
        dist.all_reduce(values, op=op)
        if not suffix:
            values /= world_size()
        out.update(zip(keys, values.cpu().tolist()))
    return {k: out[k] for k in metrics}


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all ranks (float64 on the host; collective: every rank must call it)."""
    t = t.double()
    if world_size() == 1:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    out = t.to(device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.cpu()


def gather_rows(t_NC: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of `t_NC` [n, C] (n may differ by rank), concatenated in rank order
    (float64 on the host; collective: every rank must call it). For statistics that do not
    decompose into sums, such as a median."""
    t_NC = t_NC.double().cpu()
    if world_size() == 1:
        return t_NC
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    n = max_over_ranks(t_NC.shape[0])
    padded = torch.full((n, t_NC.shape[1] + 1), float("nan"), dtype=torch.float64)
    padded[:t_NC.shape[0], :-1], padded[:t_NC.shape[0], -1] = t_NC, 1.0  # last column: a real row
    parts = [torch.empty_like(padded, device=device) for _ in range(world_size())]
    dist.all_gather(parts, padded.to(device))
    out = torch.cat(parts).cpu()
    return out[out[:, -1] == 1.0, :-1]


def broadcast_object(obj, src: int = 0):
    """`obj` (picklable) of rank `src` on every rank (collective: every rank must call it)."""
    if world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == src else None]
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else None
    dist.broadcast_object_list(box, src=src, device=device)
    return box[0]
