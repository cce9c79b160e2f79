"""rollout.vllm.mode=server with real vLLM engine servers (TP = 2 over two CPU cores, float32):
R3 runs end to end on the committed GSM8K-style fixture with `qwen3-moe-tiny-hd32` (head_dim
32, which vLLM's CPU attention needs; its MoE FFN of 64 leaves 32 per engine worker, which
the CPU experts kernel takes unpadded), parity with a trainer under EP = 2 (one server, or two
replicas of TP = 1), and an engine process killed mid-rollout: restarted and re-pushed, or the
run stops in one line; a trainer killed leaves no engine process. Skipped without vLLM (Python >= 3.11, docs/vllm.md)."""

import importlib.util
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.vllm.wire import wait_for
from tests.jsonl import step_rows
from tests.processes import communicate_or_kill

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "gsm_tiny")
LAYERS = 4  # qwen3-moe-tiny-hd32's
OVERRIDES = [
    "model.preset=qwen3-moe-tiny-hd32", "model.max_seq_len=256", "task.name=dataset",
    f"data.train_files=[{FIXTURE}/train.jsonl]", f"data.test_files=[{FIXTURE}/test.jsonl]",
    f"data.tokenizer_path={FIXTURE}", "reward.name=math", "rollout.max_new_tokens=8",
    "rollout.prompts_per_batch=2", "rollout.group_size=4", "train.eval_every=0",
    "train.save_every=0", "wandb.mode=disabled", "rollout.backend=vllm",
    "train.routing_replay=r3", "rollout.vllm.mode=server",
    "rollout.vllm.tensor_parallel_size=2", "rollout.vllm.request_timeout_s=300"]


def engine_processes(root: psutil.Process) -> set[int]:
    """Pids of the engine servers and vLLM workers under `root`."""
    out = set()
    for p in root.children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "rollout.vllm.server" in line or "VLLM::" in line or "Worker" in p.name():
            out.add(p.pid)
    return out


def alive(pids) -> set[int]:
    return {p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}


def run_cli(tmp_path, *overrides, nproc: int = 1, kill_after_row: bool = False):
    """The CLI (under torchrun with nproc > 1) in its own session; returns (process, stderr,
    the trained steps' rows, the engine pids seen while it ran). `kill_after_row`: SIGKILL the
    trainer (it alone) once it logged a trained step."""
    run_dir = tmp_path / "run"
    cli = ["-m", "megatron_gspo.cli", "train", *OVERRIDES, f"run_dir={run_dir}", *overrides]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node", str(nproc)] if nproc > 1 else []), *cli]
    (tmp_path / "tmp").mkdir(exist_ok=True)  # its temporary files: what the run leaves there
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "TMPDIR": str(tmp_path / "tmp")}, start_new_session=True)
    seen, done = set(), threading.Event()

    def watch():
        root = psutil.Process(proc.pid)
        while not done.wait(0.5):
            try:
                seen.update(engine_processes(root))
            except psutil.Error:
                return
            if kill_after_row and (run_dir / "metrics.jsonl").exists() and step_rows(run_dir):
                proc.kill()
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _, err = communicate_or_kill(proc, 1500)
    finally:
        done.set()
        watcher.join()
    rows = step_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return proc, err, rows, seen


def check_parity(rows) -> None:
    """Engine and trainer on the same float32 weights: the same routing in every layer, the
    same log-probs to float32 rounding, a checked push before every rollout batch after an
    update (the first push comes with step 0's test eval)."""
    for r in rows:
        for layer in range(LAYERS):
            assert r[f"rollout/routing_mismatch/layer_{layer:02d}"] == 0.0
        assert r["rollout/routing_any_diff"] == 0.0
        assert r["rollout/logprob_mismatch/max"] <= 1e-5
        assert r["replay/route_diff"] == 0.0  # the loss replayed the engine's routes
    for r in rows[1:]:
        assert r["rollout/push_probe_diff"] <= 1e-5 and r["time/weight_sync"] > 0


def test_two_iterations_of_r3_from_a_tp2_engine_server_leave_no_engine_process(tmp_path):
    """The acceptance run: `megatron-gspo train` with the engine as a server of two workers;
    every layer's routing mismatch is logged, and no engine process outlives the trainer, nor
    any temporary folder (the server's config.json, the logs) the run made."""
    proc, err, rows, seen = run_cli(tmp_path, "train.steps=2", "train.num_minibatches=1")
    assert proc.returncode == 0, err[-3000:]
    assert [r["train/iteration"] for r in rows] == [0, 1]
    check_parity(rows)
    assert rows[-1]["rollout/engine_restarts"] == 0
    assert len(seen) >= 3  # the server and its two workers ran
    assert not alive(seen)
    assert [p for p in os.listdir(tmp_path / "tmp") if p.startswith("megatron_gspo")] == []


def test_a_tp2_engine_server_matches_an_ep2_trainer_over_three_updates(tmp_path):
    """torchrun, model.ep=2: rank 0 pushes the experts of both ranks (gathered per tensor) to
    the engine's two tensor-parallel workers; after each of three updates (weight decay moves
    every weight) the engine's routing and log-probs are the trainer's."""
    proc, err, rows, seen = run_cli(tmp_path, "train.steps=4", "train.num_minibatches=1",
                                    "model.ep=2", "optim.lr=1e-2", "optim.weight_decay=0.1",
                                    nproc=2)
    assert proc.returncode == 0, err[-3000:]
    assert [r["train/iteration"] for r in rows] == [0, 1, 2, 3]
    check_parity(rows)
    assert len({r["rollout/push_probe_diff"] for r in rows[1:]}) > 1  # new weights each time
    assert not alive(seen)


def test_two_engine_replicas_serve_the_two_data_parallel_ranks_of_an_ep2_trainer(tmp_path):
    """rollout.vllm.replicas=2 (TP 1 each): trainer rank r samples on replica r, rank 0 pushes
    to both in one weight-sync group and probes both; each rank's routes and log-probs are
    the trainer's."""
    proc, err, rows, seen = run_cli(tmp_path, "train.steps=2", "train.num_minibatches=1",
                                    "model.ep=2", "rollout.vllm.tensor_parallel_size=1",
                                    "rollout.vllm.replicas=2", nproc=2)
    assert proc.returncode == 0, err[-3000:]
    assert [r["train/iteration"] for r in rows] == [0, 1]
    check_parity(rows)
    assert len(seen) >= 2  # two servers (each its own worker)
    assert not alive(seen)


def test_a_killed_trainer_leaves_no_engine_process(tmp_path):
    """The trainer SIGKILLed (none of its clean-up runs) while its engine server and the
    server's two workers run: the kernel kills the server with the trainer and the workers
    with the server (parent-death signals)."""
    proc, err, rows, seen = run_cli(tmp_path, "train.steps=50", "train.num_minibatches=1",
                                    kill_after_row=True)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    assert rows and len(seen) >= 3
    assert wait_for(lambda: not alive(seen), 60), alive(seen)


def trainer_killing(tmp_path, victim: str, *overrides):
    """A Trainer whose engine `victim` ("server" or "worker") is stopped, sent the rollout
    request of iteration 1 and killed: it dies with the request in flight."""
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*OVERRIDES, f"run_dir={tmp_path / 'run'}", "train.steps=2",
                             "train.num_minibatches=1", *overrides])
    trainer = Trainer.from_config(cfg)
    engine, real = trainer.rt.sampler.engine, trainer.rt.sampler.engine._request
    state, rollout = {"iteration": None, "killed": None}, trainer.rollout

    def request(requests, version, routes, prompt_logprobs, replica):
        if state["iteration"] == 1 and replica is None and state["killed"] is None:
            chan = engine.chans[engine.replica]
            server = psutil.Process(engine.procs[0].proc.pid)
            target = server if victim == "server" else server.children()[-1]
            state["killed"] = target.pid

            def send_then_kill(msg, send=chan.send):
                chan.send = send  # once: a later message (the close) finds the target gone
                target.suspend()  # it cannot answer before it dies, however busy the CPU
                send(msg)
                target.kill()
            chan.send = send_then_kill
        return real(requests, version, routes, prompt_logprobs, replica)

    def tracked_rollout(it):
        state["iteration"] = it
        return rollout(it)

    engine._request, trainer.rollout = request, tracked_rollout
    return trainer, state


def test_a_worker_killed_mid_rollout_is_restarted_and_re_pushed(tmp_path):
    """A tensor-parallel worker dies while the engine samples iteration 1: the server reports
    the failed engine and exits, rank 0 starts a new one, pushes the weights again and
    re-sends the rollout; the run ends as it would have (per-request seeds)."""
    trainer, state = trainer_killing(tmp_path, "worker")
    server = trainer.rt.sampler.engine.procs[0].proc.pid
    trainer.train()  # closes the runtime (the engine servers) however it ends
    rows = step_rows(tmp_path / "run")
    assert state["killed"] is not None and [r["train/iteration"] for r in rows] == [0, 1]
    assert [r["rollout/engine_restarts"] for r in rows] == [0, 1]
    check_parity(rows)
    assert not psutil.pid_exists(server) and not psutil.pid_exists(state["killed"])


def test_with_no_restarts_left_a_killed_server_stops_the_run_in_one_line(tmp_path):
    """rollout.vllm.max_restarts=0: the server killed mid-rollout stops the run with one
    line; iteration 0's metrics and checkpoint stay, no engine process is left."""
    trainer, state = trainer_killing(tmp_path, "server", "rollout.vllm.max_restarts=0",
                                     "train.save_every=1")
    with pytest.raises(UserError, match=r"^rollout.vllm: engine server 0 was lost: .*; "
                                        r"rollout.vllm.max_restarts=0 restarts used: stopping "
                                        r"\(checkpoints and metrics kept; server logs: "):
        trainer.train()
    rows = step_rows(tmp_path / "run")
    assert [r["train/iteration"] for r in rows] == [0]
    assert os.path.isdir(tmp_path / "run" / "checkpoints")
    assert not psutil.pid_exists(state["killed"])
    assert trainer.rt.sampler.engine.procs == [None]  # closed: nothing of it runs
