"""megatron_gspo.run.rundir: which config keys a resume may change, the run record, the lock's
sharing and owner line, and stale-temporary clean-up (the refusals end to end are in
test_faults.py)."""

import contextlib
import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_gspo.config.schema import config_to_dict, load_config, resume_may_change
from megatron_gspo.run.lock import LOCK_FILE
from megatron_gspo.run.rundir import claim_run_dir, record_run, semantic_config
from megatron_gspo.errors import RunDirError
from megatron_gspo.jobs import rl, sft


@contextlib.contextmanager
def lock_holder(code: str, **popen_kwargs):
    """Another process running `code`, which takes a lock and prints "locked"; yields it once
    the lock is held, kills it on exit."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, text=True, **popen_kwargs)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


UNUSED = {"train": rl.UNUSED_SECTIONS, "sft": sft.UNUSED_SECTIONS}
"""The config sections each job does not read (its `JobSpec.unused_sections`)."""


def claim(run_dir, job="train", *overrides, resume=True, is_main=True):
    cfg = config_to_dict(load_config(None, [f"run_dir={run_dir}", *overrides]))
    lock = claim_run_dir(str(run_dir), job, cfg, resume, is_main=is_main, unused=UNUSED[job])
    record_run(str(run_dir), job, cfg, lambda p: open(p, "w").write("x"), unused=UNUSED[job])
    return lock


def _lock_is_held(run_dir) -> bool:
    """Whether someone holds run_dir's flock (a fresh descriptor conflicts even in-process)."""
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# A value other than the default for each key a resume may change.
CHANGED = {"run_dir": None, "resume": "resume=force", "plugins": "plugins=[my_plugin.py]",
           "wandb": "wandb.project=other",
           "train.steps": "train.steps=99", "train.eval_every": "train.eval_every=3",
           "train.save_every": "train.save_every=3", "train.log_every": "train.log_every=3",
           "train.keep_checkpoints": "train.keep_checkpoints=2",
           "train.flip_every": "train.flip_every=0", "sft.steps": "sft.steps=7",
           "sft.eval_every": "sft.eval_every=7", "sft.target_accuracy":
           "sft.target_accuracy=[0.2,0.4]", "train.start_accuracy": "train.start_accuracy=[0,1]",
           "model.dist_timeout_min": "model.dist_timeout_min=3",
           "train.logprob_max_tokens": "train.logprob_max_tokens=0",
           "model.recompute_granularity": "model.recompute_granularity=full",
           "model.recompute_modules": "model.recompute_modules=core_attn",
           "rollout.vllm.push_check_tol": "rollout.vllm.push_check_tol=30",
           "rollout.vllm.kv_cache_gb": "rollout.vllm.kv_cache_gb=2",
           "train.micro_max_tokens": "train.micro_max_tokens=512",
           "rollout.max_batch_rows": "rollout.max_batch_rows=64",
           "train.router_margin_small": "train.router_margin_small=0.05",
           "train.route_sensitivity_every": "train.route_sensitivity_every=2",
           "train.route_sensitivity_fraction": "train.route_sensitivity_fraction=0.5",
           **{f"rollout.vllm.{k}": ("rollout.vllm.mode=server", f"rollout.vllm.{k}={v}")
              for k, v in [("tensor_parallel_size", 2), ("replicas", 2),
                           ("addresses", '["127.0.0.1:8000"]'), ("host", "0.0.0.0"),
                           ("port", 8000), ("sync_host", "10.0.0.1"), ("sync_port", 8001),
                           ("start_timeout_s", 5), ("request_timeout_s", 5),
                           ("max_restarts", 0), ("bucket_mb", 8), ("chunk_mb", 1),
                           ("cpu_bind", "0|1")]},
           "rollout.vllm.mode": "rollout.vllm.mode=server",
           "train.pack": "train.pack=false", "sft.pack": "sft.pack=false",
           "train.balance_dp": "train.balance_dp=false",
           "instruments": "instruments=[flips]"}


def test_every_non_semantic_key_is_listed_here():
    """Keeps CHANGED (the cases below) in step with the fields marked `may_change`."""
    assert set(CHANGED) == set(resume_may_change())


VLLM_DEPLOYMENT = tuple(f"rollout.vllm.{k}" for k in (
    "mode", "tensor_parallel_size", "replicas", "addresses", "host", "port", "sync_host",
    "sync_port", "start_timeout_s", "request_timeout_s", "max_restarts", "bucket_mb", "chunk_mb",
    "cpu_bind"))
LISTED = ("run_dir", "resume", "plugins", "wandb", "train.steps", "train.eval_every",
          "train.save_every", "train.keep_checkpoints", "train.log_every",
          "train.flip_every", "train.router_margin_small", "train.route_sensitivity_every",
          "train.route_sensitivity_fraction", "sft.steps", "sft.eval_every",
          "sft.target_accuracy", "train.start_accuracy", "model.dist_timeout_min",
          "train.logprob_max_tokens", "model.recompute_granularity", "model.recompute_modules",
          "rollout.push_check_tol", "rollout.engine_kv_cache_gb",
          "train.micro_max_tokens", "rollout.max_batch_rows", *VLLM_DEPLOYMENT)
"""rundir.py's hand list of the keys a resume may change, as it was before the fields said so
themselves (`fields.may_change`), under the names of the time."""
SINCE = ("train.pack", "sft.pack", "train.balance_dp", "instruments")
"""Fields marked `may_change` since the hand list went (packing: the same numbers to float
rounding; the data-parallel balance: which rows each rank trains on; the instruments: they
measure, they train nothing)."""


def test_the_fields_marked_may_change_are_the_keys_the_hand_list_held():
    """Marking the fields changed no verdict: the same keys, the two that moved into
    rollout.vllm under their new names."""
    moved = {"rollout.push_check_tol": "rollout.vllm.push_check_tol",
             "rollout.engine_kv_cache_gb": "rollout.vllm.kv_cache_gb"}
    assert sorted(resume_may_change()) == sorted([*(moved.get(k, k) for k in LISTED), *SINCE])


@pytest.mark.parametrize("job", ["train", "sft"])
@pytest.mark.parametrize("key", [k for k in CHANGED if CHANGED[k]])
def test_each_non_semantic_key_may_change_on_resume(tmp_path, job, key):
    """Guards `resume_may_change()` entry by entry: a resume that changes only how long / how often /
    where to log (not what is trained) is accepted, with the run's fingerprint unchanged."""
    base = config_to_dict(load_config(None, [f"run_dir={tmp_path}"]))
    overrides = CHANGED[key] if isinstance(CHANGED[key], tuple) else (CHANGED[key],)
    changed = config_to_dict(load_config(None, [f"run_dir={tmp_path}", *overrides]))
    assert changed != base
    assert semantic_config(changed, UNUSED[job]) == semantic_config(base, UNUSED[job])
    claim(tmp_path, job).release()
    claim(tmp_path, job, *overrides).release()


def test_task_kwargs_are_one_recorded_value():
    """run.json holds task.kwargs as one dict (records written so far do): a flattened
    `task.kwargs.num_digits` would not match them."""
    cfg = config_to_dict(load_config(None, ["task.kwargs.num_digits=2", "optim.lr=0.5"]))
    semantic = semantic_config(cfg, UNUSED["train"])
    assert semantic["task.kwargs"] == {"num_digits": 2}
    assert not [k for k in semantic if k.startswith("task.kwargs.")]
    assert semantic["optim.lr"] == 0.5 and "sft.lr" not in semantic and "run_dir" not in semantic


def test_skipped_keys_match_whole_dotted_parts():
    """A skipped key covers itself and its sub-keys only (`train.steps` does not cover a
    `train.steps_per_eval`), and values are kept as run.json holds them (tuples as lists)."""
    config = {"train": {"steps": 5, "steps_per_eval": 2, "eval_every": 1}, "wandbx": 1,
              "model": {"shape": (2, 3)}, "sft": {"lr": 0.1}}
    assert semantic_config(config, UNUSED["train"]) == {"model.shape": [2, 3],
                                                "train.steps_per_eval": 2, "wandbx": 1}


def test_resume_force_keeps_the_first_record(tmp_path):
    """run.json is written once: a resume=force run goes on under the original record, so a
    later resume with the original config is still accepted (and the new one still refused)."""
    claim(tmp_path, "train", "optim.lr=1e-4").release()
    first = (tmp_path / "run.json").read_text()
    claim(tmp_path, "train", "optim.lr=1e-3", resume="force").release()
    assert (tmp_path / "run.json").read_text() == first
    claim(tmp_path, "train", "optim.lr=1e-4").release()
    with pytest.raises(RunDirError, match=r"optim.lr: 0.0001 -> 0.001"):
        claim(tmp_path, "train", "optim.lr=1e-3")


def test_claims_in_one_process_share_the_lock_until_the_last_release(tmp_path):
    """Two Trainers in one process (a test, a notebook) both claim the run dir; the flock is
    dropped only when both have released it."""
    first = claim(tmp_path)
    second = claim(tmp_path)
    first.release()
    assert _lock_is_held(tmp_path)
    second.release()
    assert not _lock_is_held(tmp_path)
    second.release()  # a second release is a no-op
    assert not _lock_is_held(tmp_path)


def test_lock_file_names_its_current_owner_only(tmp_path):
    """The owner line replaces what a previous (longer) owner wrote, so the refusal names the
    live process."""
    (tmp_path / LOCK_FILE).write_text("pid 123456789 job sft and more text")
    claim(tmp_path, "train").release()
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} job train"


def test_a_lock_held_by_an_unknown_process_is_still_refused(tmp_path):
    """A holder that wrote no owner line (not our process) is refused, naming the process that
    has the lock file open (where /proc tells)."""
    (tmp_path / LOCK_FILE).write_text("")
    with lock_holder(f"""
            import fcntl, os, time
            fd = os.open({str(tmp_path / LOCK_FILE)!r}, os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX); print("locked", flush=True); time.sleep(60)""") \
            as holder:
        named = rf"pid {holder.pid}: .*; the lock file names no owner" \
            if os.path.isdir("/proc") else "unknown; no holder found"
        with pytest.raises(RunDirError, match=rf"another process \({named}\)"):
            claim(tmp_path)


def test_only_hidden_tmp_files_are_removed_also_under_glob_characters(tmp_path):
    """Stale `.*.tmp` files are atomic_write's; a user's `notes.tmp` is kept, and a run dir
    whose name holds glob characters is searched literally."""
    run_dir = tmp_path / "run[1]"
    (run_dir / "checkpoints").mkdir(parents=True)
    stale = run_dir / "checkpoints" / ".latest.x1.tmp"
    stale.write_text("half")
    mine = run_dir / "notes.tmp"
    mine.write_text("keep")
    claim(run_dir).release()
    assert not stale.exists() and mine.read_text() == "keep"


def test_other_ranks_take_rank_0s_verdict_and_leave_files_alone(tmp_path, monkeypatch):
    """A rank that is not rank 0 takes no lock, deletes nothing and raises rank 0's reason
    (the broadcast), even where its own view of the run dir would let it go on."""
    import torch.distributed as dist

    stale = tmp_path / ".x.tmp"
    stale.write_text("half")
    cfg = config_to_dict(load_config(None, [f"run_dir={tmp_path}"]))
    assert claim_run_dir(str(tmp_path), "train", cfg, True, is_main=False) is None
    assert stale.exists() and not (tmp_path / LOCK_FILE).exists()

    def from_rank_0(box, src):
        assert src == 0 and box == [""]
        box[0] = "run_dir=x holds a 'sft' run"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", from_rank_0)
    with pytest.raises(RunDirError, match="^run_dir=x holds a 'sft' run$"):
        claim_run_dir(str(tmp_path), "train", cfg, True, is_main=False)


def test_the_layout_may_change_on_resume_but_not_tp_ep_under_the_distributed_optimizer(
        tmp_path):
    """docs/checkpoints.md: re-running the same command resumes with another TP / EP / DP layout
    (the dist checkpoint reshards); the distributed optimizer's state reshards over DP only."""
    claim(tmp_path / "a", "train", "model.ep=2").release()
    claim(tmp_path / "a", "train").release()  # the EP=2 run resumed in one process
    claim(tmp_path / "a", "train", "model.tp=2", "model.sequence_parallel=true").release()
    claim(tmp_path / "b", "train", "model.ep=2", "optim.distributed=true").release()
    claim(tmp_path / "b", "train", "model.ep=2", "model.dispatcher=allgather",
          "optim.distributed=true").release()
    with pytest.raises(RunDirError, match=r"\(model.ep: 2 -> 1\)"):
        claim(tmp_path / "b", "train", "optim.distributed=true")


def test_a_record_holding_the_layout_keys_resumes_with_another_layout(tmp_path):
    """run.json written before LAYOUT was skipped holds model.tp / ep / ...: they do not count."""
    import json

    from megatron_gspo.run.rundir import RUN_FILE, fingerprint

    cfg = config_to_dict(load_config(None, [f"run_dir={tmp_path}", "model.ep=2"]))
    old = dict(semantic_config(cfg, UNUSED["train"]), **{"model.tp": 1, "model.ep": 2,
                                                 "model.sequence_parallel": False,
                                                 "model.dispatcher": "alltoall"})
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / RUN_FILE).write_text(json.dumps(
        {"job": "train", "fingerprint": fingerprint(old), "config": old}))
    claim(tmp_path, "train").release()
    with pytest.raises(RunDirError, match=r"optim.lr: 0.0001 -> 0.5"):
        claim(tmp_path, "train", "optim.lr=0.5")


def test_a_dist_checkpoint_a_killed_save_left_half_written_is_removed(tmp_path):
    """A second Ctrl-C (or SIGKILL) during a save leaves moe.model.dist_ckpt's `dist.tmp` in a step
    dir `latest` never pointed to: a whole checkpoint's worth of disk, never reused when the
    run's later saves land on other steps. The next start removes it, not a user's `x.tmp`."""
    claim(tmp_path).release()  # the run's record
    step = tmp_path / "checkpoints" / "step_000062"
    (step / "dist.tmp").mkdir(parents=True)
    (step / "dist.tmp" / "__0_0.distcp").write_bytes(b"half")
    mine = tmp_path / "checkpoints" / "x.tmp"
    mine.mkdir()
    claim(tmp_path).release()
    assert not (step / "dist.tmp").exists() and mine.is_dir()


def test_forget_run_keeps_the_record_of_a_run_with_a_checkpoint(tmp_path):
    """forget_run (a start refused by train.start_accuracy) removes run.json and the job's
    config only while no checkpoint step exists; other jobs' files stay."""
    from megatron_gspo.run.rundir import RUN_FILE, forget_run

    for name in (RUN_FILE, "train_config.yaml", "sft_config.yaml"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    forget_run(str(tmp_path), "train")
    assert (tmp_path / RUN_FILE).exists() and (tmp_path / "train_config.yaml").exists()
    (tmp_path / "checkpoints" / "step_000001").rmdir()
    forget_run(str(tmp_path), "train")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "sft_config.yaml"]


def test_a_record_with_the_paper_clip_range_spelled_out_matches_none():
    """run.json files written before the config kept a None clip range hold the paper's numbers;
    the same run's config now says None: not a changed run (and a changed range still is)."""
    from megatron_gspo.config.schema import config_to_dict, load_config
    from megatron_gspo.run.rundir import differing_keys, semantic_config

    new = semantic_config(config_to_dict(load_config(None, ["loss.name=gspo"])), UNUSED["train"])
    old = dict(new, **{"loss.eps_low": 0.0003, "loss.eps_high": 0.0004})
    assert differing_keys(old, new) == []
    moved = semantic_config(config_to_dict(load_config(None, ["loss.eps_low=0.001"])),
                            UNUSED["train"])
    assert differing_keys(old, moved) == ["loss.eps_low: 0.0003 -> 0.001"]


def test_a_record_from_before_the_validation_split_resumes_under_the_new_names(tmp_path):
    """run.json written before the validation split holds task.n_eval and data.eval_files /
    eval_fraction / max_eval, and no n_val / val_*: the same run's config (its keys now
    task.n_test, data.test_*) resumes; a changed test split is still refused, by its new name."""
    import json

    from megatron_gspo.run.rundir import RUN_FILE, fingerprint

    cfg = config_to_dict(load_config(None, [f"run_dir={tmp_path}", "task.n_test=256"]))
    new = semantic_config(cfg, UNUSED["train"])
    old = {k: v for k, v in new.items() if ".val_" not in k and k != "task.n_val"}
    for now, before in (("task.n_test", "task.n_eval"), ("data.test_files", "data.eval_files"),
                        ("data.test_fraction", "data.eval_fraction"),
                        ("data.max_test", "data.max_eval")):
        old[before] = old.pop(now)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / RUN_FILE).write_text(json.dumps(
        {"job": "train", "fingerprint": fingerprint(old), "config": old}))
    claim(tmp_path, "train", "task.n_test=256").release()
    claim(tmp_path, "train", "task.n_eval=256").release()  # the old spelling of the same run
    with pytest.raises(RunDirError, match=r"task.n_test: 256 -> 64"):
        claim(tmp_path, "train", "task.n_test=64")
    with pytest.raises(RunDirError, match=r"task.n_val: <unset> -> 32"):
        claim(tmp_path, "train", "task.n_test=256", "task.n_val=32")


OLD_ROLLOUT = {"rollout.backend": "lean", "rollout.cuda_graphs": False, "rollout.decoder": "lean",
               "rollout.engine_dtype": "bf16", "rollout.group_size": 8, "rollout.kv_cache": False,
               "rollout.max_new_tokens": 8, "rollout.prompts_per_batch": 8,
               "rollout.router_noise": "fresh", "rollout.router_noise_std": 0.5,
               "rollout.sampler_dtype": "bf16", "rollout.temperature": 1.0, "rollout.top_p": 1.0,
               "rollout.use_sampler_logprobs": False}
"""The rollout keys of a run.json written before the backend sections (as the code of the time
recorded `OLD_SETTINGS`): the backends' settings flat in rollout."""
OLD_SETTINGS = ["rollout.engine_dtype=bf16", "rollout.kv_cache=false", "rollout.cuda_graphs=false",
                "rollout.sampler_dtype=bf16", "rollout.router_noise_std=0.5",
                "rollout.router_noise=fresh"]
NEW_SETTINGS = ["rollout.vllm.dtype=bf16", "rollout.decoders.kv_cache=false",
                "rollout.megatron_engine.cuda_graphs=false", "rollout.decoders.sampler_dtype=bf16",
                "rollout.decoders.router_noise_std=0.5", "rollout.decoders.router_noise=fresh"]


def test_a_record_from_before_the_backend_sections_resumes_under_the_new_names(tmp_path):
    """run.json written before the backends' settings moved into rollout.decoders /
    megatron_engine / vllm holds rollout.kv_cache, rollout.engine_dtype, ...: the same run's
    config resumes, under the new names or the old ones; a key that moved and now may change
    (rollout.vllm.kv_cache_gb) may; a real change is still refused, by its new name."""
    import json

    from megatron_gspo.run.rundir import RUN_FILE, fingerprint

    cfg = config_to_dict(load_config(None, [f"run_dir={tmp_path}", *NEW_SETTINGS]))
    old = {k: v for k, v in semantic_config(cfg, "train").items()
           if not k.startswith("rollout.")}
    old.update(OLD_ROLLOUT)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / RUN_FILE).write_text(json.dumps(
        {"job": "train", "fingerprint": fingerprint(old), "config": old}))
    claim(tmp_path, "train", *NEW_SETTINGS).release()
    claim(tmp_path, "train", *OLD_SETTINGS).release()  # the old spelling of the same run
    claim(tmp_path, "train", *NEW_SETTINGS, "rollout.vllm.kv_cache_gb=3",
          "rollout.engine_kv_cache_gb=4").release()
    with pytest.raises(RunDirError, match=r"started with another config \(rollout.vllm.dtype: "
                                          r"'bf16' -> 'fp32'\)"):
        claim(tmp_path, "train", *NEW_SETTINGS, "rollout.vllm.dtype=fp32")
    with pytest.raises(RunDirError, match=r"\(rollout.decoders.kv_cache: False -> True\)"):
        claim(tmp_path, "train", *OLD_SETTINGS, "rollout.kv_cache=true")

