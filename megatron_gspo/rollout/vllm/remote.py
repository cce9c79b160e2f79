"""The trainer's side of `rollout.vllm.mode=server`: engine server processes and their clients.

Shape legend: P prompt tokens, R sampled tokens, L MoE layers, K experts per token (top-k).

`RemoteEngine` is what `VLLMSampler` samples through in server mode, on every trainer rank:

- start: rank 0 starts `rollout.vllm.replicas` servers (`vllm_launch.EngineProcess`: `python
  -m megatron_gspo.rollout.vllm.server`, a new session, killed by the kernel when rank 0 dies,
  its log in a temporary folder) or takes `rollout.vllm.addresses`; it has each build the
  model (`server`'s `build`) and opens the weight-sync group with their workers
  (`vllm_wire.open_group`). Every rank that samples (the first of each tensor-parallel group)
  connects to its replica, (rank // TP) mod replicas. A server that exits, does not answer
  within `start_timeout_s`, an address where nothing listens, a port in use: one line.
- `generate`: this rank's requests to its replica; the samples come back in chunks as they
  finish (`server`), each checked to carry the version pushed.
- `push`: collective: every rank iterates the stream (the gathers over TP / EP); rank 0 sends
  it to all workers of all replicas in buckets (`vllm_wire.send_buckets`), version-stamped.
- a lost engine (its process died, its connection closed, `request_timeout_s` without an
  answer) raises `EngineLost` on the ranks that saw it; `lost_replicas` (collective) tells
  every rank which; `restart` (collective) starts those servers again, rebuilds the group,
  and the sampler re-pushes and re-sends: at most `max_restarts` times a run, never for
  engines at addresses. Restart rather than stop: the samples are drawn with per-request
  seeds, so the re-sent requests draw what the lost ones would have.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_gspo.dist import broadcast_object, sum_over_ranks
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.vllm.engine import EngineResult
from megatron_gspo.rollout.vllm.launch import EngineProcess, open_channel
from megatron_gspo.rollout.vllm.wire import ChannelClosed, open_group, rendezvous, send_buckets
from moe.platform.parallel import free_port


ALL = -1
"""`EngineLost.replica` when the weight-sync group broke: every replica restarts."""


class EngineLost(RuntimeError):
    """An engine server died, closed its connection or stopped answering."""

    def __init__(self, replica: int, why: str):
        super().__init__(replica, why)
        self.replica, self.why = replica, why

    def __str__(self) -> str:
        who = "an engine server" if self.replica == ALL else f"engine server {self.replica}"
        return f"{who} was lost: {self.why}"


def call(chan, msg: dict, timeout_s: float, replica: int) -> dict:
    """Send `msg`, return the answer; EngineLost if the server is gone or silent, RuntimeError
    for an error it reports."""
    try:
        chan.send(msg)
        return answer(chan, timeout_s, replica)
    except (ChannelClosed, TimeoutError) as e:
        raise EngineLost(replica, str(e)) from None


def answer(chan, timeout_s: float, replica: int) -> dict:
    """The server's next message; EngineLost if it is gone or silent, UserError when it serves
    another run, RuntimeError for an error it reports."""
    try:
        reply = chan.recv(timeout_s)
    except (ChannelClosed, TimeoutError) as e:
        raise EngineLost(replica, str(e)) from None
    if reply.get("busy"):
        raise UserError(f"rollout.vllm engine server {replica}: {reply['error']}")
    if reply.get("engine_failed"):
        raise EngineLost(replica, reply["error"])
    if "error" in reply:
        raise RuntimeError(f"engine server {replica}: {reply['error']}")
    return reply


class RemoteEngine:
    """Engine servers seen from one trainer rank (see the module docstring)."""

    def __init__(self, spec: dict, vcfg, *, rank: int, tp: int, tp_rank: int, run: str = ""):
        self.spec, self.vcfg, self.rank = spec, vcfg, rank
        self.run = run or f"trainer pid {os.getpid()} on {socket.gethostname()}"
        self.replicas = vcfg.num_replicas
        self.sender = tp_rank == 0
        self.replica = (rank // tp) % self.replicas
        self.procs: list[EngineProcess | None] = [None] * self.replicas
        self.chans: dict[int, object] = {}  # replica -> channel (rank 0: all; senders: theirs)
        self.group, self.restarts, self.calls = None, 0, 0
        self.logs = tempfile.mkdtemp(prefix="megatron_gspo_vllm_logs_") \
            if rank == 0 and not vcfg.addresses else None  # the servers it starts log there
        self.keep_logs = False
        self.num_layers = 0
        try:
            self._start(range(self.replicas))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start / restart
    def _addresses(self) -> list[tuple[str, int]]:
        if self.vcfg.addresses:
            return [(h.strip("[]"), int(p)) for h, _, p in
                    (a.rpartition(":") for a in self.vcfg.addresses)]
        return [(p.host, p.port) if p else None for p in self.procs]

    def _start(self, replicas) -> None:
        """Collective: (re)start `replicas` (rank 0), connect, build, open the weight group;
        then the other ranks that sample connect. One line on every rank if any failed."""
        failure = None
        try:
            if self.rank == 0:
                self.group = None  # its rendezvous frees the port this one may reuse
                store = self._rendezvous()  # before anything is started or waited for
                if not self.vcfg.addresses:
                    for r in replicas:
                        self.procs[r] = EngineProcess(r, self.vcfg, self.logs)
                self._connect(replicas, self._addresses())
                self._build(replicas)
                self._open_group(*store)
        except UserError as e:
            failure = str(e)
        addresses = broadcast_object(None if failure else self._addresses())
        try:
            if self.rank != 0 and addresses is not None and self.sender \
                    and self.replica in replicas:
                self._connect([self.replica], addresses)
        except UserError as e:
            failure = str(e)
        first = broadcast_object(failure)  # rank 0's, the one most likely to say why
        if sum_over_ranks(torch.tensor([failure is not None], dtype=torch.float64)).item():
            self.keep_logs = True
            raise UserError(failure or first or "rollout.vllm: another trainer rank could not "
                            "reach its engine server (its message is in its output)")

    def _connect(self, replicas, addresses) -> None:
        for r in replicas:
            if r in self.chans:
                self.chans.pop(r).close()
            self.chans[r] = open_channel(*addresses[r], self.vcfg.start_timeout_s,
                                         self.procs[r], f"rollout.vllm engine server {r}")

    def _build(self, replicas) -> None:
        for r in replicas:
            try:
                reply = call(self.chans[r], self._op("build", spec=self.spec,
                                                     chunk_mb=self.vcfg.chunk_mb),
                             self.vcfg.start_timeout_s, r)
            except (RuntimeError, EngineLost) as e:
                raise UserError(f"rollout.vllm engine server {r}: building the engine failed: "
                                f"{e}") from None
            self.num_layers = reply["layers"]

    def _op(self, op: str, **fields) -> dict:
        """A message to a server: `op`, this trainer's run (a server serves one) and `fields`."""
        return {"op": op, "run": self.run, **fields}

    def _rendezvous(self) -> tuple:
        """(store, host, port) of the weight-sync group's rendezvous, which rank 0 hosts; a
        port that cannot be listened on is one line at once, before any engine starts."""
        host = self.vcfg.sync_host or "127.0.0.1"
        port = self.vcfg.sync_port or free_port()
        try:
            return rendezvous(host, port, 0, self.vcfg.request_timeout_s), host, port
        except RuntimeError as e:  # torch's DistNetworkError: EADDRINUSE, EADDRNOTAVAIL
            why = re.search(r"message: ([^\n]+)", str(e))
            raise UserError(f"rollout.vllm.sync_port={self.vcfg.sync_port}: the weight-sync "
                            f"rendezvous cannot listen on {host}:{port} "
                            f"({why.group(1) if why else str(e).splitlines()[0]}): set "
                            "rollout.vllm.sync_port to a free port (0: one picked at start)") \
                from None

    def _open_group(self, store, host: str, port: int) -> None:
        """Rank 0 and every worker of every replica: a new weight-sync group over `store` at
        host:port. Each server says how many workers it has (a running one at an address has
        its own --tensor-parallel-size, whatever rollout.vllm.tensor_parallel_size says)."""
        timeout = self.vcfg.start_timeout_s
        try:
            tps = [call(self.chans[r], self._op("hello"), timeout, r)["tp"]
                   for r in range(self.replicas)]
        except (RuntimeError, EngineLost) as e:
            raise UserError(f"rollout.vllm: an engine server did not say its size: {e}") \
                from None
        offsets = [1 + sum(tps[:r]) for r in range(self.replicas)]
        world = 1 + sum(tps)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        with ThreadPoolExecutor(self.replicas) as pool:
            futures = [pool.submit(call, self.chans[r], self._op("init_weights", init_info={
                "host": host, "port": port, "rank_offset": offsets[r], "world_size": world,
                "timeout_s": self.vcfg.request_timeout_s}), timeout, r)
                for r in range(self.replicas)]
            try:
                self.group = open_group(host, port, 0, world, self.vcfg.request_timeout_s,
                                        device, store)
                for f in futures:
                    f.result()
            except (RuntimeError, EngineLost) as e:
                raise UserError(f"rollout.vllm: the weight-sync group with the engine workers "
                                f"did not form at {host}:{port}: {e}") from None

    def lost_replicas(self, lost: EngineLost | None, failed: bool = False
                      ) -> tuple[list[int], bool]:
        """Collective: the replicas any rank lost (rank 0 also counts servers it started that
        exited), and whether any rank `failed` otherwise."""
        flags = torch.zeros(self.replicas + 1, dtype=torch.float64)
        if lost is not None:
            flags[slice(0, self.replicas) if lost.replica == ALL else lost.replica] = 1
        if self.rank == 0:
            for r, p in enumerate(self.procs):
                flags[r] += p is not None and p.exited() is not None
        flags[-1] = failed
        total = sum_over_ranks(flags).tolist()
        return [r for r, n in enumerate(total[:-1]) if n > 0], total[-1] > 0

    def restart(self, replicas: list[int], why: str) -> None:
        """Collective: start `replicas` again (the caller re-pushes), or stop in one line."""
        self.keep_logs = True
        if self.vcfg.addresses:
            raise UserError(f"rollout.vllm: {why}; engines at rollout.vllm.addresses are not "
                            "restarted by the trainer: restart it and resume the run")
        if self.restarts + len(replicas) > self.vcfg.max_restarts:
            raise UserError(f"rollout.vllm: {why}; rollout.vllm.max_restarts="
                            f"{self.vcfg.max_restarts} restarts used: stopping (checkpoints "
                            f"and metrics kept; server logs: {self.logs})")
        self.restarts += len(replicas)
        if self.rank == 0:
            for r in replicas:
                self.procs[r].stop(timeout_s=0)
        self._start(replicas)

    # ------------------------------------------------------------------ sampling
    def generate(self, requests: list[tuple[list[int], dict]], version: int, *,
                 routes: bool, replica: int | None = None) -> list[EngineResult]:
        """Samples of this rank's requests from its replica (or `replica`), in order."""
        rows = self._request(requests, version, routes, False, replica)
        return [EngineResult(row["prompt"], row["tokens"], row["logprobs"], row["routes"],
                             row["finish_reason"]) for row in rows]

    def logprobs_of(self, token_ids: list[int], version: int, replica: int) -> list[float]:
        """log p(t_i | t_<i), i >= 1, at temperature 1 (the engine's prompt log-probs)."""
        kwargs = dict(max_tokens=1, detokenize=False, logprobs=0)
        return self._request([(list(token_ids), kwargs)], version, False, True,
                             replica)[0]["prompt_logprobs"]

    def _request(self, requests, version: int, routes: bool, prompt_logprobs: bool,
                 replica: int | None) -> list[dict]:
        r = self.replica if replica is None else replica
        chan, self.calls = self.chans[r], self.calls + 1
        try:
            chan.send(self._op("generate", call=self.calls, version=version, requests=requests,
                               routes=routes, prompt_logprobs=prompt_logprobs))
        except ChannelClosed as e:
            raise EngineLost(r, str(e)) from None
        rows: dict[int, dict] = {}
        while len(rows) < len(requests):
            reply = answer(chan, self.vcfg.request_timeout_s, r)
            if reply.get("version") != version:
                raise RuntimeError(f"engine server {r} answered with weights of version "
                                   f"{reply.get('version')}, not {version}")
            rows.update((row["row"], row) for row in reply["rows"])
        return [rows[i] for i in range(len(requests))]

    # ------------------------------------------------------------------ weights
    def push(self, stream, version: int) -> float:
        """Collective: rank 0 broadcasts `stream` to every worker; the others drain it (its
        gathers are collectives). Returns the seconds the servers took to load it (rank 0)."""
        if self.rank != 0:
            for _ in stream:
                pass
            return 0.0
        lost, t0 = None, time.perf_counter()
        for r in range(self.replicas):
            try:
                self.chans[r].send(self._op("push", version=version))
            except ChannelClosed as e:
                lost = lost or EngineLost(r, str(e))
        try:
            if lost is None:
                send_buckets(self.group, stream, version, int(self.vcfg.bucket_mb * 2**20))
        except RuntimeError as e:  # a worker gone mid-broadcast (gloo / NCCL error)
            lost = EngineLost(ALL, f"the weight broadcast failed: {str(e).splitlines()[0]}")
        for _ in stream:  # the rest of the gathers, in step with the other ranks
            pass
        error = None
        for r in range(self.replicas):
            if lost is None:
                try:
                    answer(self.chans[r], self.vcfg.request_timeout_s, r)
                except EngineLost as e:
                    lost = e
                except RuntimeError as e:  # the server's own error (a load that failed)
                    error = error or e
        if error is not None and lost is None:
            raise error
        if lost is not None:  # the group is broken: every replica starts again
            raise EngineLost(ALL, lost.why)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close the servers this trainer started (waiting for them to exit) and the channels;
        the log folder is removed unless an engine failed."""
        for r, proc in enumerate(self.procs):
            if proc is not None and r in self.chans:
                try:
                    self.chans[r].send(self._op("close"))
                except ChannelClosed:
                    pass
        for chan in self.chans.values():
            chan.close()
        self.chans = {}
        for proc in self.procs:
            if proc is not None:
                proc.stop()
        self.procs = [None] * self.replicas
        self.group = None
        if self.logs and not self.keep_logs:
            shutil.rmtree(self.logs, ignore_errors=True)
