"""Map between a full (1-process) state dict and this rank's TP/EP shard.

Shape-agnostic: it reads the attributes megatron-core puts on every parameter
(`tensor_model_parallel`, `partition_dim`) and the `is_moe_expert` tag instead of
hard-coding layer names, so it follows whatever layer spec built the model.

- TP-partitioned params (QKV and output projection, embeddings, output layer) are split into tp
  contiguous chunks along `partition_dim` (megatron's QKV layout is grouped by query group, so a
  contiguous split is the TP split). A gated (SwiGLU) `linear_fc1` outside the experts (the shared
  expert) is the exception: its full form is [gate; up] and each TP rank holds
  [gate chunk; up chunk] (megatron marks it `partition_stride=2`), so the two halves are
  chunked separately (`Shard.glu`).
- Expert params (tagged `is_moe_expert` by `moe.model`, `local_experts.<j>`) on EP rank r hold global expert `r * E_local + j`;
  expert tensor parallel is 1, so they are never split along TP.
- Everything else is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

_LOCAL_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)")


def _model_params(model) -> dict[str, torch.nn.Parameter]:
    inner = getattr(model, "module", model)
    return dict(inner.named_parameters())


def _local_experts_per_layer(names) -> int:
    ids = {int(m.group(2)) for n in names if (m := _LOCAL_EXPERT.search(n))}
    return max(ids) + 1 if ids else 0


def _global_name(name: str, ep_rank: int, n_local: int) -> str:
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * n_local + int(m.group(2))}"
                             f"{m.group(3)}", name)


@dataclass(frozen=True)
class Shard:
    """Which part of a full parameter one rank holds."""

    global_name: str
    """Name in the full (1-process) state dict: local expert ids made global."""
    dim: int | None
    """TP partition dim, or None when the rank holds the whole tensor."""
    rank: int
    """TP rank: which of the `parts` chunks along `dim`."""
    parts: int
    """TP size."""
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
        """The full tensor from every TP rank's slice (inverse of `take`)."""
        if self.glu:
            halves = [torch.chunk(p, 2, dim=0) for p in parts]
            return torch.cat([torch.cat([h[i] for h in halves]) for i in (0, 1)])
        return torch.cat(parts, dim=self.dim)


def shard_plan(model, tp_rank: int, tp: int, ep_rank: int) -> dict[str, Shard]:
    """For every local parameter, the part of the full parameter this rank holds."""
    params = _model_params(model)
    n_local = _local_experts_per_layer(params)
    plan = {}
    for name, param in params.items():
        split = getattr(param, "tensor_model_parallel", False) and tp > 1 and \
            not param.is_moe_expert
        plan[name] = Shard(_global_name(name, ep_rank, n_local),
                           param.partition_dim if split else None, tp_rank, tp,
                           glu=split and getattr(param, "partition_stride", 1) == 2)
    return plan


def shard_from_full(model, full: dict[str, torch.Tensor], tp_rank: int, tp: int,
                    ep_rank: int) -> dict[str, torch.Tensor]:
    """This rank's slice of every parameter, taken from a full state dict (params only)."""
    params = _model_params(model)
    out = {}
    for name, shard in shard_plan(model, tp_rank, tp, ep_rank).items():
        param, gname = params[name], shard.global_name
        if gname not in full:
            raise KeyError(f"full state dict has no entry {gname!r} (for local param {name!r})")
        tensor = shard.take(full[gname])
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
                            ps.get_expert_model_parallel_rank())
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
    layer's tensors together); names as in a 1-process model (global expert indices).
    Collective over the TP and EP groups per tensor: every rank must iterate to the end.
    Streams a model to a consumer (an inference engine's weight push) without holding it
    whole twice."""
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    params = _model_params(model)
    n_local = _local_experts_per_layer(params)
    plan = shard_plan(model, ps.get_tensor_model_parallel_rank(), tp, 0)
    for name, param in params.items():
        tensor = (param.main_grad if grads else param).detach()
        is_expert = param.is_moe_expert
        if plan[name].dim is not None:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
            tensor = plan[name].merge(parts)
        if is_expert and ep > 1:
            parts = [torch.empty_like(tensor) for _ in range(ep)]
            dist.all_gather(parts, tensor.contiguous(), group=ps.get_expert_model_parallel_group())
            for r, part in enumerate(parts):
                yield _global_name(name, r, n_local), part.cpu().clone()
            continue
        yield (_global_name(name, 0, n_local) if is_expert else name), tensor.cpu().clone()
