"""What SFT, RL training and eval share: process groups, task, policy, checkpoints.

Checkpoints (`megatron_gspo.run.checkpoint` layout, `latest` marker): in each step dir, `dist/` is the
policy (model, optimizer, lr schedule) written by `moe.dist_ckpt` through megatron-core's
dist_checkpointing, each rank writing only its own shards (checksummed like the rank files);
`rank_XXXXX.pt` holds each rank's counters, RNG state and config. A checkpoint resumes (`resume`)
or initialises (`init_checkpoint`) a run with any TP / EP / DP layout; RNG states are restored
only for the same layout. Older checkpoints (the policy in the rank files, rank 0's
`full_params`) still resume with the same layout and initialise any layout.

A run dir belongs to one run (`megatron_gspo.run.rundir`): `setup_runtime` locks it and refuses a
different job or config, and data files / tokenizer / chat template whose contents changed since
the run started (`megatron_gspo.run.inputs`), before anything is written; `eval` only reads.
Resume verifies every shard and falls back, with a warning, past a corrupt latest step to the
newest good one; rows of metrics.jsonl logged after the resumed step are dropped, so no step is
logged twice.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.dist import all_ranks
from megatron_gspo.config.schema import RunConfig, config_to_dict, save_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.tasks.datasets import build_task, check_sft_lengths, tokenizer_folder
from megatron_gspo.run.host import tune_malloc
from megatron_gspo.run.inputs import input_fingerprints
from megatron_gspo.run.rundir import (RunDirLock, check_inputs, claim_run_dir, record_run,
                                      recorded_value)
from megatron_gspo.run.metrics import MetricsLogger
from megatron_gspo.run.names import check_names
from megatron_gspo.rollout.backends import build_sampler
from megatron_gspo.rollout.generate import evaluate
from megatron_gspo.rollout.sampler import Sampler
from megatron_gspo.tasks.tokenizer import Tokenizer, load_tokenizer
from moe import dist_ckpt
from moe.model import ParallelLayout, Recompute
from moe.optim import OptimSettings
from moe.parallel import ParallelInfo, init_parallel
from moe.policy import MoEPolicy
from moe.presets import MoEPreset, get_preset
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
    lock: RunDirLock | None = None
    """Rank 0's hold on run_dir (None on other ranks and for eval)."""
    first_start: bool = False
    """This start wrote run_dir's record (rank 0; False on other ranks and when resuming)."""
    init_dir: str | None = None
    """The step dir of init_checkpoint the run started from (None without one, or on a resume
    that needs no KL reference: its weights are the run's own checkpoint's)."""
    sampler: Sampler | None = None
    """The run's sampler over `policy` (`rollout.backend`): rollouts and the greedy eval."""

    def close(self) -> None:
        """Close the metrics log and release run_dir."""
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def layout_of(cfg: RunConfig) -> ParallelLayout:
    # ModelConfig already refuses tp > 1 without sequence parallel (megatron-core's MoE rule).
    return ParallelLayout(tp=cfg.model.tp, ep=cfg.model.ep,
                          sequence_parallel=cfg.model.sequence_parallel,
                          dispatcher=cfg.model.dispatcher)


def resolve_preset(cfg: RunConfig, vocab_size: int) -> MoEPreset:
    """model.hf_path's config.json (vocab padded to vocab_multiple * tp), else model.preset with
    the tokenizer's vocab padded to 16 * tp (the toy path, unchanged), model.num_layers deep if
    set; model.max_seq_len if set."""
    tp = cfg.model.tp
    if cfg.model.hf_path:
        from moe.hf.config import preset_from_hf

        preset = preset_from_hf(cfg.model.hf_path)
        preset = preset.with_vocab(max(preset.vocab_size, vocab_size),
                                   multiple=cfg.model.vocab_multiple * tp)
    else:
        preset = get_preset(cfg.model.preset).with_vocab(vocab_size, multiple=16 * tp)
        if cfg.model.num_layers:
            preset = dataclasses.replace(preset, num_layers=cfg.model.num_layers)
    if cfg.model.max_seq_len:
        preset = dataclasses.replace(preset, max_seq_len=cfg.model.max_seq_len)
    return preset


def model_max_len(cfg: RunConfig) -> int:
    """model.max_seq_len, else the preset's (config.json's with model.hf_path)."""
    if cfg.model.max_seq_len:
        return cfg.model.max_seq_len
    if cfg.model.hf_path:
        from moe.hf.config import preset_from_hf

        return preset_from_hf(cfg.model.hf_path).max_seq_len
    return get_preset(cfg.model.preset).max_seq_len


def recompute_of(cfg: RunConfig) -> Recompute:
    modules = tuple(m.strip() for m in cfg.model.recompute_modules.split(","))
    granularity = cfg.model.recompute_granularity
    return Recompute(None if granularity == "off" else granularity, modules)


def optim_settings(cfg: RunConfig, job: str) -> OptimSettings | None:
    """The optimizer of a job: `optim` as configured for RL ("train"; lr_decay_steps 0 = its
    last update; ConfigError when a linear / cosine decay would end within the warmup); for
    "sft" the same Adam at `sft.lr`, constant or decaying to `sft.min_lr` at step `sft.steps`
    (`sft.lr_decay_style`); none for "eval"."""
    if job not in ("train", "sft", "eval"):
        raise ValueError(f"job={job!r}: expected 'train', 'sft' or 'eval'")
    if job == "eval":
        return None
    if job == "sft":
        decay = cfg.sft.lr_decay_style
        return replace(cfg.optim, lr=cfg.sft.lr, min_lr=cfg.sft.min_lr, warmup_steps=0,
                       lr_decay_style=decay, lr_decay_steps=0 if decay == "constant"
                       else cfg.sft.steps)
    total = cfg.train.steps * cfg.train.num_minibatches
    settings = replace(cfg.optim, lr_decay_steps=cfg.optim.lr_decay_steps or total)
    if settings.lr_decay_style != "constant" and settings.lr_decay_steps <= settings.warmup_steps:
        end = (f"optim.lr_decay_steps={cfg.optim.lr_decay_steps}" if cfg.optim.lr_decay_steps
               else f"train.steps x train.num_minibatches = {total}")
        raise ConfigError(f"optim.warmup_steps={settings.warmup_steps}: the lr decay "
                          f"(optim.lr_decay_style={settings.lr_decay_style}) ends at {end}; it "
                          "must end after the warmup")
    return settings


def build_policy(cfg: RunConfig, vocab_size: int, optim: OptimSettings | None,
                 seed: int | None = None) -> MoEPolicy:
    """The policy for tokenizer vocab `vocab_size` (`optim=None`: no optimizer); model.hf_path's
    weights when set."""
    preset = resolve_preset(cfg, vocab_size)
    policy = MoEPolicy.build(preset, layout_of(cfg), real_vocab=vocab_size,
                             seed=cfg.seed if seed is None else seed,
                             dtype=_DTYPES[cfg.model.dtype],
                             aux_loss_coeff=cfg.model.aux_loss_coeff,
                             optim=optim, recompute=recompute_of(cfg),
                             sdpa_attention=cfg.model.attention == "sdpa",
                             inference_graphs=cfg.rollout.engine_graphs)
    if cfg.model.hf_path:
        from moe.hf.weights import load_hf_weights

        try:
            load_hf_weights(policy.model.module, cfg.model.hf_path)  # this rank's shard only
        except (KeyError, ValueError) as e:  # weights that disagree with their config.json
            raise ConfigError(f"model.hf_path={cfg.model.hf_path}: {e.args[0]}") from None
        policy.weights_changed()
    return policy


def setup_runtime(cfg: RunConfig, job: str) -> Runtime:
    """Process groups, run-dir claim, task splits, policy (+ init weights), metrics logger,
    recorded config. `job` is "sft", "train" or "eval" (eval writes nothing). Tunes the host
    allocator first (`megatron_gspo.run.host`)."""
    tune_malloc()
    optim = optim_settings(cfg, job)  # a bad lr schedule fails before the run dir is claimed
    check_names(cfg)  # unknown task / loss / reward / sampler (or one not runnable here): first
    try:
        info = init_parallel(cfg.model.tp, cfg.model.ep, seed=cfg.seed,
                             timeout_min=cfg.model.dist_timeout_min,
                             cudagraph_rng=cfg.rollout.engine_graphs)
    except ValueError as e:  # e.g. model.ep=8 without torchrun --nproc-per-node 8
        raise ConfigError(f"model.tp={cfg.model.tp} model.ep={cfg.model.ep}: {e} (start N "
                          "processes: torchrun --nproc-per-node N -m megatron_gspo.cli ...)"
                          ) from None
    resuming = _resumes(cfg, job)  # the weights are then the run's own checkpoint's
    reference = job == "train" and cfg.loss.kl_coef > 0  # init_checkpoint is the KL reference
    if cfg.init_checkpoint and (not resuming or reference):
        check_init_checkpoint(cfg.init_checkpoint)  # fail before the run dir is claimed
    if cfg.model.hf_path:
        check_hf_path(cfg.model.hf_path, cfg.model.tp, cfg.model.ep)
    writes = job != "eval"
    lock = claim_run_dir(cfg.run_dir, job, config_to_dict(cfg), cfg.resume, info.is_main) \
        if writes else None
    try:
        tokenizer = run_tokenizer(cfg)
        task, train_set, eval_set = build_task(cfg, tokenizer, model_max_len(cfg), info.is_main)
        inputs = input_fingerprints(cfg, tokenizer, train_set, eval_set) \
            if writes and info.is_main else {}
        if writes:  # data files, tokenizer, template: as the run started (resume=force: warned)
            check_inputs(cfg.run_dir, inputs, cfg.resume, info.is_main)
        if job == "sft":  # before the run is recorded: a fixed config may reuse the run dir
            cut = check_sft_lengths(tokenizer, train_set, model_max_len(cfg),
                                    cfg.rollout.max_new_tokens)
            if cut and info.is_main:
                print(f"WARNING: {cut} of {len(train_set)} SFT targets are longer than "
                      f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: eval and rollouts "
                      "cut such answers", flush=True)
        policy = build_policy(cfg, tokenizer.vocab_size, optim)
        init_dir = None
        if cfg.init_checkpoint and not resuming:
            init_dir = load_init_weights(policy, cfg.init_checkpoint)
        elif cfg.init_checkpoint and reference:
            init_dir = reference_dir(cfg, info.is_main)
        sampler = build_sampler(cfg, policy, tokenizer)
        first = writes and info.is_main and record_run(
            cfg.run_dir, job, config_to_dict(cfg), lambda p: save_config(cfg, p),
            {"inputs": inputs, "init_step": init_dir and ckpt.step_of(init_dir)})
        logger = MetricsLogger(cfg.run_dir, config_to_dict(cfg), wandb_mode=cfg.wandb.mode,
                               project=cfg.wandb.project, name=cfg.wandb.name,
                               enabled=writes and info.is_main)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Runtime(cfg, info, tokenizer, task, train_set, eval_set, policy, logger, lock,
                   first_start=bool(first), init_dir=init_dir,
                   sampler=sampler)


def _resumes(cfg: RunConfig, job: str) -> bool:
    """Whether this start resumes run_dir's checkpoint (complete steps there, resume on)."""
    if job == "eval" or cfg.resume is False:
        return False
    try:
        return ckpt.newest_step(os.path.join(cfg.run_dir, "checkpoints")) is not None
    except ValueError:  # a garbled `latest`: try_resume says so in one line
        return True


def evaluate_runtime(rt: Runtime) -> dict[str, float]:
    """Greedy held-out accuracy of `rt.policy` on `rt.eval_set`, sampled as the config says."""
    return evaluate(rt.sampler, rt.tokenizer, rt.task, rt.eval_set,
                    max_new_tokens=rt.cfg.rollout.max_new_tokens)


def barrier() -> None:
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


def run_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The run's tokenizer (`tokenizer_folder`); one that cannot serve (no eos_token, a file
    transformers refuses), or a data.tokenizer_path that gives model.hf_path's own tokens other
    ids, is a ConfigError naming it."""
    try:
        tokenizer = load_tokenizer(tokenizer_folder(cfg))
        if cfg.data.tokenizer_path and cfg.model.hf_path:
            _check_same_ids(tokenizer, cfg.data.tokenizer_path, cfg.model.hf_path)
        return tokenizer
    except ValueError as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from None


def _check_same_ids(tokenizer, path: str, hf_path: str) -> None:
    """data.tokenizer_path may add tokens or change the chat template of the model folder's
    tokenizer, not renumber it (the embedding rows are the model's)."""
    try:
        own = load_tokenizer(hf_path)
    except FileNotFoundError:  # the model folder has none: data.tokenizer_path is its tokenizer
        return
    ids = tokenizer.hf.get_vocab()
    moved = sorted((i, t) for t, i in own.hf.get_vocab().items() if ids.get(t) != i)
    if moved:
        i, t = moved[0]
        raise ConfigError(f"data.tokenizer_path={path} is not model.hf_path's tokenizer "
                          f"({len(moved)} of its {own.vocab_size} tokens differ, e.g. {t!r}: id "
                          f"{i} there, {ids.get(t)} here); drop data.tokenizer_path")


def check_hf_path(path: str, tp: int = 1, ep: int = 1) -> None:
    """model.hf_path is a local folder with a supported config.json whose model splits tp x ep
    ways (the vocabulary is padded to split): FileNotFoundError (a hub name says so) or
    ConfigError naming the value."""
    from moe.hf.config import preset_from_hf

    try:
        preset = preset_from_hf(path)
        preset.with_vocab(preset.vocab_size, multiple=tp).check_parallel(tp, ep)
    except ValueError as e:
        raise ConfigError(f"model.hf_path={path}: {e}") from None


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
            raise ConfigError(f"init_checkpoint={path} holds {_saved_model(saved)}, this run "
                              f"builds {_this_model(policy)}: {line}") from None
        return
    state = ckpt.load_checkpoint(step_dir, rank=0)
    if "full_params" not in state:
        raise ConfigError(f"init_checkpoint={path}: checkpoint has no full_params (not written "
                          "by megatron-gspo?)")
    try:
        load_full_params(policy.model.module, state["full_params"])
    except (KeyError, ValueError) as e:
        saved = state.get("config", {}).get("model", {})
        raise ConfigError(f"init_checkpoint={path} holds {_saved_model(saved)}, this run builds "
                          f"{_this_model(policy)}: {str(e).strip(chr(34) + chr(39))}") from None
    policy.weights_changed()


def _saved_model(model_cfg: dict) -> str:
    """A checkpoint's model in words, from its saved `model` config section."""
    if model_cfg.get("hf_path"):  # model.preset is ignored there
        return f"model.hf_path={model_cfg['hf_path']}"
    layers = model_cfg.get("num_layers")
    return f"preset {model_cfg.get('preset')!r}" + (f" at {layers} layers" if layers else "")


def _this_model(policy: MoEPolicy) -> str:
    return f"{policy.preset.name!r} ({policy.preset.num_layers} layers)"


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
    layout = (rt.info.tp, rt.info.ep, rt.info.world_size)
    for step in candidates:
        state, error = None, ""
        dist_dir = os.path.join(ckpt.step_dir(root, step), "dist")
        own = os.path.isfile(ckpt.rank_file(ckpt.step_dir(root, step), rt.info.rank))
        try:
            state = ckpt.load_checkpoint(root, rank=rt.info.rank if own else 0, step=step)
            ckpt.verify_dir(dist_dir, rt.info.rank, rt.info.world_size)
        except (ckpt.CheckpointError, FileNotFoundError) as e:
            state, error = None, str(e)
        if not all_ranks(state is not None):
            if rt.info.is_main or error:
                print(f"WARNING: skipping checkpoint step {step}: "
                      f"{error or 'a shard on another rank is bad'}", flush=True)
            continue
        same_layout = tuple(state["layout"]) == layout
        check_optimizer_format(root, state, rt.cfg, layout)
        if dist_ckpt.is_dist_checkpoint(dist_dir):
            try:
                dist_ckpt.load(rt.policy, dist_dir)  # collective; any layout
            except (Exception, CheckpointException) as e:  # resume=force onto another model
                if (line := dist_ckpt.mismatch_line(e)) is None:  # out of memory, I/O, ...
                    raise
                raise ConfigError(f"{root} holds {_saved_model(state['config']['model'])}, "
                                  f"this run builds {_this_model(rt.policy)}: {line}") from None
        elif same_layout:  # written before dist checkpoints: the policy is in the rank files
            rt.policy.load_state_dict(state["policy"])
        else:
            raise ConfigError(f"{root}: saved with (tp, ep, world)={tuple(state['layout'])} "
                              f"before dist checkpoints, resuming with {layout}; use "
                              "init_checkpoint to change layout")
        if same_layout:
            ckpt.set_rng_state(state["rng"])
        rt.logger.drop_after(state["extra"].get("opt_step", state["extra"].get("step", step)))
        return state["extra"]
    raise ckpt.CheckpointError(f"no readable checkpoint in {root} (tried {candidates}); move "
                               "it away to start afresh")
