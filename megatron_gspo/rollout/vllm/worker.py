"""Inside the workers of a vLLM engine server (`megatron_gspo.rollout.vllm.server`).

Shape legend: N tokens in one engine step, L MoE layers, K experts per token (top-k).

The server starts vLLM with `worker_extension_cls=WORKER_EXTENSION` (vLLM mixes the class into
each worker and imports this module there, before the model loads) and
`weight_transfer_config={"backend": BACKEND}`: importing this module registers
`GroupWeightTransfer` with vLLM's weight-transfer registry
(`vllm.distributed.weight_transfer`, the interface of vLLM's own NCCL / IPC backends), which
vLLM then builds in every worker. vLLM 0.32's built-in backends need CUDA (NCCL through its
PyNccl, CUDA IPC); this one broadcasts over a torch.distributed group (`vllm_wire.open_group`:
gloo on CPU, NCCL on a GPU) and is driven by vLLM's own `init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update` worker calls.

A push (`update_weights` with the weights' version): the buckets the trainer broadcasts
(`vllm_wire.receive_buckets`) go to `model.load_weights` inside vLLM's layerwise reload (what
`reload_weights` does in-process); `finish_weight_update` finalises it and redoes the CPU
packing a reload skips (`vllm_engine._reprepack_moe`, `_repack_tied_lm_head`; docs/vllm.md).

`mg_setup` (once, from the server): dies with the server (parent-death signal), installs the
log-probs-before-top-p sampler wrapper and, on worker 0 with routing capture, a
`StreamingCapture`, whose `mg_pop_routes` hands the server the routes of finished requests and
forgets them: a worker holds the routes of requests in flight only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from megatron_gspo.rollout.vllm import engine as vllm_engine
from megatron_gspo.rollout.vllm.capture import (RoutingCapture, install_logprobs_before_top_p,
                                                runner_of)
from megatron_gspo.rollout.vllm.wire import BACKEND, open_group, receive_buckets
from moe.platform.children import die_with_parent

try:  # only vLLM's workers import this module; elsewhere (no vLLM) it defines nothing usable
    import vllm
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload)
    from vllm.platforms import current_platform
except ImportError:
    WeightTransferEngine = WeightTransferInitInfo = WeightTransferUpdateInfo = object
    WeightTransferEngineFactory = None

@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """Where the weight-sync group meets: the trainer's rank 0 hosts it at host:port; this
    server's workers are ranks rank_offset + worker rank."""

    host: str
    port: int
    rank_offset: int
    world_size: int
    timeout_s: float


@dataclass
class GroupUpdateInfo(WeightTransferUpdateInfo):
    """One push: the version (`MoEPolicy.version`) every bucket must carry."""

    version: int


class GroupWeightTransfer(WeightTransferEngine):
    """vLLM weight-transfer backend over a torch.distributed group (module docstring)."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group, self.moe_layers, self.embedding = None, set(), False

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = open_group(init_info.host, init_info.port, rank, init_info.world_size,
                                init_info.timeout_s, torch.device(self.device))

    def start_weight_update(self) -> None:
        self.moe_layers, self.embedding = set(), False
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight push before init_weight_transfer_engine")
        error = None
        for version, tensors in receive_buckets(self.group):
            if error is not None:  # the rest of the broadcasts, so the trainer is not stuck
                continue
            try:
                if version != update_info.version:
                    raise RuntimeError(f"weight push: a bucket of version {version} in the "
                                       f"push of version {update_info.version}")
                for name, _ in tensors:
                    if (m := vllm_engine._EXPERT_LAYER.search(name)):
                        self.moe_layers.add(int(m.group(1)))
                    self.embedding |= "embed_tokens" in name
                self.model.load_weights(tensors)
            except Exception as e:
                error = e
        if error is not None:
            raise error

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        if not current_platform.is_cpu():
            return
        if vllm.__version__ not in vllm_engine.REPREPACK_VERSIONS:
            raise RuntimeError(f"vLLM {vllm.__version__} on CPU: what a weight reload leaves "
                               "unpacked was checked for vLLM "
                               f"{', '.join(vllm_engine.REPREPACK_VERSIONS)} only")
        if self.moe_layers:
            vllm_engine._reprepack_moe(self.model, self.moe_layers)
        if self.embedding:
            vllm_engine._repack_tied_lm_head(self.model)

    def shutdown(self) -> None:
        self.group = None


if WeightTransferEngineFactory is not None \
        and BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GroupWeightTransfer)


class StreamingCapture(RoutingCapture):
    """`RoutingCapture` always on, whose rows leave once popped (a request's last step may
    come after its output under async scheduling: rows of popped keys are dropped)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.active, self.closed = True, set()

    def _end_step(self, module, args, output):
        super()._end_step(module, args, output)
        for key in self.closed.intersection(self.rows):
            del self.rows[key]

    def pop(self, key: int, length: int | None) -> np.ndarray | None:
        """Routing [length, L, K] of `key` (None: dropped unread); the key is then closed."""
        try:
            return None if length is None else self.routing(key, length)
        finally:
            self.rows.pop(key, None)
            self.closed.add(key)


def tie_to_server(server_pid: int) -> None:
    """Die with the engine server `server_pid`: a worker process it started gets a
    parent-death signal; a worker in the server's own process (tensor_parallel_size 1, vLLM's
    "uni" executor) already dies with it."""
    if os.getpid() != server_pid:
        die_with_parent(server_pid)


class WorkerExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); called by name through
    `LLM.collective_rpc` from the server."""

    def mg_setup(self, capture_routing: bool, server_pid: int) -> int:
        """Die with the server (`server_pid`, this worker's parent), report log-probs before
        top-p, capture routing on worker 0; returns the number of MoE layers captured (0
        elsewhere)."""
        tie_to_server(server_pid)
        runner = runner_of(self)
        install_logprobs_before_top_p(runner)
        self.mg_capture = None
        if capture_routing and self.rank == 0:
            cfg = self.vllm_config.model_config
            self.mg_capture = StreamingCapture(runner, runner.get_model(),
                                               cfg.get_num_experts(),
                                               cfg.get_num_experts_per_tok())
            return self.mg_capture.num_layers
        return 0

    def mg_pop_routes(self, lengths: dict, idle: bool = False) -> dict | None:
        """{key: routing [length, L, K]} of finished requests (length None: dropped) on the
        capturing worker, None elsewhere; `idle` (no request in flight): forget closed keys."""
        capture = getattr(self, "mg_capture", None)
        if capture is None:
            return None
        out = {key: capture.pop(key, n) for key, n in lengths.items()}
        if idle:
            capture.rows.clear()
            capture.closed.clear()
        return {k: v for k, v in out.items() if v is not None}
