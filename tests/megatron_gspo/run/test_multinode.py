"""Across nodes: two torchrun agents on this machine, as two nodes would run them
(docs/parallelism.md#across-nodes): a c10d rendezvous on localhost, one worker each, gloo, EP 2
over the two "nodes"; SIGTERM to both agents (what SLURM sends every task at preemption) after
a checkpoint, then the same command resumes and finishes, each step logged once."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from megatron_gspo.run import checkpoint as ckpt
from moe.platform.parallel import free_port
from tests.megatron_gspo.run.test_faults import TINY

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
TIMEOUT_S = 300


def agents(run_dir, steps: int) -> list[subprocess.Popen]:
    """Two torchrun agents (--nnodes 2 --nproc-per-node 1) meeting at a fresh c10d endpoint."""
    port, job = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id",
           job, "--max-restarts", "0", "--monitor-interval", "0.5",
           "-m", "megatron_gspo.cli", "train", *TINY, "model.ep=2", "model.dist_timeout_min=1",
           "train.save_every=1", f"train.steps={steps}", f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, start_new_session=True) for _ in range(2)]


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit status, output) of each agent; a hang kills both (their sessions) and fails."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=TIMEOUT_S)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


@pytest.mark.slow
def test_two_agents_rendezvous_stop_on_sigterm_after_a_save_and_resume(tmp_path):
    run = tmp_path / "run"
    procs = agents(run, steps=40)
    latest = run / "checkpoints" / ckpt.LATEST_FILE
    deadline = time.monotonic() + TIMEOUT_S
    while not latest.exists() and time.monotonic() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    assert latest.exists(), finish(procs)
    for p in procs:  # every node's agent, as a scheduler signals every task
        p.send_signal(signal.SIGTERM)
    stopped = finish(procs)
    assert all(code != 0 for code, _ in stopped), stopped
    lines = [ln for _, text in stopped for ln in text.splitlines()
             if ln.startswith("megatron-gspo: stopped at rollout batch ")]
    assert len(lines) == 1, stopped  # rank 0 says it, once
    step = int(lines[0].split("rollout batch ")[1].split(" of")[0])
    assert 1 <= step < 40 and ckpt.latest_step(str(run / "checkpoints")) == step
    assert f"checkpoint saved in {run}; run the same command to resume" in lines[0]

    resumed = finish(agents(run, steps=step + 2))  # train.steps may change on resume
    assert [code for code, _ in resumed] == [0, 0], resumed
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]  # not step 0's row of the test split's first eval
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and len(steps) == 2 * (step + 2)  # 2 minibatches each
    assert [r["train/iteration"] for r in rows][-1] == step + 1
    assert ckpt.latest_step(str(run / "checkpoints")) == step + 2
