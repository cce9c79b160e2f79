"""`rollout.max_staleness=1` with a vLLM engine server sampling beside the trainer (TP = 2 over
two CPU cores, float32, as vllm/test_server_runs.py): batches one version old, and the faults
of an engine that samples ahead: killed with a batch in flight (restarted, the batch sampled
again), stopped (one line after `rollout.vllm.request_timeout_s`); no engine process is left.
Skipped without vLLM (Python >= 3.11, docs/vllm.md)."""

import dataclasses
import importlib.util
import threading

import psutil
import pytest

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import UserError
from tests.jsonl import step_rows
from tests.megatron_gspo.rollout.vllm.test_server_runs import OVERRIDES, alive, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]
STALE = ["rollout.max_staleness=1", "train.num_minibatches=1"]


def test_k1_from_an_engine_server_trains_on_batches_one_version_old(tmp_path):
    """`megatron-gspo train` with the engine server sampling batch j + 1 while the trainer
    trains on batch j: staleness 0 then 1; batch 0 (sampled by the weights that train on it)
    has the trainer's routing and log-probs, the later ones do not (older weights); R3's loss
    replayed the engine's routes; no engine process outlives the trainer. (Weight decay moves
    every weight at each update, whatever the rewards.)"""
    proc, err, rows, seen = run_cli(tmp_path, "train.steps=3", *STALE, "optim.lr=1e-2",
                                    "optim.weight_decay=0.1")
    assert proc.returncode == 0, err[-3000:]
    assert [r["train/iteration"] for r in rows] == [0, 1, 2]
    assert [r["rollout/staleness/max"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout/routing_mismatch/mean"] == 0.0
    assert rows[0]["rollout/logprob_mismatch/max"] <= 1e-5
    assert all(r["rollout/logprob_mismatch/max"] > 1e-5 for r in rows[1:])
    assert all(r["replay/route_diff"] == 0.0 for r in rows)
    assert len(seen) >= 3 and not alive(seen)


def stale_trainer(tmp_path, fault: str, at_request: int, *overrides, timeout_s: float = 0):
    """A k = 1 Trainer whose engine server gets `fault` ("kill": SIGKILL, "stop": SIGSTOP)
    right after the producer thread's request number `at_request` (1: batch 0's) was sent;
    `timeout_s`: the engine's `request_timeout_s` from then on (before it, the config's, long
    enough for a first sample on a loaded machine)."""
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*OVERRIDES, f"run_dir={tmp_path / 'run'}", *STALE, *overrides])
    trainer = Trainer.from_config(cfg)
    engine, real = trainer.rt.sampler.engine, trainer.rt.sampler.engine._request
    state = {"requests": 0, "victim": None}

    def request(requests, version, routes, prompt_logprobs, replica):
        if threading.current_thread().name == "rollouts":  # not an eval's or a probe's
            state["requests"] += 1
        if state["requests"] == at_request and state["victim"] is None:
            chan = engine.chans[engine.replica]
            server = psutil.Process(engine.procs[0].proc.pid)
            state["victim"] = server.pid

            def send_then_fault(msg, send=chan.send):
                chan.send = send
                server.suspend()  # it cannot answer before the fault, however busy the CPU
                if timeout_s:
                    engine.vcfg = dataclasses.replace(engine.vcfg, request_timeout_s=timeout_s)
                send(msg)
                if fault == "kill":
                    server.kill()
            chan.send = send_then_fault
        return real(requests, version, routes, prompt_logprobs, replica)

    engine._request = request
    return trainer, state


def test_k1_a_server_killed_while_it_samples_ahead_is_restarted_and_the_batch_sampled_again(
        tmp_path, capsys):
    """The server dies while it samples batch 2 (during batch 1's training): the trainer's
    next take restarts it, pushes its weights of now and samples batch 2 again by them
    (staleness 0 for that batch, as logged), then goes on one version behind; one line says
    so; no batch trained twice or skipped, no engine process left."""
    trainer, state = stale_trainer(tmp_path, "kill", 3, "train.steps=4")
    first = trainer.rt.sampler.engine.procs[0].proc.pid
    trainer.train()
    rows = step_rows(tmp_path / "run")
    assert [r["train/iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/staleness/max"] for r in rows] == [0, 1, 0, 1]
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 0, 1, 1]
    assert "rollout.max_staleness=1: sampling rollout batch 2 failed (engine server 0 was " \
           "lost: " in capsys.readouterr().out
    assert state["victim"] == first and not psutil.pid_exists(first)
    assert trainer.rt.sampler.engine.procs == [None]


def test_k1_a_stopped_server_ends_the_run_in_one_line_after_its_timeout(tmp_path):
    """A server SIGSTOPped while it samples batch 1 ahead (a hung engine): after
    `request_timeout_s` it counts as lost; with no restarts left, one line, batch 0's metrics
    and checkpoint kept, the stopped server killed."""
    trainer, state = stale_trainer(tmp_path, "stop", 2, "train.steps=3", "train.save_every=1",
                                   "rollout.vllm.max_restarts=0", timeout_s=20)
    with pytest.raises(UserError, match=r"^rollout.vllm: engine server 0 was lost: no message "
                                        r"within 20 s; rollout.vllm.max_restarts=0 restarts "
                                        r"used: stopping \(checkpoints and metrics kept"):
        trainer.train()
    assert [r["train/iteration"] for r in step_rows(tmp_path / "run")] == [0]
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert not psutil.pid_exists(state["victim"])
    assert trainer.rt.sampler.engine.procs == [None]
