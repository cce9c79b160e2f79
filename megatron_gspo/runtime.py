"""What SFT, RL training and eval share: process groups, task, policy, checkpoints.

Checkpoints (`megatron_gspo.checkpoint` layout, `latest` marker): in each step dir, `dist/` is the
policy (model, optimizer, lr schedule) written by `moe.dist_ckpt` through megatron-core's
dist_checkpointing, each rank writing only its own shards; `rank_XXXXX.pt` holds each rank's
counters, RNG state and config. A checkpoint resumes (`resume`) or initialises (`init_checkpoint`)
a run with any TP / EP / DP layout; RNG states are restored only for the same layout. Checkpoints
of older versions (`full_params` in rank 0's file) still initialise runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_gspo import checkpoint as ckpt
from megatron_gspo.config import RunConfig, config_to_dict, save_config
from megatron_gspo.metrics import MetricsLogger
from megatron_gspo.rollout import evaluate
from megatron_gspo.tasks import make_splits, make_task
from megatron_gspo.tokenizer import CharTokenizer, Tokenizer
from moe import dist_ckpt
from moe.model import ParallelLayout, Recompute
from moe.parallel import ParallelInfo, init_parallel
from moe.optim import OptimSettings
from moe.policy import MoEPolicy
from moe.presets import get_preset
from moe.sharding import load_full_params

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Runtime:
    cfg: RunConfig
    info: ParallelInfo
    tokenizer: Tokenizer
    task: object
    train_set: list
    eval_set: list
    policy: MoEPolicy
    logger: MetricsLogger


def layout_of(cfg: RunConfig) -> ParallelLayout:
    # ModelConfig already refuses tp > 1 without sequence parallel (megatron-core's MoE rule).
    return ParallelLayout(tp=cfg.model.tp, ep=cfg.model.ep,
                          sequence_parallel=cfg.model.sequence_parallel,
                          dispatcher=cfg.model.dispatcher)


def recompute_of(cfg: RunConfig) -> Recompute:
    modules = tuple(m.strip() for m in cfg.model.recompute_modules.split(","))
    granularity = cfg.model.recompute_granularity
    return Recompute(None if granularity == "off" else granularity, modules)


def optim_settings(cfg: RunConfig, job: str) -> OptimSettings | None:
    """The optimizer of a job: `optim` as configured for RL ("train"; lr_decay_steps 0 = its
    last update); for "sft" the same Adam at a constant `sft.lr`; none for "eval"."""
    if job not in ("train", "sft", "eval"):
        raise ValueError(f"job={job!r}: expected 'train', 'sft' or 'eval'")
    if job == "eval":
        return None
    if job == "sft":
        return replace(cfg.optim, lr=cfg.sft.lr, min_lr=0.0, warmup_steps=0,
                       lr_decay_style="constant", lr_decay_steps=0)
    total = cfg.train.steps * cfg.train.num_minibatches
    return replace(cfg.optim, lr_decay_steps=cfg.optim.lr_decay_steps or total)


def build_policy(cfg: RunConfig, vocab_size: int, optim: OptimSettings | None,
                 seed: int | None = None) -> MoEPolicy:
    """The policy for `cfg.model`; `optim=None` builds it without an optimizer."""
    tp = cfg.model.tp
    preset = get_preset(cfg.model.preset)
    preset = preset.with_vocab(vocab_size, multiple=16 * tp)  # the task's tokenizer, padded
    return MoEPolicy.build(preset, layout_of(cfg), real_vocab=vocab_size,
                           seed=cfg.seed if seed is None else seed,
                           dtype=_DTYPES[cfg.model.dtype], aux_loss_coeff=cfg.model.aux_loss_coeff,
                           optim=optim, recompute=recompute_of(cfg))


def setup_runtime(cfg: RunConfig, job: str) -> Runtime:
    """Process groups, task splits, policy (+ init weights), metrics logger, saved config."""
    info = init_parallel(cfg.model.tp, cfg.model.ep, seed=cfg.seed)
    tokenizer = CharTokenizer()
    task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
    train_set, eval_set = make_splits(task, cfg.task.n_train, cfg.task.n_eval, cfg.task.seed)
    policy = build_policy(cfg, tokenizer.vocab_size, optim_settings(cfg, job))
    if cfg.init_checkpoint:
        load_init_weights(policy, cfg.init_checkpoint)
    if info.is_main:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, f"{job}_config.yaml"))
    logger = MetricsLogger(cfg.run_dir, config_to_dict(cfg), wandb_mode=cfg.wandb.mode,
                           project=cfg.wandb.project, name=cfg.wandb.name, enabled=info.is_main)
    return Runtime(cfg, info, tokenizer, task, train_set, eval_set, policy, logger)


def evaluate_runtime(rt: Runtime) -> dict[str, float]:
    """Greedy held-out accuracy of `rt.policy` on `rt.eval_set`, sampled as the config says."""
    return evaluate(rt.policy, rt.tokenizer, rt.task, rt.eval_set,
                    max_new_tokens=rt.cfg.rollout.max_new_tokens, kv_cache=rt.cfg.rollout.kv_cache)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_state(rt: Runtime, step: int, extra: dict) -> None:
    """Every rank writes its policy shards (`dist/`) and its own small state; `latest` moves
    last."""
    root = os.path.join(rt.cfg.run_dir, "checkpoints")
    dist_ckpt.save(rt.policy, os.path.join(ckpt.step_dir(root, step), "dist"))  # collective
    state = {"extra": extra, "rng": ckpt.rng_state(),
             "layout": (rt.info.tp, rt.info.ep, rt.info.world_size),
             "config": config_to_dict(rt.cfg)}
    ckpt.save_checkpoint(root, step, state, rank=rt.info.rank)
    barrier()
    if rt.info.is_main:
        ckpt.mark_latest(root, step)
    barrier()


def _step_dir_of(path: str) -> str:
    """The step dir a run dir (its latest), a checkpoints root or a step dir points to."""
    root = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) \
        else path
    if os.path.basename(os.path.normpath(root)).startswith("step_"):
        return root
    step = ckpt.latest_step(root)
    if step is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint (no 'latest' marker)")
    return ckpt.step_dir(root, step)


def load_init_weights(policy: MoEPolicy, path: str) -> None:
    """Initialise from a run dir (its latest checkpoint) or a step dir, any parallel layout."""
    step_dir = _step_dir_of(path)
    if dist_ckpt.is_dist_checkpoint(os.path.join(step_dir, "dist")):
        dist_ckpt.load(policy, os.path.join(step_dir, "dist"), optimizer=False)  # collective
        return
    state = ckpt.load_checkpoint(step_dir, rank=0)
    if "full_params" not in state:
        raise ValueError(f"{path}: checkpoint has neither dist/ nor full_params (not written by "
                         "megatron-gspo?)")
    load_full_params(policy.model.module, state["full_params"])
    policy.weights_changed()


def try_resume(rt: Runtime) -> dict | None:
    """Restore the policy (any layout) and counters from run_dir's latest checkpoint; returns
    its `extra`. RNG states come back only when the layout is the same."""
    root = os.path.join(rt.cfg.run_dir, "checkpoints")
    if not rt.cfg.resume or ckpt.latest_step(root) is None:
        return None
    step_dir = ckpt.step_dir(root, ckpt.latest_step(root))
    layout = (rt.info.tp, rt.info.ep, rt.info.world_size)
    same_rank = os.path.isfile(ckpt.rank_file(step_dir, rt.info.rank))
    state = ckpt.load_checkpoint(step_dir, rank=rt.info.rank if same_rank else 0)
    if not dist_ckpt.is_dist_checkpoint(os.path.join(step_dir, "dist")):
        raise ValueError(f"{step_dir}: written before dist checkpoints (no dist/), its optimizer "
                         f"state cannot be resumed; start from its weights with "
                         f"init_checkpoint={rt.cfg.run_dir} and resume=false")
    dist_ckpt.load(rt.policy, os.path.join(step_dir, "dist"))  # collective
    if tuple(state["layout"]) == layout:
        ckpt.set_rng_state(state["rng"])
    return state["extra"]


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average scalar metrics over all ranks (identical keys everywhere)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1) or not metrics:
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    if torch.cuda.is_available():
        values = values.cuda()
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(keys, values.cpu().tolist()))
