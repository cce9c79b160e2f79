"""Process-group set-up for the MoE policy: torchrun/NCCL on GPU, gloo on CPU.

One call, `init_parallel(tp, ep)`, initialises torch.distributed (from torchrun's env vars, or a
one-process group when launched as plain `python`), megatron's tensor / expert / data parallel
groups and its RNG tracker. Data parallel is whatever is left: world = tp * dp, with experts
sharded ep ways over the tp*dp ranks (expert tensor parallel = 1, the usual choice for
fine-grained MoE).

Every group gets the same collective timeout (`timeout_min`, default 10 minutes instead of
torch's 30): a rank stuck in a collective its peers never join (docs/pitfalls.md#collectives) then fails with
gloo's / NCCL's timeout error naming the operation instead of hanging for half an hour.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from moe.platform.compat import apply_cpu_patches, cuda_available


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits in the parallel layout."""

    rank: int
    world_size: int
    tp: int
    ep: int
    dp: int
    tp_rank: int
    ep_rank: int
    dp_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(timeout_min: float) -> None:
    backend = "nccl" if cuda_available() else "gloo"
    timeout = timedelta(minutes=timeout_min)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout)


def init_parallel(tp: int = 1, ep: int = 1, seed: int = 0,
                  timeout_min: float = 10.0, cudagraph_rng: bool = False) -> ParallelInfo:
    """Initialise torch.distributed and megatron's parallel state; idempotent per layout.

    `timeout_min` bounds every collective of the world and megatron's groups (it takes effect
    when the groups are created: the world group on the first call, megatron's groups on the
    first call and on a layout change). `cudagraph_rng`: megatron's graph-safe CUDA RNG
    tracker, which models built with CUDA graphs (`moe.model.gpt.build_gpt_moe(inference_graphs=
    True)`) require."""
    apply_cpu_patches()
    if not timeout_min > 0:
        raise ValueError(f"timeout_min={timeout_min} must be > 0")
    if not dist.is_initialized():
        _init_process_group(timeout_min)
    world = dist.get_world_size()
    if tp < 1 or ep < 1:
        raise ValueError(f"tp={tp} and ep={ep} must be >= 1")
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by tp={tp}")
    if world % ep:
        raise ValueError(f"world size {world} is not divisible by ep={ep}")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()) \
                != (tp, ep):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=1,
                                     distributed_timeout_minutes=timeout_min)
    # Without CUDA there is no CUDA RNG to track: megatron's inference tracker makes `fork()` a
    # no-op, so weights come from the CPU generator (we init on CPU and shard the master weight).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda_available(),
                                    force_reset_rng=True,
                                    **({"use_cudagraphable_rng": True} if cudagraph_rng else {}))
    torch.manual_seed(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() \
        else torch.device("cpu")
    return ParallelInfo(rank=dist.get_rank(), world_size=world, tp=tp, ep=ep, dp=world // tp,
                        tp_rank=ps.get_tensor_model_parallel_rank(),
                        ep_rank=ps.get_expert_model_parallel_rank(),
                        dp_rank=ps.get_data_parallel_rank(), device=device)


def broadcast_over_tp(obj):
    """`obj` (picklable) of the first rank of this rank's tensor-parallel group on every rank
    of the group, which all call this; `obj` itself without TP."""
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return obj
    box = [obj if ps.get_tensor_model_parallel_rank() == 0 else None]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else None
    dist.broadcast_object_list(box, src=ps.get_tensor_model_parallel_src_rank(),
                               group=ps.get_tensor_model_parallel_group(), device=device)
    return box[0]


def _dp_group():
    """This rank's data-parallel group (megatron's: the ranks of one tensor-parallel rank that
    hold different data, expert-parallel ranks included) and its size; (None, 1) without one."""
    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return None, 1
    return ps.get_data_parallel_group(), ps.get_data_parallel_world_size()


def all_gather_over_dp(obj) -> list:
    """`obj` (picklable) of every rank of this rank's data-parallel group, in DP rank order;
    `[obj]` without data parallelism. Every rank of the group calls it."""
    group, size = _dp_group()
    if group is None:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def exchange_over_dp(outgoing: dict[int, object]) -> dict[int, object]:
    """Objects sent point to point between the ranks of this rank's data-parallel group:
    `outgoing[d]` goes to DP rank d; returns {s: what DP rank s sent here}. Every rank of the
    group calls it. Who sends to whom is all-gathered first, then the pairs run one after
    another in the same order on every rank, so blocking sends cannot wait on each other in a
    cycle; only the ranks of a pair move its bytes (no rank receives the whole batch)."""
    group, _ = _dp_group()
    if group is None:
        return {}
    me, ranks = ps.get_data_parallel_rank(), dist.get_process_group_ranks(group)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else None
    incoming = {}
    for src, targets in enumerate(all_gather_over_dp(sorted(outgoing))):
        for dst in targets:
            if me == src:
                dist.send_object_list([outgoing[dst]], dst=ranks[dst], group=group,
                                      device=device)
            elif me == dst:
                box = [None]
                dist.recv_object_list(box, src=ranks[src], group=group, device=device)
                incoming[src] = box[0]
    return incoming


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group (for tests and clean exits)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
