"""One line and exit 2 where a traceback was: a disk filling under metrics.jsonl, out
of memory in the rollout; a signal during start-up exits quietly with 128 + the signal."""

import os
import resource
import signal

import pytest

from megatron_gspo.errors import UserError
from megatron_gspo.run import metrics
from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.run.test_faults import TINY, one_line_error


def test_a_disk_filling_under_metrics_jsonl_leaves_no_cut_off_row(tmp_path):
    """A row only part of which fits (a file size limit here: EFBIG; ENOSPC on a full disk)
    was left cut off, and the OSError came out as a chained traceback."""
    logger = metrics.MetricsLogger(str(tmp_path))
    logger.log(1, {"reward/mean": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 40, limit[1]))
    try:
        with pytest.raises(Exception) as raised:
            logger.log(2, {f"moe/flip_rate/layer_{i:02d}": 0.1 for i in range(20)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, sigxfsz)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert raised.type is UserError, raised  # the CLI's one line, exit 2
    assert "metrics.jsonl: File too large; the row of step 2 is not logged, the rows before " \
           "it and the checkpoints are unchanged" in str(raised.value)
    logger.log(3, {"reward/mean": 0.7})  # room again: the log goes on
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 3]
    logger.close()


def test_a_full_disk_under_metrics_jsonl_is_one_line_from_the_cli(tmp_path, capsys,
                                                                 monkeypatch):
    """metrics.jsonl on a full disk (its descriptor on /dev/full: ENOSPC at every write)."""
    opened = metrics.MetricsLogger.__init__

    def on_a_full_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        if self._file is not None:
            os.dup2(os.open("/dev/full", os.O_WRONLY), self._file.fileno())

    monkeypatch.setattr(metrics.MetricsLogger, "__init__", on_a_full_disk)
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path / 'run'}", "train.steps=1")
    # the first row is step 0's: the test split's first eval
    assert "metrics.jsonl: No space left on device; the row of step 0 is not logged" in err


def _allocate_too_much(*args, **kwargs):
    """What a rollout of 8192 prompts x 64 asks of the allocator, in one request."""
    import torch

    torch.empty(1 << 60, dtype=torch.uint8)


@pytest.mark.parametrize("job, where, target, names", [
    ("train", "the rollout", "megatron_gspo.jobs.rl_rollouts.sample_rollouts",
     "lower rollout.prompts_per_batch=4, rollout.group_size=4, rollout.max_new_tokens=3"),
    ("sft", "an SFT step", "megatron_gspo.jobs.sft.sft_step",
     "lower sft.batch_size=8, or raise model.recompute_granularity=off")])
def test_out_of_memory_is_one_line_naming_the_settings(tmp_path, capsys, monkeypatch, job, where,
                                                       target, names):
    """The allocator's failure was a traceback with no hint of what to change."""
    monkeypatch.setattr(target, _allocate_too_much)
    err = one_line_error(capsys, job, *TINY, f"run_dir={tmp_path / 'run'}", "train.steps=1")
    assert f"out of memory in {where} (DefaultCPUAllocator: can't allocate memory" in err
    assert names in err


def test_only_allocation_failures_are_called_out_of_memory():
    import torch

    from megatron_gspo.config.schema import load_config
    from megatron_gspo.run.oom import TRAIN_STEP, out_of_memory

    cfg = load_config(None, ["model.recompute_granularity=full"])
    with pytest.raises(UserError, match=r"CUDA out of memory. Tried to allocate 2.00 GiB\); "
                                          r"lower .*, or raise train.num_minibatches=4$"):
        with out_of_memory("an optimizer step", cfg, TRAIN_STEP):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        with out_of_memory("an optimizer step", cfg, TRAIN_STEP):
            raise RuntimeError("shape mismatch")


_SIGNAL_DURING = """
import os, sys
from megatron_gspo import cli
from megatron_gspo.run import setup as runtime
from megatron_gspo.jobs import rl as trainer
where, signum = sys.argv[1], int(sys.argv[2])
module, name = {"the model build": (runtime, "build_policy"),
                "the first eval": (trainer, "evaluate_runtime")}[where]
real = getattr(module, name)
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signum)
    return real(*args, **kwargs)
setattr(module, name, signalled)
sys.exit(cli.main(["train", *sys.argv[3:]]))
"""


@pytest.mark.parametrize("where, signum", [("the model build", signal.SIGINT),
                                           ("the first eval", signal.SIGTERM)])
def test_a_signal_during_start_up_exits_quietly_with_128_plus_it(tmp_path, where, signum):
    """Ctrl-C while the model was built (or the first eval ran) was a KeyboardInterrupt
    traceback; SIGTERM killed the process. Now one line and 128 + the signal, as a signal
    during training gives (after its save)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_DURING, where, str(int(signum)), *TINY,
                           f"run_dir={tmp_path / 'run'}", "train.eval_every=1"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 128 + signum, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # the last line (newer torch / megatron-core print import-time warnings before it)
    assert proc.stderr.strip().splitlines()[-1] == f"megatron-gspo: {signal.Signals(signum).name} "\
        "received during start-up: stopped before training; nothing was saved and nothing already "\
        "written changed"
    assert not (tmp_path / "run" / "checkpoints").exists()
