"""A run directory belongs to one run: owner record, config fingerprint, lock, stale-file cleanup.

    run_dir/run.json          {"job": "<job>", "fingerprint": "...", "config": {...semantic keys},
                               "inputs": {...},  (data files, tokenizer: megatron_gspo.run.inputs)
                               "init_step": 6}   (init_checkpoint's step read: the KL reference)
    run_dir/.lock             flock'ed by rank 0 while a process writes the run ("pid job"; its
                              forks hold no lock and die with it: megatron_gspo.run.lock)
    run_dir/{job}_config.yaml the resolved config, written once on first start, never replaced

`claim_run_dir` runs on every rank before anything is written: rank 0 takes the lock and checks
the record, every rank gets the same verdict (one collective). Refused, with a one-line
`RunDirError` naming what differs: a run dir owned by another job (`sft` into an RL run), a
config whose semantic keys differ from the recorded ones (unless `resume=force`), a record that
cannot be read (`megatron_gspo.run.record`), checkpoints without a record (run.json deleted:
unless `resume=force`, which records this start's config), a second process writing the same
run dir, an unwritable path (a symbolic link that leads nowhere is named); once the data is
loaded, `check_inputs` refuses data files, a tokenizer, a chat template or plugin code whose
contents changed since the run started (unless `resume=force`, which says what changed).
`record_run` writes the record and the config once the run has really started (policy built,
init weights loaded), so a run that fails its set-up leaves nothing that would refuse its
corrected re-run; `forget_run` undoes it for an RL start refused by `train.start_accuracy`
before anything was saved.

Semantic keys are the ones that change what is trained; the rest may change between resumes:
the fields marked `megatron_gspo.config.fields.may_change` where they are declared (how long,
how often to eval, save and log, wandb, the collective timeout, memory knobs with the same
gradients: activation recompute and the token budgets of the no-grad pass and of a train step's
forwards, where the vLLM engine runs; `megatron_gspo.config.schema.resume_may_change` lists
them), the sections a job does not read (its `JobSpec`) and the TP / EP / DP layout (LAYOUT).
Departure from verl / Megatron-LM, which resume whatever is in the save dir: they overwrite
silently (docs/pitfalls.md#run-dir-ownership).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import shutil

import torch.distributed as dist

from megatron_gspo.config.loader import current_names
from megatron_gspo.config.schema import (RunConfig, config_to_dict, resume_may_change,
                                         settings_may_change)
from megatron_gspo.errors import RunDirError
from megatron_gspo.run.checkpoint import atomic_write
from megatron_gspo.run.inputs import changed_inputs
from megatron_gspo.run.lock import lock_run_dir
from megatron_gspo.run.record import RUN_FILE, read_record
from moe.platform.children import tie_forks

# The parallel layout: a checkpoint reshards over it (moe.model.dist_ckpt), so a resume may change it,
# except TP / EP under the distributed optimizer (its state reshards over DP only).
LAYOUT = ("model.tp", "model.ep", "model.sequence_parallel", "model.dispatcher")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "kwargs":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _skipped(config: dict, unused: tuple) -> tuple:
    distributed = (config.get("optim") or {}).get("distributed")
    return resume_may_change() + settings_may_change(config) + tuple(unused) + \
        (LAYOUT[2:] if distributed else LAYOUT)


def _kept(flat: dict, skip: tuple) -> dict:
    return {k: v for k, v in sorted(flat.items())
            if not any(k == s or k.startswith(s + ".") for s in skip)}


def semantic_config(config: dict, unused: tuple = ()) -> dict:
    """The dotted keys of `config` that define the run (all but `resume_may_change()`, the
    parts' settings marked may_change, and LAYOUT; `unused`: the sections the run's job does not
    read, `megatron_gspo.run.setup.JobSpec`). A part's settings are spelled out in `config`
    (`config_to_dict`), so a record holds the numbers a default means."""
    kept = _kept(_flatten(config), _skipped(config, unused))
    return json.loads(json.dumps(kept, default=str))  # as run.json holds it (tuples -> lists)


def _current(flat: dict) -> dict:
    """A record's dotted keys as the config reads them now: older names as their keys now, an
    older key's value read into the key now (`megatron_gspo.config.loader.current_names`: a
    record from before `rollout.decoder` was read into `rollout.backend`, or before a rename)."""
    nested: dict = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return _flatten(current_names(RunConfig, nested))


def fingerprint(semantic: dict) -> str:
    return hashlib.sha256(json.dumps(semantic, sort_keys=True, default=str).encode()).hexdigest()


def differing_keys(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """`key: old -> new` for each key whose value differs ('<unset>' where a side lacks it). A
    key the old record lacks while the new config holds its `defaults` value does not count: a
    field added to the config since that run started, at the value it implicitly ran with."""
    unset = object()
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, unset), new.get(k, unset)
        if a is unset and defaults is not None and k in defaults and b == defaults[k]:
            continue
        if a is unset or b is unset or a != b:
            out.append(f"{k}: {'<unset>' if a is unset else repr(a)} -> "
                       f"{'<unset>' if b is unset else repr(b)}")
    return out


def default_semantic_config(unused: tuple = ()) -> dict:
    """`semantic_config` of the default RunConfig: the values of fields added since a run."""
    return semantic_config(config_to_dict(RunConfig()), unused)


def remove_stale_tmp(run_dir: str) -> list[str]:
    """Delete what a killed save left under run_dir: `.*.tmp` files (atomic_write's) and the
    `checkpoints/step_*/dist.tmp` dirs moe.model.dist_ckpt writes before renaming them."""
    root = glob.escape(run_dir)
    stale = glob.glob(os.path.join(root, "**", ".*.tmp"), recursive=True)
    for path in stale:
        os.remove(path)
    dirs = glob.glob(os.path.join(root, "checkpoints", "step_*", "dist.tmp"))
    for path in dirs:
        shutil.rmtree(path)
    return stale + dirs


def _verdict(run_dir: str, job: str, config: dict, resume, unused: tuple) -> str:
    """Rank 0's check of the record: "" when this run may go on, else the one-line reason."""
    record = read_record(run_dir)
    if record is None:
        other = sorted(os.path.basename(p)[:-len("_config.yaml")] for p in glob.glob(
            os.path.join(glob.escape(run_dir), "*_config.yaml")))
        other = [j for j in other if j != job]
        if other:  # written before run.json existed
            return (f"run_dir={run_dir} holds a '{other[0]}' run; `{job}` would replace its "
                    "checkpoints: choose another run_dir")
        return _overwrites(run_dir, resume) or _unrecorded(run_dir, resume)
    if record["job"] != job:
        return (f"run_dir={run_dir} holds a '{record['job']}' run; `{job}` would replace its "
                "checkpoints: choose another run_dir")
    new = semantic_config(config, unused)
    if fingerprint(new) != record["fingerprint"] and resume != "force":
        old = _kept(_current(record["config"]), _skipped(config, unused))  # records may hold LAYOUT keys
        diff = differing_keys(old, new, default_semantic_config(unused))
        if diff:
            return (f"run_dir={run_dir} was started with another config ({'; '.join(diff)}); "
                    "use a new run_dir, or resume=force to continue with this one")
    return _overwrites(run_dir, resume)


def _unrecorded(run_dir: str, resume) -> str:
    """The reason a start may not adopt `run_dir`'s checkpoints without a record (run.json
    deleted: any config would be taken for the run's), or "": none there, or resume=force,
    which says it records this start's config."""
    if not glob.glob(os.path.join(glob.escape(run_dir), "checkpoints", "step_*")):
        return ""
    if resume == "force":
        print(f"WARNING: resume=force: run_dir={run_dir} holds checkpoints but no {RUN_FILE}: "
              "continuing them with this config, recorded as the run's", flush=True)
        return ""
    return (f"run_dir={run_dir} holds checkpoints but no {RUN_FILE}, the record of the config "
            "and inputs they were trained with: restore it, use a new run_dir "
            f"(init_checkpoint={run_dir} starts from their weights), or resume=force to continue "
            "them with this config")


def _overwrites(run_dir: str, resume) -> str:
    """The reason `resume=false` may not start in `run_dir` (it holds checkpoints), or ""."""
    if resume is False and os.path.isdir(os.path.join(run_dir, "checkpoints")):
        return (f"run_dir={run_dir} holds checkpoints and resume=false would overwrite them; "
                "use a new run_dir, or resume=true")
    return ""


def _broken_link(path: str) -> str:
    """What is wrong with the first symbolic link on `path` (itself or a folder above it) that
    leads nowhere: "X is a symbolic link to T, which does not exist" or "... link loop"; ""."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        part = os.sep.join(parts[:i])
        if os.path.islink(part) and not os.path.exists(part):
            try:
                os.stat(part)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    return f"{part} is a symbolic link loop ({part} -> {os.readlink(part)})"
            return f"{part} is a symbolic link to {os.readlink(part)}, which does not exist"
    return ""


def _agree(message: str) -> str:
    """Rank 0's message on every rank (no-op on one process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def claim_run_dir(run_dir: str, job: str, config: dict, resume, is_main: bool,
                  unused: tuple = ()):
    """Lock run_dir for job `job` (its name) and check it may write there (`unused`: the config
    sections the job does not read); returns the lock (rank 0) or None. Raises RunDirError on
    every rank with rank 0's reason. From here on every rank's forks die with it
    (`moe.platform.children.tie_forks`: megatron's checkpoint writer)."""
    tie_forks()
    lock, message = None, ""
    if is_main:
        try:
            os.makedirs(run_dir, exist_ok=True)
            lock = lock_run_dir(run_dir, job)
            message = _verdict(run_dir, job, config, resume, unused)
        except RunDirError as e:
            message = str(e)
        except OSError as e:
            why = _broken_link(run_dir) or e.strerror or e
            message = f"run_dir={run_dir}: cannot write there ({why})"
        if message and lock is not None:
            lock.release()
            lock = None
    message = _agree(message)
    if message:
        raise RunDirError(message)
    if is_main:
        for path in remove_stale_tmp(run_dir):
            print(f"removed {path}, left by an interrupted save", flush=True)
    return lock


def forget_run(run_dir: str, job: str) -> None:
    """Undo `record_run` for a first start refused before saving anything (its start accuracy
    outside `train.start_accuracy`): its corrected re-run, e.g. from another init_checkpoint,
    is then a first start. Call it only when this start wrote the record (a finished run that
    saved no checkpoint keeps its own); a run dir holding a checkpoint step keeps it too."""
    if glob.glob(os.path.join(glob.escape(run_dir), "checkpoints", "step_*")):
        return
    for name in (RUN_FILE, f"{job}_config.yaml"):
        if os.path.isfile(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))


def check_inputs(run_dir: str, inputs: dict, resume, is_main: bool) -> None:
    """RunDirError on every rank when the inputs recorded at the run's first start
    (`megatron_gspo.run.inputs`: data files, split, tokenizer, chat template) differ from this
    start's `inputs` (rank 0's); resume=force goes on with a warning naming them. A record from
    before inputs were recorded, or none yet, passes."""
    message = ""
    if is_main:
        recorded = (read_record(run_dir) or {}).get("inputs")
        changed = changed_inputs(recorded, inputs) if recorded is not None else []
        if changed and resume == "force":
            print(f"WARNING: resume=force: {run_dir} continues with inputs other than it started "
                  f"with: {'; '.join(changed)}", flush=True)
        elif changed:
            message = (f"run_dir={run_dir} was started with other inputs: {'; '.join(changed)} "
                       "changed since; restore them, use a new run_dir, or resume=force to "
                       "continue with these")
    message = _agree(message)
    if message:
        raise RunDirError(message)


def recorded_value(run_dir: str, key: str, is_main: bool):
    """run.json's `key` on every rank (rank 0 reads it); None when absent."""
    text = json.dumps((read_record(run_dir) or {}).get(key)) if is_main else ""
    return json.loads(_agree(text) or "null")


def record_run(run_dir: str, job: str, config: dict, save_config,
               extra: dict | None = None, unused: tuple = ()) -> bool:
    """On first start: write run.json (with `extra`: the input fingerprints, the step of
    init_checkpoint read; the config less the job's `unused` sections) and `{job}_config.yaml`
    (both are never replaced); returns whether this call wrote the record."""
    record_path = os.path.join(run_dir, RUN_FILE)
    if os.path.isfile(record_path):
        return False
    cfg_path = os.path.join(run_dir, f"{job}_config.yaml")
    if not os.path.exists(cfg_path):
        save_config(cfg_path)
    semantic = semantic_config(config, unused)
    record = {"job": job, "fingerprint": fingerprint(semantic), "config": semantic}
    record.update(extra or {})
    text = json.dumps(record, indent=1, default=str)
    atomic_write(record_path, lambda f: f.write(text.encode()))
    return True
