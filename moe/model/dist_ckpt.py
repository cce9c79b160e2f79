"""Rank-local, reshardable policy checkpoints through megatron-core's `dist_checkpointing`.

Each rank writes only its own shards: megatron's `sharded_state_dict()` describes every local
tensor as a slice of a global tensor (TP partition, EP expert offset, a replica id so that only
one DP replica writes it), and the torch_dist backend (torch.distributed.checkpoint; runs on CPU
with gloo) writes one file per rank and writer thread, plus rank 0's `common.pt` (non-tensor
state) and metadata. Nothing is gathered on the save path. Loading builds the sharded state dict
of the *current* layout and reads the slices it needs, so a checkpoint saved with one TP / EP /
DP layout resumes with another (tests/moe/model/test_training_state.py: TP=2 -> EP=2, TP=2 -> 1
process; tests/moe/model/test_dist_ckpt.py: the 1-process behaviour).

What is saved: the model weights (16-bit for bf16 runs), the optimizer (fp32 masters, Adam
moments and step) and the lr schedule. Optimizer resharding: megatron's non-distributed
optimizers store state shaped like the parameters, so it reshards over TP / EP / DP like them;
the distributed optimizer uses megatron's 'dp_reshardable' format (fully parallel, no gather),
which lets the DP size change but not TP / EP (megatron's TP/EP-reshardable format for it,
'fully_reshardable', gathers the state on DP rank 0: what this module avoids). Changing TP / EP
under the distributed optimizer: load the weights only (`load(..., optimizer=False)`).

`full_params` reads a checkpoint into a 1-process model and returns the full parameter dict (what
Hugging Face export needs), whatever layout wrote it.

Expert weights: `moe.model.experts.StackedExperts` saves each MoE layer's expert weights under the keys
and global shapes megatron's per-expert `SequentialMLP` used ([layers, E, out, in]), so
checkpoints written before the stacked layout load as they are: weights, and the optimizer state
of the non-distributed optimizers (shaped like the parameters). The distributed optimizer's
state follows the parameters' order in its buckets, which the layout changed: `load` refuses
it (`layout_error`) for a checkpoint whose `EXPERTS_KEY` (in its common state; none: written
before) names the other layout, and its weights load with `optimizer=False`.

Atomic: the checkpoint is written into `<directory>.tmp` and renamed to `<directory>` only after
every rank has finished (barriers around it), so a crash leaves no half-written `<directory>`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import shutil

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from moe.platform.children import spawned_manager
from moe.platform.compat import apply_cpu_training_patches
from moe.model.experts import StackedExperts
from moe.platform.parallel import init_parallel
from moe.model.policy import MoEPolicy
from moe.model.settings import ParallelLayout
from moe.model.sharding import gather_full_params

METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""megatron's `metadata` for the optimizers' sharded_state_dict (used by the distributed one)."""
EXPERTS_KEY = "moe_experts"
"""Saved in the common state: how the expert weights are laid out (`expert_layout`); a
checkpoint without it was written with one parameter per expert."""


def is_dist_checkpoint(directory: str) -> bool:
    """True when `directory` holds a complete dist_checkpointing checkpoint."""
    return os.path.isfile(os.path.join(directory, "metadata.json"))


_SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch_dist: __<rank>_<writer>.distcp


def files_written_by(directory: str, rank: int) -> list[str]:
    """The files of checkpoint `directory` that `rank` wrote: its `.distcp` shards; rank 0 also
    the common state and metadata (for per-file checksums; other files, e.g. checksum sidecars,
    are skipped)."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        m = _SHARD_FILE.match(name)
        if (m and int(m.group(1)) == rank) or (rank == 0 and not m and (
                name in ("common.pt", ".metadata", "metadata.json"))):
            out.append(os.path.join(directory, name))
    return out


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sharded_state_dict(policy, optimizer: bool, is_loading: bool) -> dict:
    model_sd = policy.model.module.sharded_state_dict()
    state = {"model": model_sd} if is_loading else {"model": model_sd,
                                                     EXPERTS_KEY: expert_layout(policy)}
    if optimizer and policy.optimizer is not None:
        opt = policy.optimizer
        if is_loading and opt.settings.distributed:
            # On the torch-Adam path megatron's DistributedOptimizer.state_dict() needs Adam's
            # state to exist; before the first update it does not. megatron's own remedy: one
            # zero-grad step (its values are overwritten by the load).
            for sub in opt.optimizer.chained_optimizers:
                if not sub.optimizer.state:
                    sub._init_optimizer_states_with_dummy_values()
        state["optimizer"] = opt.optimizer.sharded_state_dict(model_sd, is_loading,
                                                              metadata=METADATA)
        state["scheduler"] = opt.scheduler.state_dict()
    return state


_MANAGER: list = []
"""The Manager serving the writer's results queue (`_live_results_queue`), kept referenced."""


def _live_results_queue() -> None:
    """Give megatron's torch_dist writer a results queue whose Manager dies with this process.

    megatron starts that Manager (a spawned process) at the first save and keeps it: a trainer
    SIGKILLed left it running, and with it the resource tracker (`moe.platform.children`). Here it is
    started by `moe.platform.children.spawned_manager` instead. A SIGTERM to the process group (torchrun
    forwards it so, as do `kill -- -PGID` and schedulers) ends the Manager too, and the save the
    signal asks for then failed with 'Broken pipe': a queue whose Manager is gone is replaced."""
    if not hasattr(filesystem_async, "_results_queue"):  # a megatron without it
        return
    queue = filesystem_async._results_queue
    if queue is not None:
        try:
            queue.qsize()  # one round trip to the Manager
            return
        except (OSError, EOFError):
            pass
    manager = spawned_manager(mp.get_context("spawn"))
    _MANAGER[:] = [manager]
    filesystem_async._results_queue = manager.Queue()


def save(policy, directory: str) -> None:
    """Write this rank's shards of `policy` (model, optimizer, schedule) to `directory`.

    Collective: every rank of the job calls it with the same `directory`.
    """
    apply_cpu_training_patches()
    tmp = directory.rstrip("/") + ".tmp"
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        os.makedirs(tmp)
    _barrier()
    _live_results_queue()
    dist_checkpointing.save(_sharded_state_dict(policy, True, False), tmp)
    _barrier()
    if main:
        old = directory.rstrip("/") + ".old"
        if os.path.exists(directory):
            # a save killed between publishing and cleaning up left an `.old` (not needed: the
            # directory holds a complete checkpoint); a rename onto it would fail
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def mismatch_line(error: BaseException) -> str | None:
    """The last shape / key mismatch line of a failed `load` / `full_params` (the checkpoint is
    another model's), or None when the failure is something else (out of memory, I/O)."""
    lines = [ln.strip() for ln in str(error).splitlines() if "mismatch" in ln]
    return lines[-1] if lines else None


def load(policy, directory: str, optimizer: bool = True) -> None:
    """Load `directory` into `policy`, whatever layout saved it (see the module docstring).

    `optimizer=False` loads the weights only (and refreshes 16-bit runs' fp32 masters from
    them). Collective.
    """
    apply_cpu_training_patches()
    if not is_dist_checkpoint(directory):
        held = sorted(os.listdir(directory)) if os.path.isdir(directory) else "nothing"
        raise FileNotFoundError(f"{directory}: not a complete dist checkpoint (no "
                                f"metadata.json); it holds {held}")
    with_optimizer = optimizer and policy.optimizer is not None
    if with_optimizer and (why := layout_error(policy, directory)):
        raise ValueError(f"{why}; load its weights only (optimizer=False)")
    state = dist_checkpointing.load(_sharded_state_dict(policy, with_optimizer, True), directory)
    policy.model.module.load_state_dict(state["model"])
    if with_optimizer:
        policy.optimizer.load_state_dict({"optimizer": state["optimizer"],
                                          "scheduler": state["scheduler"]})
    else:
        policy.weights_changed()


def expert_layout(policy) -> str:
    """"stacked" (`moe.model.experts.StackedExperts`: one parameter per weight and MoE layer) or
    "per-expert" (megatron's `SequentialMLP`: one per expert)."""
    stacked = any(isinstance(m, StackedExperts) for m in policy.model.module.modules())
    return "stacked" if stacked else "per-expert"


def layout_error(policy, directory: str) -> str | None:
    """Why `policy`'s optimizer cannot load checkpoint `directory`'s state (None if it can): a
    distributed optimizer's state written with the other expert layout."""
    if not (policy.optimizer is not None and policy.optimizer.settings.distributed):
        return None
    saved = dist_checkpointing.load_common_state_dict(directory).get(EXPERTS_KEY, "per-expert")
    if saved == expert_layout(policy):
        return None
    return (f"{directory} was written with {saved} expert weights"
            f"{' (before the stacked ones)' if saved == 'per-expert' else ''}, this model "
            f"holds {expert_layout(policy)} ones: its optim.distributed=true state is laid "
            "out by the parameters")


def embedding_rows(directory: str) -> int:
    """The (padded) vocabulary rows of the checkpoint's embedding, from its metadata."""
    meta = dist_checkpointing.load_tensors_metadata(directory)
    return meta["embedding.word_embeddings.weight"].global_shape[0]


def full_params(directory: str, preset) -> dict:
    """The full parameter dict (1-process names, `moe.model.sharding`) of checkpoint `directory`:
    its weights loaded into a 1-process model of `preset` (vocab = the checkpoint's rows).
    Runs in one process (`moe.platform.parallel.init_parallel(1, 1)` if no group exists)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(f"reading {directory} into full parameters runs in one process, "
                           f"not {dist.get_world_size()}")
    init_parallel(1, 1)
    rows = embedding_rows(directory)
    preset = dataclasses.replace(preset, vocab_size=rows)
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=rows, optim=None)
    load(policy, directory, optimizer=False)
    return gather_full_params(policy.model.module)
