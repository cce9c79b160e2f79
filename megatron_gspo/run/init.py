"""Weights from elsewhere: `init_checkpoint` (a run dir or one of its step dirs, any parallel
layout) read into a fresh policy, and the step a run's frozen KL reference stays pinned to.

A run's own checkpoints (save and resume) are `megatron_gspo.run.resume`; the layout on disk is
`megatron_gspo.run.checkpoint`. Only weights come from `init_checkpoint`: the optimizer, its lr
schedule and every counter start fresh. Dist checkpoints (`dist/`, written by `moe.model.dist_ckpt`)
load into any TP / EP / DP layout. A model that does not match is one line naming the saved and the built model.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.dist import all_ranks
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run.rundir import recorded_value
from moe.model import dist_ckpt
from moe.model.policy import MoEPolicy


def check_init_checkpoint(path: str) -> str:
    """The checkpoint root or step dir `init_checkpoint` names (a run dir means its newest
    complete step); ConfigError naming the value when it is missing, a file, or holds no
    checkpoint."""
    if not os.path.exists(path):
        raise ConfigError(f"init_checkpoint={path}: no such directory")
    if not os.path.isdir(path):
        raise ConfigError(f"init_checkpoint={path} is a file; pass the run dir (or one of its "
                          "checkpoints/step_XXXXXX dirs) that holds it")
    root = os.path.join(path, "checkpoints")
    root = root if os.path.isdir(root) else path
    try:
        newest = ckpt.newest_step(root)
    except ValueError as e:  # a garbled `latest`
        raise ConfigError(f"init_checkpoint={path}: {e}") from None
    if not (os.path.isfile(ckpt.rank_file(root, 0)) or newest is not None):
        raise ConfigError(f"init_checkpoint={path} holds no checkpoint (no complete "
                          "checkpoints/step_XXXXXX and no rank_00000.pt)")
    return root


def init_step_dir(path: str, step: int | None = None) -> str:
    """The step dir `init_checkpoint=path` reads: the step dir it names, else its run's `step`
    (None: the newest complete one)."""
    root = check_init_checkpoint(path)
    if os.path.isfile(ckpt.rank_file(root, 0)):
        return root
    return ckpt.step_dir(root, ckpt.newest_step(root) if step is None else step)


INIT_RETRIES = 3
"""Reads of `init_checkpoint`'s newest step, which the run writing it may prune meanwhile."""


def load_init_weights(policy: MoEPolicy, path: str, step_dir: str | None = None) -> str:
    """Initialise from `init_checkpoint=path` (a run dir: its newest complete step; a step
    dir), any parallel layout, or from its `step_dir` when given (pinned); returns the step dir
    read. A step removed while it is read (the run writing `path` keeps
    train.keep_checkpoints) is retried with the newest step, unless pinned."""
    for attempt in range(1, INIT_RETRIES + 1):
        read = step_dir or init_step_dir(path)
        try:
            _load_step_dir(policy, read, path)
            return read
        except (Exception, CheckpointException):  # every rank (the load's errors are agreed)
            if step_dir or attempt == INIT_RETRIES or all_ranks(os.path.isdir(read)):
                raise
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"WARNING: init_checkpoint={path}: {read} was removed while it was read "
                  "(pruned by the run writing it); reading its newest step", flush=True)


def reference_dir(cfg: RunConfig, is_main: bool) -> str:
    """The step dir of `init_checkpoint` a resumed run started from: its KL reference, pinned by
    run.json's `init_step` (the run writing init_checkpoint may have moved on since). ConfigError
    naming it when it is gone (resume=force: the newest step, with a warning); a run recorded
    before `init_step` was takes the newest step, with a warning."""
    path = cfg.init_checkpoint
    root = check_init_checkpoint(path)
    if os.path.isfile(ckpt.rank_file(root, 0)):
        return root  # a step dir: pinned by its name
    step, newest = recorded_value(cfg.run_dir, "init_step", is_main), ckpt.newest_step(root)
    if step is not None and os.path.isdir(ckpt.step_dir(root, step)):
        return ckpt.step_dir(root, step)
    if step is not None and cfg.resume != "force":
        raise ConfigError(f"init_checkpoint={path}: step {step}, which {cfg.run_dir} started "
                          f"from and keeps as its KL reference (loss.kl_coef={cfg.loss.kl_coef}),"
                          f" is gone ({root} holds {ckpt.resume_candidates(root)}); restore it, "
                          f"or resume=force to take step {newest} as the reference")
    if is_main:
        why = f"step {step} is gone (resume=force)" if step is not None else \
            f"{cfg.run_dir} did not record which step it started from"
        print(f"WARNING: init_checkpoint={path}: {why}: the KL reference is its newest step, "
              f"{newest}", flush=True)
    return ckpt.step_dir(root, newest)


def _load_step_dir(policy: MoEPolicy, step_dir: str, path: str) -> None:
    """Load step dir `step_dir` of `init_checkpoint=path` into `policy` (weights only)."""
    dist_dir = os.path.join(step_dir, "dist")
    if dist_ckpt.is_dist_checkpoint(dist_dir):
        error = ""
        try:  # every rank checks its share of the files, then all agree (no rank loads alone)
            ckpt.verify_dir(dist_dir, dist.get_rank() if dist.is_initialized() else 0,
                            dist.get_world_size() if dist.is_initialized() else 1)
        except ckpt.CheckpointError as e:
            error = str(e)
        if not all_ranks(not error):
            raise ckpt.CheckpointError(error or f"init_checkpoint={path}: a shard checked by "
                                       "another rank is bad")
        try:
            dist_ckpt.load(policy, dist_dir, optimizer=False)  # collective
        except (Exception, CheckpointException) as e:  # shape / key mismatch: another model
            if (line := dist_ckpt.mismatch_line(e)) is None:  # out of memory, I/O, ...
                raise
            saved = ckpt.load_checkpoint(step_dir, rank=0).get("config", {}).get("model", {})
            raise ConfigError(f"init_checkpoint={path} holds {saved_model(saved)}, this run "
                              f"builds {built_model(policy)}: {line}") from None
        return
    raise ConfigError(f"init_checkpoint={path}: {step_dir} has no dist/ checkpoint (not "
                      "written by megatron-gspo, or by a version before dist checkpoints)")


def saved_model(model_cfg: dict) -> str:
    """A checkpoint's model in words, from its saved `model` config section."""
    if model_cfg.get("hf_path"):  # model.preset is ignored there
        return f"model.hf_path={model_cfg['hf_path']}"
    layers = model_cfg.get("num_layers")
    return f"preset {model_cfg.get('preset')!r}" + (f" at {layers} layers" if layers else "")


def built_model(policy: MoEPolicy) -> str:
    """The model `policy` is, in words."""
    return f"{policy.preset.name!r} ({policy.preset.num_layers} layers)"


