"""No process a trainer started outlives it, and the run-dir lock names a live holder: a trainer
SIGKILLed in the middle of a checkpoint save left megatron's forked writer (holding run_dir/.lock)
and its Manager behind, and the resume was refused naming the dead trainer."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_gspo.errors import RunDirError
from megatron_gspo.run import lock
from tests.megatron_gspo.run.test_faults import TINY, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_STALLED_IN_THE_SECOND_SAVE = """
import os, sys, time
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron_gspo.cli import main

real = FileSystemWriterAsync.write_preloaded_data

def stalled(transform_list, *args, **kwargs):
    if "step_000002" in kwargs["write_bucket"][0]:  # in the process forked for the write
        open(os.path.join(sys.argv[1], f"writer.{os.getpid()}"), "w").close()
        time.sleep(600)
    return real(transform_list, *args, **kwargs)

FileSystemWriterAsync.write_preloaded_data = staticmethod(stalled)
sys.exit(main(["train", *sys.argv[2:]]))
"""


def _session(sid: int) -> dict[int, str]:
    """{pid: command line} of the live processes (zombies left out) of session `sid`."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out[int(entry)] = command[:160]
    return out


def _wait_for(condition, limit_s: float):
    """Poll `condition` until it is truthy or `limit_s` passed; its last value."""
    deadline = time.monotonic() + limit_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes from /proc")
def test_a_trainer_killed_during_a_save_leaves_no_process_and_the_run_resumes(tmp_path):
    """SIGKILL while megatron's forked writer writes step 2: the writer (a copy of the trainer,
    holding run_dir/.lock, deaf to SIGTERM), megatron's results Manager and the resource
    tracker stayed alive, and the resume was refused as 'being written by another process'.
    Now they die with the trainer and the run resumes from step 1."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_IN_THE_SECOND_SAVE, str(tmp_path),
                             *TINY, "train.steps=3", f"run_dir={run}"], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        writer = _wait_for(lambda: [n for n in os.listdir(tmp_path) if n.startswith("writer.")]
                           or proc.poll() is not None, 600)
        assert writer and proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = _wait_for(lambda: not _session(proc.pid), 60) or _session(proc.pid)
    finally:
        for pid in _session(proc.pid):  # whatever the trainer left behind: ours to end
            os.kill(pid, signal.SIGKILL)
        proc.stderr.close()
    assert left is True, f"alive after the trainer was killed: {left}"
    resumed = trainer(run, "train.steps=3")
    try:
        assert resumed.state.iteration == 1
    finally:
        resumed.rt.close()


_HOLDS_THE_LOCK_IN_A_CHILD = """
import subprocess, sys
from megatron_gspo.run import lock
lock.lock_run_dir(sys.argv[1], "train")
fd = lock._HELD[next(iter(lock._HELD))][0]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=[fd],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the processes from /proc")
def test_the_lock_names_its_live_holder_when_the_process_it_names_is_gone(tmp_path):
    """A process that inherited the lock from a trainer which has exited: the refusal named
    the trainer's pid, a process that no longer existed. Now it names the live holder."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDS_THE_LOCK_IN_A_CHILD, str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    child = int(out.split()[0])
    try:
        with pytest.raises(RunDirError) as refused:
            lock.lock_run_dir(str(tmp_path), "train")
    finally:
        os.kill(child, signal.SIGKILL)
    message = str(refused.value)
    assert f"(pid {child}: " in message and "time.sleep(600)" in message, message
    assert f"the lock file names pid {proc.pid} job train, which has exited" in message
