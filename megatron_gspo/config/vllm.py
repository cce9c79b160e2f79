"""The `rollout.vllm` section: where the vLLM engine runs and how the trainer reaches it.

A section nested in `rollout` (the loader builds any dataclass-typed field as a section:
`rollout.vllm.mode=server` overrides, a `vllm:` mapping under `rollout:` in YAML). It holds the
settings only the vLLM backend reads: the engine's precision, its KV cache and the push guard,
then those that describe the deployment (mode, sizes, addresses, timeouts, buffers), which change
nothing the trainer computes, so a resume may change them (`megatron_gspo.run.rundir`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from megatron_gspo.config.fields import check, may_change, validate


def split_address(text: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" (IPv6 in brackets: "[::1]:8000"), or None if malformed."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class VLLMConfig:
    """backend=vllm: the engine in this process, or as engine server processes (vLLM with its own
    tensor parallelism) that the trainer starts or connects to (docs/vllm.md)."""
    _section: ClassVar[str] = "rollout.vllm"

    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """The engine's precision ("auto": the model's, model.dtype); bf16 with an fp32 trainer is
    the train-inference mismatch R3 removes."""
    kv_cache_gb: float = may_change(1.0)
    """The engine's KV cache, in GiB (vLLM otherwise reserves a fraction of the host's or GPU's
    memory)."""
    push_check_tol: Optional[float] = may_change(None)
    """After each weight push the engine's and the trainer's log-probs of the engine's greedy
    continuation of a fixed prompt may differ by at most this (nats, over its tokens the mean
    for a float32 engine, median for bfloat16) or the run stops before sampling; None: 1e-4 for
    a float32 engine, 0.8 for bfloat16. May change on resume."""
    mode: Literal["in_process", "server"] = may_change("in_process")
    """"in_process": one engine inside each trainer rank (tensor_parallel_size 1). "server":
    engine server processes (`megatron_gspo.rollout.vllm.server`) with their own tensor
    parallelism; rollouts, log-probs and routes come back over a socket, weights over a
    torch.distributed group between the trainer's rank 0 and the engine workers."""
    tensor_parallel_size: int = may_change(1)
    """mode=server: vLLM's tensor-parallel size of each engine server (its worker processes);
    engines started by the trainer only (a running engine at an address has its own
    --tensor-parallel-size, which it tells the trainer)."""
    replicas: int = may_change(1)
    """mode=server: engine servers the trainer starts (data-parallel replicas); the trainer's
    data-parallel groups are spread over them. With addresses: 1 or len(addresses)."""
    addresses: Optional[list] = may_change(None)
    """mode=server: ["host:port", ...] of engine servers already running (one per replica,
    started with `python -m megatron_gspo.rollout.vllm.server`); the trainer connects to them
    and never stops them. None: the trainer starts them on its rank 0's machine."""
    host: str = may_change("127.0.0.1")
    """mode=server: the address engine servers started by the trainer listen on."""
    port: int = may_change(0)
    """mode=server: port of the first started server (replica i listens on port + i); 0: free
    ports picked at start."""
    sync_host: Optional[str] = may_change(None)
    """mode=server: an address of the trainer's rank 0 that the engine workers can reach, where
    it opens the weight-sync group's rendezvous; None: 127.0.0.1 (engines on this machine;
    required with addresses elsewhere)."""
    sync_port: int = may_change(0)
    """mode=server: the weight-sync rendezvous port on sync_host; 0: a free port."""
    start_timeout_s: float = may_change(900.0)
    """mode=server: seconds an engine server may take to answer after its start (vLLM loads,
    spawns its workers, allocates its KV cache) or when connecting to a running one."""
    request_timeout_s: float = may_change(1800.0)
    """mode=server: seconds the trainer waits for the next message of an engine during a
    rollout or a weight push before it counts the engine as lost."""
    max_restarts: int = may_change(2)
    """mode=server, started engines: how many times in a run an engine server that died (or
    stopped answering) is started again, re-pushed and its rollout re-sent; then the run stops
    in one line. Engines at addresses are never restarted (the run stops at once)."""
    bucket_mb: float = may_change(256.0)
    """mode=server: weights are broadcast to the engine workers in buckets of at most this many
    MiB (one tensor larger than that travels alone): the trainer's rank 0 and each engine
    worker hold one bucket at a time beside the models."""
    chunk_mb: float = may_change(16.0)
    """mode=server: an engine server streams finished samples (tokens, log-probs, routes) to a
    trainer rank in chunks of about this many MiB of routes, as requests finish."""
    cpu_bind: Optional[str] = may_change(None)
    """mode=server, started engines on CPU: vLLM's VLLM_CPU_OMP_THREADS_BIND for each server
    (cores per worker separated by |, e.g. "0-7|8-15"); None: the variable of the environment,
    else this machine's cores split evenly over tensor_parallel_size workers."""

    def __post_init__(self):
        validate(self, nonempty=("host", "sync_host", "cpu_bind"),
                 ge={"tensor_parallel_size": 1, "replicas": 1, "port": 0, "sync_port": 0,
                     "max_restarts": 0},
                 gt={"start_timeout_s": 0, "request_timeout_s": 0, "bucket_mb": 0,
                     "chunk_mb": 0, "kv_cache_gb": 0, "push_check_tol": 0})
        check(self, "port", self.port + self.replicas - 1 < 65536, "must be < 65536 - replicas")
        check(self, "sync_port", self.sync_port < 65536, "must be < 65536")
        server = self.mode == "server"
        for name in ("tensor_parallel_size", "replicas"):
            check(self, name, server or getattr(self, name) == 1,
                  "needs rollout.vllm.mode=server (in_process runs one engine per trainer rank)")
        check(self, "addresses", server or self.addresses is None,
              "needs rollout.vllm.mode=server")
        if self.addresses is None:
            return
        check(self, "addresses", len(self.addresses) > 0 and all(
            isinstance(a, str) and split_address(a) for a in self.addresses),
              'expected a list of "host:port"')
        check(self, "replicas", self.replicas in (1, len(self.addresses)),
              f"must be 1 or len(rollout.vllm.addresses)={len(self.addresses)}")
        remote = [a for a in self.addresses if split_address(a)[0] not in LOOPBACK]
        check(self, "sync_host", not remote or self.sync_host is not None,
              f"must be an address of the trainer's rank 0 that the engines at {remote[0]} "
              "can reach (their workers join its weight-sync group)" if remote else "")

    @property
    def num_replicas(self) -> int:
        """Engine servers: len(addresses), or replicas when the trainer starts them."""
        return len(self.addresses) if self.addresses else self.replicas
