"""A run's own checkpoints: every rank writes its shards and its state (`save_state`), and a
restart takes up the newest good step (`try_resume`).

Layout (`megatron_gspo.run.checkpoint`, `latest` marker): in each step dir, `dist/` is the
policy (model, optimizer, lr schedule) written by `moe.model.dist_ckpt` through megatron-core's
dist_checkpointing, each rank writing only its own shards (checksummed like the rank files);
`rank_XXXXX.pt` holds each rank's job state (`extra`: the run loop's `JobState` and row,
`megatron_gspo.run.loop`), RNG state and config. A checkpoint resumes with any TP / EP / DP
layout; RNG states are restored only for the same layout.

Resume verifies every shard and falls back, with a warning, past a corrupt latest step to the
newest good one; rows of metrics.jsonl logged after the resumed step are dropped, so no step is
logged twice (rows it cannot read are kept aside in metrics.unreadable.txt, named by line). A full disk during a save is one line; the steps already written stay as they
were. Weights from another run (`init_checkpoint`) are `megatron_gspo.run.init`.
"""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_gspo.config.schema import RunConfig, config_to_dict
from megatron_gspo.errors import ConfigError
from megatron_gspo.dist import all_ranks
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run.init import built_model, saved_model
from megatron_gspo.run.setup import Runtime
from moe.model import dist_ckpt


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _os_reason(e: BaseException) -> str:
    """Why a dist save failed, in one line: the OS error ('No space left on device') where the
    message carries it, else the first rank's failure (megatron-core 0.19's async writer says
    only "... error: <class 'OSError'>"), else the message's first line."""
    failures = getattr(e, "failures", None) or {}
    texts = [str(f[0] if isinstance(f, tuple) else f) for f in failures.values()]
    reasons = re.findall(r"\[Errno \d+\] ([^\n']+)", "\n".join([str(e)] + texts))
    return reasons[-1] if reasons else (texts + [str(e)])[0].splitlines()[0]


def save_state(rt: Runtime, step: int, extra: dict) -> None:
    """Every rank writes its policy shards (`dist/`) and its own small state; `latest` moves
    last. Nothing is gathered."""
    root = os.path.join(rt.cfg.run_dir, "checkpoints")
    dist_dir = os.path.join(ckpt.step_dir(root, step), "dist")
    try:
        dist_ckpt.save(rt.policy, dist_dir)  # collective
    except (OSError, CheckpointException) as e:  # a full disk: every rank gets torch's error
        if rt.info.is_main:
            shutil.rmtree(dist_dir + ".tmp", ignore_errors=True)
        raise ckpt.CheckpointError(f"cannot write {dist_dir}: {_os_reason(e)}; files already "
                                   "written are unchanged") from None
    for path in dist_ckpt.files_written_by(dist_dir, rt.info.rank):
        ckpt.write_checksum(path)
    state = {"extra": extra, "rng": ckpt.rng_state(),
             "layout": (rt.info.tp, rt.info.ep, rt.info.world_size),
             "config": config_to_dict(rt.cfg)}
    ckpt.save_checkpoint(root, step, state, rank=rt.info.rank)
    barrier()
    if rt.info.is_main:
        ckpt.mark_latest(root, step)
        ckpt.prune_steps(root, rt.cfg.train.keep_checkpoints)
    barrier()


def check_optimizer_format(root: str, state: dict, cfg: RunConfig, layout: tuple) -> None:
    """ConfigError naming what makes the optimizer state saved in `state` (rank 0's file of a
    step under checkpoint root `root`) unloadable here: a (tp, ep) change under
    optim.distributed=true (megatron's dp_reshardable format), or, with resume=force, a change
    between fp32 and 16-bit weights (16-bit runs keep fp32 masters) or of optim.distributed
    (another state layout), which megatron's load reports as a KeyError."""
    saved = tuple(state["layout"])[:2]
    redo = f"start a new run_dir with init_checkpoint={cfg.run_dir} (weights only)"
    if cfg.optim.distributed and saved != layout[:2]:  # megatron's dp_reshardable
        raise ConfigError(f"{root}: saved with (tp, ep)={saved}, resuming with {layout[:2]}: "
                          "optim.distributed=true reshards its optimizer state over DP only; "
                          f"{redo}")
    old = state.get("config") or {}
    dtype = (old.get("model") or {}).get("dtype", cfg.model.dtype)
    distributed = (old.get("optim") or {}).get("distributed", cfg.optim.distributed)
    if (dtype == "fp32") != (cfg.model.dtype == "fp32"):
        raise ConfigError(f"{root}: saved with model.dtype={dtype}, resuming with "
                          f"model.dtype={cfg.model.dtype}: the optimizer state of fp32 weights "
                          f"and of 16-bit weights with fp32 masters differ; {redo}")
    if distributed != cfg.optim.distributed:
        raise ConfigError(f"{root}: saved with optim.distributed={str(distributed).lower()}, "
                          f"resuming with optim.distributed={str(cfg.optim.distributed).lower()}"
                          f": the optimizer state is laid out otherwise; {redo}")


def try_resume(rt: Runtime) -> dict | None:
    """Restore the policy (any layout) from run_dir's newest good checkpoint; returns its
    `extra` (None when there is none or resume is off). A corrupt or unreadable latest step
    is skipped with a warning, and so is a `latest` that is missing, empty or names a step dir
    that is gone (the newest complete step resumes); every rank resumes the same step. RNG
    states come back only with the layout they were saved with."""
    root = os.path.join(rt.cfg.run_dir, "checkpoints")
    try:
        candidates, problem = ckpt.resume_candidates(root), ckpt.latest_problem(root)
    except ValueError as e:  # a `latest` garbled by hand: which step to resume is the user's
        raise ckpt.CheckpointError(f"{e}; write the step to resume from into it") from None
    if rt.cfg.resume is False or not candidates:  # a start from step 0
        moved = rt.logger.set_aside()  # the rows of an earlier attempt that saved nothing
        if moved:
            print(f"{rt.cfg.run_dir} has no checkpoint to resume: starting from step 0; the "
                  f"metrics logged before are in {moved}", flush=True)
        return None
    if problem and rt.info.is_main:
        print(f"WARNING: {problem}: resuming from the newest complete step, {candidates[0]}",
              flush=True)
    for step in candidates:
        state = _verified_state(rt, root, step)
        if state is None:
            continue
        _load_policy(rt, root, step, state)
        rt.logger.drop_after(state["extra"].get("opt_step", state["extra"].get("step", step)))
        return state["extra"]
    raise ckpt.CheckpointError(f"no readable checkpoint in {root} (tried {candidates}); move "
                               "it away to start afresh")


def _verified_state(rt, root: str, step: int) -> dict | None:
    """This rank's state of checkpoint `step` (rank 0's when the step has no file of this
    rank: another world size), once every rank found its file and its share of the policy's
    shards intact (a step without dist/ is not); None, with a warning, when any rank did
    not."""
    state, error = None, ""
    dist_dir = os.path.join(ckpt.step_dir(root, step), "dist")
    own = os.path.isfile(ckpt.rank_file(ckpt.step_dir(root, step), rt.info.rank))
    try:
        state = ckpt.load_checkpoint(root, rank=rt.info.rank if own else 0, step=step)
        if not dist_ckpt.is_dist_checkpoint(dist_dir):
            raise ckpt.CheckpointError(f"{dist_dir} is not a dist checkpoint (removed, or the "
                                       "step was written before dist checkpoints, a format "
                                       "this version no longer reads)")
        ckpt.verify_dir(dist_dir, rt.info.rank, rt.info.world_size)
    except (ckpt.CheckpointError, FileNotFoundError) as e:
        state, error = None, str(e)
    if all_ranks(state is not None):
        return state
    if rt.info.is_main or error:
        print(f"WARNING: skipping checkpoint step {step}: "
              f"{error or 'a shard on another rank is bad'}", flush=True)
    return None


def _load_policy(rt, root: str, step: int, state: dict) -> None:
    """Load checkpoint `step`'s policy and optimizer into `rt.policy` (any layout), and the RNG
    states where the layout is the one they were saved with."""
    layout = (rt.info.tp, rt.info.ep, rt.info.world_size)
    dist_dir = os.path.join(ckpt.step_dir(root, step), "dist")
    same_layout = tuple(state["layout"]) == layout
    check_optimizer_format(root, state, rt.cfg, layout)
    if why := dist_ckpt.layout_error(rt.policy, dist_dir):  # every rank reads the same file
        raise ConfigError(f"{why}; start a new run_dir with init_checkpoint={rt.cfg.run_dir} "
                          "(weights only), or resume with the version that wrote it")
    try:
        dist_ckpt.load(rt.policy, dist_dir)  # collective; any layout
    except (Exception, CheckpointException) as e:  # resume=force onto another model
        if (line := dist_ckpt.mismatch_line(e)) is None:  # out of memory, I/O, ...
            raise
        raise ConfigError(f"{root} holds {saved_model(state['config']['model'])}, "
                          f"this run builds {built_model(rt.policy)}: {line}") from None
    if same_layout:
        ckpt.set_rng_state(state["rng"])
