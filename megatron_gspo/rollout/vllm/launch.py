"""Engine server processes a trainer starts, and reaching a server (`rollout.vllm.mode=server`).

`EngineProcess` is one server the trainer's rank 0 started: `python -m
megatron_gspo.rollout.vllm.server` in a new session, killed by the kernel when rank 0 dies,
its log in the trainer's temporary folder, its CPU cores bound (`cpu_bind`). `open_channel`
connects to a server, retried while one we started comes up; an exited server, one that does
not answer within `start_timeout_s`, an address where nothing listens: one line
(`megatron_gspo.rollout.vllm.remote.RemoteEngine` drives them).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import torch

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.vllm.wire import ERROR_PREFIX, auth_key, connect, wait_for
from moe.platform.parallel import free_port


def cpu_bind(replica: int, replicas: int, tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `replica`: this process's cores split evenly over
    replicas * tp workers (shared round-robin where there are fewer cores than workers)."""
    cores = sorted(os.sched_getaffinity(0))
    slots = replicas * tp
    size = max(1, len(cores) // slots)
    lists = []
    for s in range(replica * tp, (replica + 1) * tp):
        chunk = cores[s * size:(s + 1) * size] if (s + 1) * size <= len(cores) \
            else [cores[s % len(cores)]]
        lists.append(",".join(map(str, chunk)))
    return "|".join(lists)


class EngineProcess:
    """An engine server this trainer started (rank 0): its process, port and log."""

    def __init__(self, replica: int, vcfg, log_dir: str):
        self.replica, self.host = replica, vcfg.host
        self.port = vcfg.port + replica if vcfg.port else free_port()
        self.log = os.path.join(log_dir, f"server_{replica}.log")
        env = dict(os.environ)
        if not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = vcfg.cpu_bind or cpu_bind(
                replica, vcfg.replicas, vcfg.tensor_parallel_size)
        with open(self.log, "a") as log:  # a restart adds to the log of the one before
            self.proc = subprocess.Popen(self.command(vcfg), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def command(self, vcfg) -> list[str]:
        return [sys.executable, "-m", "megatron_gspo.rollout.vllm.server", "--host", self.host,
                "--port", str(self.port), "--tensor-parallel-size",
                str(vcfg.tensor_parallel_size), "--parent-pid", str(os.getpid())]

    def exited(self) -> int | None:
        return self.proc.poll()

    def last_line(self) -> str:
        """The server's error line (`vllm_wire.ERROR_PREFIX`), else its log's last line."""
        try:
            with open(self.log, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "(no log)"
        errors = [ln[len(ERROR_PREFIX):] for ln in lines if ln.startswith(ERROR_PREFIX)]
        return (errors or lines or ["(empty log)"])[-1][:500]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Wait for the server to exit (after `close`), then kill its session, workers too."""
        if self.proc.poll() is None and not wait_for(lambda: self.proc.poll() is not None,
                                                     timeout_s):
            self.proc.kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its workers, if any outlived it
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def open_channel(host: str, port: int, timeout_s: float, proc: EngineProcess | None,
                 where: str):
    """A channel to the server at host:port, retried while a server we started comes up; one
    line (UserError) for an exited server, a timeout, or (at an address) nothing listening."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.exited() is not None:
            raise UserError(f"{where}: the engine server exited with status "
                            f"{proc.exited()}: {proc.last_line()} (log: {proc.log})")
        left = deadline - time.monotonic()
        if left <= 0:
            raise UserError(f"{where}: the engine server at {host}:{port} did not answer "
                            f"within rollout.vllm.start_timeout_s={timeout_s:g}")
        try:
            return connect(host, port, auth_key(), timeout=min(left, 10.0))
        except (ConnectionRefusedError, TimeoutError, socket.timeout) as e:
            if proc is None and isinstance(e, ConnectionRefusedError):
                raise UserError(f"{where}: nothing listens at {host}:{port} (connection "
                                "refused; is the engine server running there?)") from None
            time.sleep(0.2)
        except OSError as e:  # an unknown host, an unreachable network, a refused key
            raise UserError(f"{where}: cannot connect to {host}:{port}: {e}") from None
