"""rollout.vllm.mode=server without a model: the wire (keyed channels, weight buckets over a
gloo group), and the faults of starting and reaching engine servers, each one line
(`megatron_gspo.rollout.vllm.remote`). The runs with vLLM engines are in
vllm/test_server_runs.py."""

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.vllm import launch as vllm_launch
from megatron_gspo.rollout.vllm import remote as vllm_remote
from megatron_gspo.rollout.vllm import wire as vllm_wire
from moe.platform.parallel import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))


def vcfg(*overrides):
    return load_config(None, ["rollout.vllm.mode=server", *overrides]).rollout.vllm


def engine(*overrides) -> vllm_remote.RemoteEngine:
    return vllm_remote.RemoteEngine({}, vcfg(*overrides), rank=0, tp=1, tp_rank=0)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie no one reaped yet is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


# ---------------------------------------------------------------- the wire
def test_a_channel_carries_messages_only_for_a_peer_with_the_key():
    listener = socket.create_server(("127.0.0.1", 0))
    port, results = listener.getsockname()[1], []

    def serve():
        for _ in range(2):
            chan = vllm_wire.Channel(listener.accept()[0])
            if vllm_wire.challenge(chan, b"right", 10):
                chan.send({"echo": chan.recv(10)})
            else:
                results.append("refused")
            chan.close()

    thread = threading.Thread(target=serve)
    thread.start()
    chan = vllm_wire.connect("127.0.0.1", port, b"right", 10)
    chan.send({"op": "x", "data": list(range(5))})
    assert chan.recv(10) == {"echo": {"op": "x", "data": [0, 1, 2, 3, 4]}}
    with pytest.raises(PermissionError, match="refused the key"):
        vllm_wire.connect("127.0.0.1", port, b"wrong", 10)
    thread.join()
    assert results == ["refused"]
    listener.close()


def test_closing_a_channel_wakes_the_thread_receiving_on_it():
    """The producer thread of `rollout.max_staleness` waits on a server's answer while the
    trainer's thread closes the engine: it hears ChannelClosed at once, not after its
    receive timeout (a close alone left it waiting the whole timeout)."""
    listener = socket.create_server(("127.0.0.1", 0))
    chan = vllm_wire.Channel(socket.create_connection(listener.getsockname()))
    peer, heard = listener.accept()[0], []

    def receive():
        try:
            chan.recv(600)
        except Exception as e:
            heard.append(type(e))
    thread = threading.Thread(target=receive)
    thread.start()
    chan.close()
    thread.join(60)
    assert heard == [vllm_wire.ChannelClosed]
    peer.close()
    listener.close()


def _group_pair(timeout_s=30.0):
    port, groups = free_port(), {}

    def join(rank):
        groups[rank] = vllm_wire.open_group("127.0.0.1", port, rank, 2, timeout_s,
                                            torch.device("cpu"))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return groups[0], groups[1]


def test_buckets_carry_every_tensor_with_its_dtype_shape_and_version():
    sender, receiver = _group_pair()
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=g)),
               ("b", torch.randn(7, generator=g).bfloat16()),  # 14 bytes: the next is aligned
               ("c", torch.arange(9)), ("d", torch.randn(100, 50, generator=g)),
               ("e", torch.randn(2, 3, generator=g).t())]  # not contiguous
    got = []
    thread = threading.Thread(target=lambda: got.extend(
        (v, n, t.clone()) for v, ts in vllm_wire.receive_buckets(receiver) for n, t in ts))
    thread.start()
    count, sent = vllm_wire.send_buckets(sender, iter(tensors), 7, bucket_bytes=1000)
    thread.join()
    assert count == 5 and sent >= sum(t.numel() * t.element_size() for _, t in tensors)
    assert [(v, n) for v, n, _ in got] == [(7, n) for n, _ in tensors]
    for (_, t), (_, _, r) in zip(tensors, got):
        assert r.dtype == t.dtype and torch.equal(r, t)


def test_a_worker_whose_load_fails_still_takes_the_whole_push():
    """Without draining, the trainer's broadcast of the next bucket waits for a receiver
    that stopped (here the group's 20 s timeout, 30 min by default), and only then fails."""
    pytest.importorskip("vllm")
    from megatron_gspo.rollout.vllm.worker import GroupUpdateInfo, GroupWeightTransfer

    sender, receiver = _group_pair(timeout_s=20.0)
    loaded = []

    def load(tensors):
        if not loaded:
            loaded.append("first")
            raise RuntimeError("size mismatch in layer 0")
        loaded.append(len(tensors))

    worker = object.__new__(GroupWeightTransfer)
    worker.group, worker.moe_layers, worker.embedding = receiver, set(), False
    worker.model = type("Model", (), {"load_weights": staticmethod(load)})()
    errors = []

    def receive():
        try:
            worker.receive_weights(GroupUpdateInfo(version=3))
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=receive)
    thread.start()
    tensors = [(f"model.layers.{i}.w", torch.ones(100)) for i in range(4)]
    assert vllm_wire.send_buckets(sender, iter(tensors), 3, bucket_bytes=400)[0] == 4
    thread.join()
    assert errors == ["size mismatch in layer 0"] and loaded == ["first"]


# ---------------------------------------------------------------- starting and reaching
def test_an_engine_that_never_answers_is_one_line_within_the_timeout_and_is_killed(
        monkeypatch):
    monkeypatch.setattr(vllm_launch.EngineProcess, "command", lambda self, v: [
        sys.executable, "-c", "import time; time.sleep(600)"])
    started = []
    real = vllm_launch.EngineProcess.__init__
    monkeypatch.setattr(vllm_launch.EngineProcess, "__init__", lambda self, *a: (
        real(self, *a), started.append(self))[0])
    with pytest.raises(UserError, match=r"^rollout.vllm engine server 0: the engine server at "
                                        r"127.0.0.1:\d+ did not answer within "
                                        r"rollout.vllm.start_timeout_s=2$"):
        engine("rollout.vllm.start_timeout_s=2")
    assert len(started) == 1 and gone(started[0].proc.pid)


def test_a_port_in_use_is_one_line_from_the_server():
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    try:
        with pytest.raises(UserError, match=rf"^rollout.vllm engine server 0: the engine server "
                                            rf"exited with status 2: cannot listen on "
                                            rf"127.0.0.1:{port}: .* \(port in use\? .*\(log: "):
            engine(f"rollout.vllm.port={port}")
    finally:
        busy.close()


def test_a_wrong_address_is_one_line():
    port = free_port()
    with pytest.raises(UserError, match=rf"^rollout.vllm engine server 0: nothing listens at "
                                        rf"127.0.0.1:{port} \(connection refused"):
        engine(f'rollout.vllm.addresses=["127.0.0.1:{port}"]')
    with pytest.raises(UserError, match=r"^rollout.vllm engine server 0: cannot connect to "
                                        r"no-such-host.invalid:80"):
        engine('rollout.vllm.addresses=["no-such-host.invalid:80"]',
               "rollout.vllm.sync_host=127.0.0.1")


def _fake_server(tp: int, seen: list) -> tuple[socket.socket, threading.Thread]:
    """A running engine server of `tp` workers at an address, without vLLM: it answers hello,
    build and init_weights, and its `tp` workers join the weight-sync group it is told of."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        chan = vllm_wire.Channel(listener.accept()[0])
        assert vllm_wire.challenge(chan, vllm_wire.auth_key(), 30)
        groups = []
        try:
            while (msg := chan.recv(60))["op"] != "close":
                seen.append(msg)
                if msg["op"] == "init_weights":
                    info = msg["init_info"]
                    joins = [threading.Thread(target=lambda rank: groups.append(
                        vllm_wire.open_group(info["host"], info["port"], rank,
                                             info["world_size"], info["timeout_s"],
                                             torch.device("cpu"))),
                        args=(info["rank_offset"] + w,)) for w in range(tp)]
                    [t.start() for t in joins]
                    [t.join() for t in joins]
                chan.send({"ok": True, "tp": tp, "layers": 1})
        except vllm_wire.ChannelClosed:  # the trainer closed its channel (it never stops us)
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_running_server_at_an_address_brings_its_own_tensor_parallel_size():
    """rollout.vllm.tensor_parallel_size is for the servers the trainer starts: a server at an
    address runs its own --tensor-parallel-size, and the weight-sync group counts its workers
    (counted from the config, a TP=2 server's second worker had no rank in the group)."""
    seen = []
    listener, thread = _fake_server(2, seen)
    port = listener.getsockname()[1]
    eng = engine(f'rollout.vllm.addresses=["127.0.0.1:{port}"]',
                 "rollout.vllm.request_timeout_s=20")
    try:
        init = [m["init_info"] for m in seen if m["op"] == "init_weights"]
        assert [(i["rank_offset"], i["world_size"]) for i in init] == [(1, 3)]
        assert eng.group is not None
    finally:
        eng.close()
        thread.join(30)
        listener.close()


def test_a_killed_trainer_leaves_no_engine_server(tmp_path):
    """The server dies with the process that started it (its parent-death signal), however
    that process ends: SIGKILL runs none of its own clean-up."""
    script = ("import sys, time\n"
              "from megatron_gspo.config.schema import load_config\n"
              "from megatron_gspo.rollout.vllm.launch import EngineProcess, open_channel\n"
              "v = load_config(None, ['rollout.vllm.mode=server']).rollout.vllm\n"
              "p = EngineProcess(0, v, sys.argv[1])\n"
              "open_channel(p.host, p.port, 120, p, 'test')\n"  # the server is up
              "print(p.proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        server = int(trainer.stdout.readline())
        assert not gone(server)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert vllm_wire.wait_for(lambda: gone(server), 60)


def test_a_worker_in_the_servers_own_process_is_not_killed_by_its_tie():
    """tensor_parallel_size 1 runs the worker in the server's process (vLLM's "uni"
    executor): tying it to the server (its own pid) must leave it alive, where a parent-death
    tie to the server's pid would find another parent and kill it at once."""
    script = ("import os\n"
              "from megatron_gspo.rollout.vllm.worker import tie_to_server\n"
              "tie_to_server(os.getpid())\n"
              "print('alive', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "alive\n", out.stderr[-2000:]


def test_cpu_bind_splits_the_cores_over_the_workers_of_every_replica(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert vllm_launch.cpu_bind(0, 1, 2) == "0,1,2,3|4,5,6,7"
    assert vllm_launch.cpu_bind(1, 2, 2) == "4,5|6,7"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert vllm_launch.cpu_bind(0, 1, 2) == "0|1"
    assert vllm_launch.cpu_bind(0, 1, 4) == "0|1|0|1"  # fewer cores than workers: shared


class _Engine:
    """What `ServerBeside` and `restart_lost` read of a `RemoteEngine`: one replica, lost."""

    def __init__(self):
        self.restarts, self.started = 0, []

    def lost_replicas(self, lost, failed=False):
        return ([0] if lost is not None else []), failed

    def restart(self, replicas, why):
        self.restarts += 1
        self.started.append(why)


def test_a_server_lost_while_sampling_ahead_is_restarted_once_even_after_an_eval():
    """`rollout.max_staleness`: a server lost while the producer sampled is restarted by the
    trainer's next take (`ServerBeside.recover`) and the push forgotten; if an eval in between
    restarted it already (its own request found it lost), it is not restarted twice."""
    from types import SimpleNamespace

    from megatron_gspo.rollout.vllm.sampler import EngineLost, ServerBeside

    sampler = SimpleNamespace(engine=_Engine(), pushed=3, metrics={}, sync=lambda: None)
    beside = ServerBeside(sampler)
    beside.publish()
    beside.recover(EngineLost(0, "gone"))
    assert sampler.engine.started == ["engine server 0 was lost: gone"] and sampler.pushed is None
    beside.publish()
    sampler.engine.restart([0], "an eval's request found it lost")
    beside.recover(EngineLost(0, "gone"))
    assert sampler.engine.restarts == 2  # the eval's restart only
    with pytest.raises(RuntimeError, match="^not a lost engine$"):
        beside.recover(RuntimeError("not a lost engine"))
