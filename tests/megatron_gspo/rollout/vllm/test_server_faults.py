"""Engine servers abused as an operator would, without vLLM (a real `vllm_server.Server` loop over
a stub engine): a second trainer on a server another run holds, a run asking for another model,
a weight-sync port in use, temporary folders left behind (docs/reliability.md)."""

import re
import socket
import sys
import tempfile
import threading
from types import SimpleNamespace

import pytest

from megatron_gspo.errors import UserError
from megatron_gspo.rollout.vllm import server as vllm_server, wire as vllm_wire
from moe.platform.parallel import free_port
from tests.megatron_gspo.rollout.vllm.test_server import _fake_server, engine

RUN_A = "run_dir=/runs/a (trainer pid 11 on host-a)"
SPEC = {"config": {"hidden_size": 64, "num_hidden_layers": 2}, "dtype": "float32", "seed": 0,
        "max_model_len": 128, "capture_routing": True, "kv_cache_gb": 0.1}


class StubLLM:
    """What the server's loop asks of an engine that holds no requests."""

    llm_engine = SimpleNamespace(has_unfinished_requests=lambda: False)


@pytest.fixture
def stub_server(monkeypatch):
    """A `vllm_server.Server` serving in a thread, `build` making a StubLLM; its port."""
    monkeypatch.setattr(vllm_server, "build_llm", lambda spec, tp: (StubLLM(), 2))
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="stub"))
    listener = vllm_server.bind("127.0.0.1", 0)
    server = vllm_server.Server(listener, tp=1)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    closer = channel(listener.getsockname()[1])  # every test channel closed: the server is free
    closer.send({"op": "close", "run": "the test"})
    thread.join(30)
    closer.close()
    listener.close()


def channel(port: int) -> vllm_wire.Channel:
    return vllm_wire.connect("127.0.0.1", port, vllm_wire.auth_key(), 30)


def ask(chan, op: str, run: str, **fields) -> dict:
    chan.send({"op": op, "run": run, **fields})
    return chan.recv(30)


def test_a_second_trainer_is_refused_naming_the_run_the_server_serves(stub_server):
    """Two trainers on one server (rollout.vllm.addresses): the second's build reset the
    weights' version, the first died with "answered with weights of version None, not 0", and
    with versions counted from 0 by each, one run could be served the other's weights. The
    second is refused, in one line naming the run the server serves, and the first goes on;
    once the first run's connections close, the server serves another."""
    first = channel(stub_server)
    assert ask(first, "build", RUN_A, spec=SPEC, chunk_mb=1)["ok"]
    with pytest.raises(UserError, match=rf"^rollout.vllm engine server 0: this engine server "
                                        rf"serves another run, {re.escape(RUN_A)}: it serves "
                                        rf"one trainer at a time"):
        engine(f'rollout.vllm.addresses=["127.0.0.1:{stub_server}"]',
               "rollout.vllm.start_timeout_s=5", "rollout.vllm.request_timeout_s=5")
    second = channel(stub_server)
    refused = ask(second, "build", "run_dir=/runs/b", spec=SPEC, chunk_mb=1)
    assert refused["busy"] and RUN_A in refused["error"]
    assert ask(first, "hello", RUN_A)["built"]  # the first run's server, untouched
    first.close()
    assert ask(second, "build", "run_dir=/runs/b", spec=SPEC, chunk_mb=1)["ok"]
    second.close()


def test_a_server_holding_another_model_names_what_differs(stub_server):
    """A run with another seed was refused as "holds another model (config, dtype, lengths or
    KV cache differ)": the message names the fields."""
    first = channel(stub_server)
    assert ask(first, "build", RUN_A, spec=SPEC, chunk_mb=1)["ok"]
    first.close()
    other = dict(SPEC, seed=1, config=dict(SPEC["config"], hidden_size=128))
    second = channel(stub_server)
    reply = ask(second, "build", "run_dir=/runs/b", spec=other, chunk_mb=1)
    second.close()
    assert reply["error"] == ("RuntimeError: this engine server holds another model (config.json "
                              "hidden_size: the server's 64, this run's 128; seed: the server's "
                              "0, this run's 1): start a new one")


def test_a_sync_port_in_use_is_one_line_before_any_engine_is_asked_anything():
    """rollout.vllm.sync_port in use: the line came after the engines were built and had
    waited start_timeout_s plus about 50 s to join (16 minutes at the defaults); the port is
    taken first now, before a server is started, built or waited for."""
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    seen = []
    listener, thread = _fake_server(1, seen)
    try:
        with pytest.raises(UserError, match=rf"^rollout.vllm.sync_port={port}: the weight-sync "
                                            rf"rendezvous cannot listen on 127.0.0.1:{port} "
                                            rf"\(address already in use\): set "):
            engine(f'rollout.vllm.addresses=["127.0.0.1:{listener.getsockname()[1]}"]',
                   f"rollout.vllm.sync_port={port}", "rollout.vllm.start_timeout_s=5",
                   "rollout.vllm.request_timeout_s=5")
        assert seen == []  # no server built anything, nor waited to join
    finally:
        busy.close()
        listener.close()


def test_a_failed_connect_leaves_no_log_folder(tmp_path, monkeypatch):
    """Each failed connect to an address left an empty megatron_gspo_vllm_logs_* folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(UserError, match="nothing listens at"):
        engine(f'rollout.vllm.addresses=["127.0.0.1:{free_port()}"]')
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fails", [False, True], ids=["built", "failed"])
def test_a_build_leaves_no_config_folder(tmp_path, monkeypatch, fails):
    """Every engine build left a megatron_gspo_vllm_server_*/config.json in the temp dir."""
    seen = []

    def llm(**kwargs):
        seen.append(sorted(p.name for p in (tmp_path / kwargs["model"]).iterdir()))
        if fails:
            raise RuntimeError("out of memory")
        return SimpleNamespace(collective_rpc=lambda *a, **k: [4])

    cpu = SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=llm))
    monkeypatch.setitem(sys.modules, "vllm.platforms", SimpleNamespace(current_platform=cpu))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if fails:
        with pytest.raises(RuntimeError, match="out of memory"):
            vllm_server.build_llm(SPEC, 1)
    else:
        assert vllm_server.build_llm(SPEC, 1)[1] == 4
    assert seen == [["config.json"]] and list(tmp_path.iterdir()) == []


def test_spec_difference_names_each_field_that_differs():
    assert vllm_server.spec_difference(SPEC, SPEC) == ""
    assert vllm_server.spec_difference(SPEC, dict(SPEC, dtype="bfloat16", kv_cache_gb=1)) == (
        "dtype: the server's 'float32', this run's 'bfloat16'; kv_cache_gb: the server's 0.1, "
        "this run's 1")
