"""Map between a full (1-process) state dict and this rank's TP/EP shard.

Shape-agnostic: it reads the attributes megatron-core puts on every parameter
(`tensor_model_parallel`, `partition_dim`) and the `is_moe_expert` tag instead of
hard-coding layer names, so it follows whatever layer spec built the model. Names are the same
on every rank and in the full dict.

- TP-partitioned params (QKV and output projection, embeddings, output layer) are split into tp
  contiguous chunks along `partition_dim` (megatron's QKV layout is grouped by query group, so a
  contiguous split is the TP split). A gated (SwiGLU) `linear_fc1` outside the experts (the shared
  expert) is the exception: its full form is [gate; up] and each TP rank holds
  [gate chunk; up chunk] (megatron marks it `partition_stride=2`), so the two halves are
  chunked separately (`Shard.glu`).
- Expert params (tagged `is_moe_expert` by `moe.model.gpt`: each MoE layer's stacked
  `experts.linear_fc{1,2}.weight`, [E_local, ...], `moe.model.experts`) are split ep ways along dim 0:
  EP rank r holds global experts r * E_local ... (r + 1) * E_local - 1. Expert tensor parallel
  is 1, so they are never split along TP.
- Everything else is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _model_params(model) -> dict[str, torch.nn.Parameter]:
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


@dataclass(frozen=True)
class Shard:
    """Which part of a full parameter one rank holds."""

    dim: int | None
    """The dim the parameter is split along (TP's partition dim; 0 for experts), or None when
    the rank holds the whole tensor."""
    rank: int
    """Which of the `parts` chunks along `dim`: the TP rank (the EP rank for experts)."""
    parts: int
    """How many chunks: TP's size (EP's for experts)."""
    experts: bool = False
    """Split over the expert-parallel ranks (an expert param), not the TP ranks."""
    glu: bool = False
    """The full tensor is [gate; up] along dim 0 and each half is chunked on its own
    (megatron's `partition_stride=2` for a gated fc1)."""

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor."""
        if self.dim is None:
            return full
        if self.glu:
            return torch.cat([torch.chunk(half, self.parts, dim=0)[self.rank]
                              for half in torch.chunk(full, 2, dim=0)])
        return torch.chunk(full, self.parts, dim=self.dim)[self.rank]

    def merge(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice (inverse of `take`)."""
        if self.glu:
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            return torch.cat([torch.cat([h[i] for h in halves]) for i in (0, 1)])
        return torch.cat(parts, dim=self.dim)


def shard_plan(model, tp_rank: int, tp: int, ep_rank: int, ep: int) -> dict[str, Shard]:
    """For every local parameter, the part of the full parameter this rank holds."""
    plan = {}
    for name, param in _model_params(model).items():
        if param.is_moe_expert:
            plan[name] = Shard(0 if ep > 1 else None, ep_rank, ep, experts=True)
            continue
        split = getattr(param, "tensor_model_parallel", False) and tp > 1
        plan[name] = Shard(param.partition_dim if split else None, tp_rank, tp,
                           glu=split and getattr(param, "partition_stride", 1) == 2)
    return plan


def shard_from_full(model, full: dict[str, torch.Tensor], tp_rank: int, tp: int,
                    ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This rank's slice of every parameter, taken from a full state dict (params only)."""
    params = _model_params(model)
    out = {}
    for name, shard in shard_plan(model, tp_rank, tp, ep_rank, ep).items():
        param = params[name]
        if name not in full:
            raise KeyError(f"full state dict has no entry {name!r}")
        tensor = shard.take(full[name])
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: shard shape {tuple(tensor.shape)} != param shape "
                             f"{tuple(param.shape)}")
        out[name] = tensor
    return out


@torch.no_grad()
def load_full_params(model, full: dict[str, torch.Tensor]) -> None:
    """Copy a full (1-process) parameter dict into this rank's sharded model."""
    shard = shard_from_full(model, full, ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size(),
                            ps.get_expert_model_parallel_rank(),
                            ps.get_expert_model_parallel_world_size())
    params = _model_params(model)
    for name, tensor in shard.items():
        params[name].copy_(tensor.to(params[name].dtype))


def gather_full_params(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full parameter (or, with `grads`, reduced gradient: `main_grad` after megatron's
    finalize, `tests/moe/grads.reduce_grads`) dict assembled from all TP/EP ranks.

    Collective over the TP and EP groups; every rank gets the whole dict, on CPU.
    """
    return dict(iter_full_params(model, grads))


@torch.no_grad()
def iter_full_params(model, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on CPU) of each parameter, one at a time, in the model's order (a
    layer's tensors together; an expert param holds every expert of its layer).
    Collective over the TP and EP groups per tensor: every rank must iterate to the end.
    Streams a model to a consumer (an inference engine's weight push) without holding it
    whole twice."""
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    plan = shard_plan(model, ps.get_tensor_model_parallel_rank(), tp,
                      ps.get_expert_model_parallel_rank(), ep)
    for name, param in _model_params(model).items():
        tensor, shard = (param.main_grad if grads else param).detach(), plan[name]
        if shard.dim is not None:
            group = ps.get_expert_model_parallel_group() if shard.experts \
                else ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(tensor) for _ in range(shard.parts)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            tensor = shard.merge(parts)
        yield name, tensor.cpu().clone()
