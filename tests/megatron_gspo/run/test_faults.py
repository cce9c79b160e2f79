"""Fault injection: every way a run can be hurt from outside gets a clear refusal or a
clean recovery, and nothing already written is lost.

Run dirs (docs/pitfalls.md#run-dir-ownership), verified checkpoints, one-line CLI errors, wandb
offline fallback. Preemption is in run/test_preempt.py and run/test_lifetime.py, resume faults
in run/test_resume.py. Collective-safe sampling (docs/pitfalls.md#collectives) is guarded in
tests/moe (2 processes).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.cli import main
from megatron_gspo.config.schema import load_config
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.errors import RunDirError
from tests.megatron_gspo.run.test_rundir import claim, lock_holder

TINY = ["model.preset=tiny", "task.name=addition", "task.kwargs.num_digits=1",
        "task.n_train=60", "task.n_eval=8", "rollout.prompts_per_batch=4",
        "rollout.group_size=4", "rollout.max_new_tokens=3", "train.num_minibatches=2",
        "train.eval_every=0", "train.save_every=1", "wandb.mode=disabled", "optim.lr=3e-3",
        "loss.name=grpo", "sft.steps=2", "sft.batch_size=8", "sft.eval_every=0"]


def cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def one_line_error(capsys, *argv) -> str:
    code, err = cli(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def digit_first(example, completion: str) -> float:
    return float(completion[:1].isdigit())


def trainer(run_dir, *overrides):
    from megatron_gspo.jobs.rl import Trainer

    t = Trainer.from_config(load_config(None, [*TINY, f"run_dir={run_dir}", *overrides]))
    object.__setattr__(t.rt.task, "reward", digit_first)  # groups with reward variance
    return t


# ----------------------------------------------------------------------------- run dirs


def test_resume_with_another_config_is_refused_naming_the_keys(tmp_path):
    claim(tmp_path, "train", "optim.lr=1e-4").release()
    with pytest.raises(RunDirError, match=r"optim.lr: 0.0001 -> 0.001.*resume=force"):
        claim(tmp_path, "train", "optim.lr=1e-3")
    # keys that do not change what is trained may change
    claim(tmp_path, "train", "optim.lr=1e-4", "train.steps=99", "wandb.mode=offline").release()
    claim(tmp_path, "train", "optim.lr=1e-3", resume="force").release()


def test_a_run_recorded_before_a_config_field_existed_resumes(tmp_path):
    """A field added since the run started (absent from its run.json) at its default is the
    config it ran with; at another value, or a key set to null that was not, is a change."""
    import json

    claim(tmp_path, "train").release()
    record_path = tmp_path / "run.json"
    record = json.loads(record_path.read_text())
    del record["config"]["model.num_layers"]  # as written before model.num_layers existed
    record["fingerprint"] = "recorded-before"
    record_path.write_text(json.dumps(record))
    claim(tmp_path, "train").release()
    with pytest.raises(RunDirError, match=r"model.num_layers: <unset> -> 3"):
        claim(tmp_path, "train", "model.num_layers=3")
    record["config"]["model.max_seq_len"] = 96  # recorded 96, now the default (null)
    record_path.write_text(json.dumps(record))
    with pytest.raises(RunDirError, match=r"model.max_seq_len: 96 -> None"):
        claim(tmp_path, "train")


def test_another_job_is_refused(tmp_path):
    claim(tmp_path, "train").release()
    with pytest.raises(RunDirError, match="holds a 'train' run; `sft` would replace"):
        claim(tmp_path, "sft")


def test_second_process_is_refused_while_the_first_writes(tmp_path):
    with lock_holder(f"""
            import sys, time
            from megatron_gspo.run.lock import lock_run_dir
            lock_run_dir({str(tmp_path)!r}, "train"); print("locked", flush=True)
            time.sleep(60)""",
                     cwd=os.getcwd()) as holder:
        with pytest.raises(RunDirError, match=rf"another process \(pid {holder.pid} job train"):
            claim(tmp_path)
    claim(tmp_path).release()  # the lock dies with its process: no stale lock


def test_a_job_may_change_the_sections_it_does_not_read(tmp_path):
    """sft reads no train / loss / rollout keys and train no sft keys: changing them is no
    config change for that job's run dir (a changed key it reads still is)."""
    claim(tmp_path / "sft", "sft").release()
    claim(tmp_path / "sft", "sft", "loss.name=grpo", "rollout.temperature=0.5",
          "train.routing_replay=r2").release()
    with pytest.raises(RunDirError, match=r"sft.lr: 0.003 -> 0.1"):
        claim(tmp_path / "sft", "sft", "sft.lr=0.1")
    claim(tmp_path / "rl", "train").release()
    claim(tmp_path / "rl", "train", "sft.lr=0.1", "sft.batch_size=8").release()


def test_resume_false_refuses_a_run_dir_holding_checkpoints(tmp_path):
    claim(tmp_path, resume=False).release()  # nothing to overwrite yet
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(RunDirError, match="holds checkpoints and resume=false would overwrite"):
        claim(tmp_path, resume=False)
    claim(tmp_path).release()  # resume=true continues it
    old = tmp_path / "from_before_run_json"  # checkpoints, no run.json: refused all the same
    (old / "checkpoints").mkdir(parents=True)
    with pytest.raises(RunDirError, match="holds checkpoints and resume=false would overwrite"):
        claim(old, resume=False)
    assert not (old / "run.json").exists()


def test_a_run_dir_from_before_run_json(tmp_path):
    """A run dir written before run.json existed is known by its `{job}_config.yaml`: another
    job is refused; its own job resumes, and the config it recorded is never replaced."""
    (tmp_path / "sft_config.yaml").write_text("as the sft run started")
    with pytest.raises(RunDirError, match="holds a 'sft' run; `train` would replace"):
        claim(tmp_path, "train")
    claim(tmp_path, "sft").release()
    assert (tmp_path / "run.json").exists()
    assert (tmp_path / "sft_config.yaml").read_text() == "as the sft run started"


def _lock_elsewhere(run_dir) -> str:
    """Try the run dir's lock from another process: 'locked', or its error."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from megatron_gspo.run.lock import lock_run_dir
        lock_run_dir({str(run_dir)!r}, "train"); print("locked")""")],
        capture_output=True, text=True, cwd=os.getcwd())
    return p.stdout.strip() or p.stderr.strip().splitlines()[-1]


def test_released_or_refused_claims_free_the_lock(tmp_path):
    """A released claim, and a refused one, drop the flock: another process may then start
    (a kept lock would refuse every later job while this process lives)."""
    claim(tmp_path, "train").release()
    assert _lock_elsewhere(tmp_path) == "locked"
    with pytest.raises(RunDirError, match="holds a 'train' run"):
        claim(tmp_path, "sft")
    assert _lock_elsewhere(tmp_path) == "locked"


def test_unwritable_run_dir_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = one_line_error(capsys, "train", *TINY, f"run_dir={blocker}/run")
    assert f"run_dir={blocker}/run: cannot write there" in err


def test_sft_into_an_rl_run_keeps_its_checkpoints(tmp_path, capsys):
    run = tmp_path / "rl"
    assert cli(capsys, "train", *TINY, f"run_dir={run}", "train.steps=1")[0] == 0
    latest = (run / "checkpoints" / "latest").read_text()
    rows = read_jsonl(run / "metrics.jsonl")
    config = (run / "train_config.yaml").read_text()
    assert "holds a 'train' run" in one_line_error(capsys, "sft", *TINY, f"run_dir={run}")
    err = one_line_error(capsys, "train", *TINY, f"run_dir={run}", "optim.lr=0.5")
    assert "optim.lr: 0.003 -> 0.5" in err
    assert (run / "checkpoints" / "latest").read_text() == latest
    assert read_jsonl(run / "metrics.jsonl") == rows
    assert (run / "train_config.yaml").read_text() == config
    assert not (run / "sft_config.yaml").exists()


# ----------------------------------------------------------------------------- checkpoints


def overwrite_two_floats(path) -> None:
    """Corrupt a checkpoint file silently: two float32 infs deep inside its tensor data."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00\x00\x80\x7f\x00\x00\x80\x7f")


def _shard(root, step):
    return os.path.join(ckpt.step_dir(root, step), "rank_00000.pt")


def test_overwritten_floats_are_caught_and_resume_falls_back(tmp_path, capsys):
    run = tmp_path / "run"
    t = trainer(run, "train.steps=2")
    t.train()
    root = str(run / "checkpoints")
    overwrite_two_floats(_shard(root, 2))
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00000.pt is corrupt"):
        ckpt.load_checkpoint(root)
    resumed = trainer(run, "train.steps=2")
    assert resumed.state.iteration == 1  # fell back to step 1
    assert "skipping checkpoint step 2" in capsys.readouterr().out
    resumed.rt.close()


def test_truncated_shard_is_a_one_line_error(tmp_path):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, {"w": torch.zeros(1000)})
    ckpt.mark_latest(root, 1)
    with open(_shard(root, 1), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckpt.CheckpointError, match=r"rank_00000.pt is truncated.*100 bytes"):
        ckpt.load_checkpoint(root)


def test_stale_tmp_files_are_removed_and_files_follow_the_umask(tmp_path):
    claim(tmp_path).release()  # the run's record
    root = tmp_path / "checkpoints"
    step = root / "step_000001"
    step.mkdir(parents=True)
    stale = step / ".rank_00000.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    old = os.umask(0o022)
    try:
        claim(tmp_path).release()
        ckpt.save_checkpoint(str(root), 2, {"w": torch.zeros(3)})
    finally:
        os.umask(old)
    assert not stale.exists()
    assert os.stat(_shard(str(root), 2)).st_mode & 0o777 == 0o644


def test_disk_full_names_the_file_and_keeps_the_previous_step(tmp_path, monkeypatch):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, {"w": torch.zeros(3)})
    ckpt.mark_latest(root, 1)
    real = tempfile.mkstemp  # megatron_gspo.files.write_atomically's

    def full_disk(*args, **kwargs):  # a real ENOSPC: writes go to /dev/full
        fd, path = real(*args, **kwargs)
        os.dup2(os.open("/dev/full", os.O_WRONLY), fd)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*rank_00000.pt: No space left"):
        ckpt.save_checkpoint(root, 2, {"w": torch.zeros(100_000)})
    monkeypatch.undo()
    assert ckpt.latest_step(root) == 1 and ckpt.load_checkpoint(root)["w"].shape == (3,)
    assert not [n for n in os.listdir(ckpt.step_dir(root, 2)) if n.endswith(".tmp")]


def test_disk_filling_mid_save_names_the_file(tmp_path):
    """The disk fills after part of a shard is written (a file size limit here): torch turns
    the OSError into its own RuntimeError, the error still names the file and the OS reason."""
    import resource

    root = str(tmp_path)
    ckpt.save_checkpoint(root, 1, {"w": torch.zeros(3)})
    ckpt.mark_latest(root, 1)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    sigxfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    try:
        with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*rank_00000.pt: File too"):
            ckpt.save_checkpoint(root, 2, {"w": torch.zeros(100_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, sigxfsz)
    assert ckpt.latest_step(root) == 1 and os.listdir(ckpt.step_dir(root, 2)) == []


# ----------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize("override, fragment", [
    ("loss.name=ppo", "loss.name=ppo: unknown policy loss; valid: ['grpo', 'gspo'"),
    ("task.name=nope", "task.name=nope: unknown task; valid: ['addition'"),
    ("model.preset=qwen9", "model.preset=qwen9: unknown preset; valid: "),
    ("task.kwargs.bogus=1", "task.kwargs.bogus: unknown argument of task 'addition'"),
])
def test_unknown_registry_names_are_refused_at_load(tmp_path, capsys, override, fragment):
    assert fragment in one_line_error(capsys, "train", f"run_dir={tmp_path}/r", override)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text, fragment", [
    ("model:\n  preset: [tiny\n", ":3:1: invalid YAML"),
    ("model:\n  preset: tiny\n  preset: small\n", ":3:3: invalid YAML: duplicate key 'preset'"),
])
def test_malformed_yaml_names_line_and_column(tmp_path, capsys, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert f"{path}{fragment}" in one_line_error(capsys, "train", "--config", str(path))


def test_init_checkpoint_errors_name_the_problem(tmp_path, capsys):
    sft = tmp_path / "sft"
    assert cli(capsys, "sft", *TINY, f"run_dir={sft}")[0] == 0
    shard = sft / "checkpoints" / "step_000002" / "rank_00000.pt"
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path}/a",
                         f"init_checkpoint={shard}")
    assert "is a file; pass the run dir" in err
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path}/b",
                         f"init_checkpoint={tmp_path}/missing")
    assert "missing: no such directory" in err
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path}/c",
                         f"init_checkpoint={sft}", "model.preset=qwen3-moe-tiny")
    assert "holds preset 'tiny', this run builds 'qwen3-moe-tiny' (4 layers)" in err
    assert "shape" in err
    assert not (tmp_path / "c" / "run.json").exists()  # a refused start records nothing
    err = one_line_error(capsys, "train", *TINY, f"run_dir={tmp_path}/d",
                         f"init_checkpoint={sft}", "model.num_layers=3")
    assert "holds preset 'tiny', this run builds 'tiny' (3 layers)" in err


# ----------------------------------------------------------------------------- wandb


def test_unreachable_wandb_server_falls_back_to_offline(monkeypatch):
    from megatron_gspo.run.metrics import _online_or_offline

    with socket.socket() as s:  # a port that refuses: bound, never listening
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
        assert _online_or_offline(timeout_s=2.0) == "offline"
    with socket.socket() as server:  # a reachable one stays online
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert _online_or_offline(timeout_s=2.0) == "online"


def test_logger_starts_wandb_offline_when_online_is_unreachable(tmp_path, monkeypatch):
    import types

    from megatron_gspo.run import metrics

    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or None)
    monkeypatch.setattr(metrics, "_import_wandb", lambda mode: fake)
    monkeypatch.setattr(metrics, "_online_or_offline", lambda: "offline")
    metrics.MetricsLogger(str(tmp_path), {}, wandb_mode="online").close()
    assert seen["mode"] == "offline"


def test_resume_force_is_a_config_value():
    assert load_config(None, ["resume=force"]).resume == "force"
    assert load_config(None, ["resume=false"]).resume is False


def test_minibatches_must_divide_each_data_parallel_ranks_share():
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.jobs.rl import local_prompts

    cfg = load_config(None, ["rollout.prompts_per_batch=4", "rollout.group_size=2",
                             "train.num_minibatches=8"])  # the global batch (8) splits in 8
    assert local_prompts(cfg, dp=1) == 4
    with pytest.raises(ConfigError, match=r"num_minibatches=8 does not divide .* 4 rollout rows"):
        local_prompts(cfg, dp=2)  # ... but each of 2 ranks holds only 4 rows
    with pytest.raises(ConfigError, match="prompts_per_batch=4 is not divisible by the "
                                          "data-parallel size 3"):
        local_prompts(cfg, dp=3)


