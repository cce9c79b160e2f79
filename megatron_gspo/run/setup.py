"""What SFT, RL training and eval share: process groups, task, policy, sampler, metrics log.

`setup_runtime` builds a job's `Runtime` from the config and the job's `JobSpec` (what the job
needs: an optimizer or none, whether it writes the run dir, its KL reference, its own data
check; each job in `megatron_gspo.jobs` builds its own, so nothing here knows a job by name). A
run dir belongs to one run (`megatron_gspo.run.rundir`): it is locked, and a different job or
config is refused, as are data files / tokenizer / chat template whose contents changed since
the run started (`megatron_gspo.run.inputs`), all before anything is written; a job that only
reads (eval) claims nothing. The policy's
weights come from `init_checkpoint` (`megatron_gspo.run.init`) or, on a resume, from the run's
own checkpoint, which the run loop restores (`megatron_gspo.run.resume`, `megatron_gspo.run.loop`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

import torch

from megatron_gspo.config.schema import RunConfig, config_to_dict, save_config, value_at
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.backends import backend_of, build_sampler
from megatron_gspo.rollout.decoders import clean_decoder
from megatron_gspo.rollout.generate import evaluate, sampled_reward
from megatron_gspo.rollout.sampler import Sampler, SamplingParams
from megatron_gspo.run import checkpoint as ckpt
from megatron_gspo.run import seeds
from megatron_gspo.run.host import tune_malloc
from megatron_gspo.run.init import check_init_checkpoint, load_init_weights, reference_dir
from megatron_gspo.run.inputs import input_fingerprints
from megatron_gspo.run.metrics import MetricsLogger
from megatron_gspo.run.names import check_names
from megatron_gspo.run.progress import ChunkProgress
from megatron_gspo.run.lock import RunDirLock
from megatron_gspo.run.rundir import check_inputs, claim_run_dir, record_run
from megatron_gspo.tasks.datasets import build_task, tokenizer_folder
from megatron_gspo.tasks.tokenizer import Tokenizer, load_tokenizer
from moe.hf.config import preset_from_hf
from moe.hf.weights import load_hf_weights
from moe.platform.parallel import ParallelInfo, init_parallel
from moe.model.policy import MoEPolicy, packable
from moe.model.presets import MoEPreset, get_preset
from moe.model.settings import OptimSettings, ParallelLayout, Recompute

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _never(cfg: RunConfig) -> bool:
    return False


@dataclass(frozen=True)
class JobSpec:
    """What a job needs of the run set-up (each job module of `megatron_gspo.jobs` has its
    `SPEC`); the parts that depend on the config are functions of it."""

    name: str
    """The job's name in run_dir's record (run.json's `job`, `{name}_config.yaml`, the lock):
    another job's run dir is refused."""
    optim: Callable[[RunConfig], OptimSettings] | None = None
    """The policy's optimizer settings from the config, called before anything is claimed
    (it may refuse the config: a ConfigError); None: a policy without an optimizer."""
    writes: bool = True
    """Claims, records and logs into run_dir and resumes its checkpoint; False: reads only."""
    unused_sections: tuple[str, ...] = ()
    """Config sections the job does not read: they may differ when the run resumes."""
    kl_reference: Callable[[RunConfig], bool] = _never
    """Whether `init_checkpoint` is also the run's frozen KL reference (its step pinned on
    resumes)."""
    band_key: str = ""
    """The dotted config key of the job's accuracy band: when set, it chooses on the
    validation split, so set-up warns when the run has none (then it reads the test split)."""
    pack_key: str = ""
    """The dotted config key saying whether the job's policy packs its forwards
    (`MoEPolicy.pack`: train.pack, sft.pack); "" for padded forwards."""
    check_layout: Callable[[RunConfig, ParallelInfo], None] | None = None
    """The job's own check of the config against the process layout, once the process groups
    are up and before the run dir is claimed (a one-line ConfigError)."""
    check_data: Callable[[RunConfig, Tokenizer, list, bool], None] | None = None
    """The job's own look at (config, tokenizer, train set, is main rank) once the data is
    loaded and before the run is recorded (SFT: targets longer than the model or the
    rollouts)."""


@dataclass
class Runtime:
    cfg: RunConfig
    info: ParallelInfo
    tokenizer: Tokenizer
    task: object
    train_set: list
    val_set: list
    """Validation examples: what evals during training and the accuracy bands read (may be
    empty: then they read `test_set`, `eval_set`)."""
    test_set: list
    """Test examples: evaluated at a run's first and last step (`test/...`), choosing nothing."""
    policy: MoEPolicy
    logger: MetricsLogger
    lock: RunDirLock | None = None
    """Rank 0's hold on run_dir (None on other ranks and for a job that only reads)."""
    first_start: bool = False
    """This start wrote run_dir's record (rank 0; False on other ranks and when resuming)."""
    init_dir: str | None = None
    """The step dir of init_checkpoint the run started from (None without one, or on a resume
    that needs no KL reference: its weights are the run's own checkpoint's)."""
    sampler: Sampler | None = None
    """The run's sampler over `policy` (`rollout.backend`): rollouts and the greedy eval."""
    job: str = ""
    """The name of the job that claimed run_dir (`JobSpec.name`)."""

    @property
    def eval_set(self) -> list:
        """What evals during training read: the validation split, else (none configured) the
        test split, as before the validation split existed."""
        return self.val_set or self.test_set

    def close(self) -> None:
        """Close the metrics log and the sampler (an engine's memory), release run_dir."""
        self.logger.close()
        if self.sampler is not None and hasattr(self.sampler, "close"):
            self.sampler.close()
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
    the tokenizer's vocab padded to 16 * tp (the toy path, unchanged), with
    model.preset_overrides, model.num_layers deep if set; model.max_seq_len if set."""
    tp = cfg.model.tp
    if cfg.model.hf_path:
        preset = preset_from_hf(cfg.model.hf_path)
        preset = preset.with_vocab(max(preset.vocab_size, vocab_size),
                                   multiple=cfg.model.vocab_multiple * tp)
    else:
        preset = get_preset(cfg.model.preset).with_overrides(cfg.model.preset_overrides) \
            .with_vocab(vocab_size, multiple=16 * tp)
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
        return preset_from_hf(cfg.model.hf_path).max_seq_len
    return get_preset(cfg.model.preset).max_seq_len


def recompute_of(cfg: RunConfig) -> Recompute:
    modules = tuple(m.strip() for m in cfg.model.recompute_modules.split(","))
    granularity = cfg.model.recompute_granularity
    return Recompute(None if granularity == "off" else granularity, modules)


def build_policy(cfg: RunConfig, vocab_size: int, optim: OptimSettings | None,
                 seed: int | None = None, pack: bool = False) -> MoEPolicy:
    """The policy for tokenizer vocab `vocab_size` (`optim=None`: no optimizer; `pack`: packed
    forwards); model.hf_path's weights when set."""
    preset = resolve_preset(cfg, vocab_size)
    policy = MoEPolicy.build(preset, layout_of(cfg), real_vocab=vocab_size,
                             seed=cfg.seed if seed is None else seed,
                             dtype=_DTYPES[cfg.model.dtype],
                             aux_loss_coeff=cfg.model.aux_loss_coeff,
                             optim=optim, recompute=recompute_of(cfg),
                             sdpa_attention=cfg.model.attention == "sdpa", pack=pack,
                             inference_graphs=backend_of(cfg).cuda_graphs(cfg))
    if cfg.model.hf_path:
        try:
            load_hf_weights(policy.model.module, cfg.model.hf_path)  # this rank's shard only
        except (KeyError, ValueError) as e:  # weights that disagree with their config.json
            raise ConfigError(f"model.hf_path={cfg.model.hf_path}: {e.args[0]}") from None
        policy.weights_changed()
    return policy


def setup_runtime(cfg: RunConfig, spec: JobSpec) -> Runtime:
    """Process groups, run-dir claim, task splits, policy (+ init weights), sampler, metrics
    logger, recorded config, for the job `spec` describes (a job that only reads writes
    nothing). Every check that can refuse the config runs before the run dir is claimed or
    written."""
    optim = spec.optim(cfg) if spec.optim else None  # a bad lr schedule: before any claim
    info, resuming = _preflight(cfg, spec)
    lock = claim_run_dir(cfg.run_dir, spec.name, config_to_dict(cfg), cfg.resume, info.is_main,
                         spec.unused_sections) if spec.writes else None
    try:
        tokenizer, task, splits, inputs = _data(cfg, spec, info.is_main)
        policy = build_policy(cfg, tokenizer.vocab_size, optim, pack=packs(cfg, spec))
        init_dir = _init_weights(cfg, spec, policy, resuming, info.is_main)
        sampler = build_sampler(cfg, policy, tokenizer)
        logger = MetricsLogger(cfg.run_dir, config_to_dict(cfg), wandb_mode=cfg.wandb.mode,
                               project=cfg.wandb.project, name=cfg.wandb.name,
                               enabled=spec.writes and info.is_main)  # before the record:
        # a metrics.jsonl it cannot log to is refused with nothing written
        first = spec.writes and info.is_main and record_run(
            cfg.run_dir, spec.name, config_to_dict(cfg), lambda p: save_config(cfg, p),
            {"inputs": inputs, "init_step": init_dir and ckpt.step_of(init_dir)},
            spec.unused_sections)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Runtime(cfg, info, tokenizer, task, *splits, policy, logger, lock,
                   first_start=bool(first), init_dir=init_dir, sampler=sampler, job=spec.name)


def packs(cfg: RunConfig, spec: JobSpec) -> bool:
    """Whether the job's policy packs its forwards (`JobSpec.pack_key`); ConfigError when it
    would under megatron's attention, which has no packed path (the local layer spec)."""
    if not spec.pack_key or not value_at(cfg, spec.pack_key):
        return False
    if cfg.model.attention != "sdpa":  # megatron's own attention
        raise ConfigError(f"{spec.pack_key}=true packs sequences, which megatron's "
                          "DotProductAttention cannot (model.attention=megatron): set "
                          f"model.attention=sdpa or {spec.pack_key}=false")
    try:
        packable(layout_of(cfg))
    except ValueError as e:
        raise ConfigError(f"{spec.pack_key}=true with model.ep={cfg.model.ep} needs "
                          "model.dispatcher=alltoall (or auto), not allgather, which gathers "
                          "equal token counts from every expert-parallel rank: set it or "
                          f"{spec.pack_key}=false") from e
    return True


def _preflight(cfg: RunConfig, spec: JobSpec) -> tuple[ParallelInfo, bool]:
    """What needs no run dir: the host allocator (`megatron_gspo.run.host`), the sampler
    backend, the process groups, `init_checkpoint` and `model.hf_path`; returns (parallel info,
    whether this start resumes run_dir)."""
    tune_malloc()
    check_names(cfg)  # unknown task / loss / reward / sampler (or one not runnable here): first
    packs(cfg, spec)
    try:
        info = init_parallel(cfg.model.tp, cfg.model.ep, seed=cfg.seed,
                             timeout_min=cfg.model.dist_timeout_min,
                             cudagraph_rng=backend_of(cfg).cuda_graphs(cfg))
    except ValueError as e:  # e.g. model.ep=8 without torchrun --nproc-per-node 8
        raise ConfigError(f"model.tp={cfg.model.tp} model.ep={cfg.model.ep}: {e} (start N "
                          "processes: torchrun --nproc-per-node N -m megatron_gspo.cli ...)"
                          ) from None
    if spec.check_layout is not None:
        spec.check_layout(cfg, info)
    resuming = _resumes(cfg, spec)  # the weights are then the run's own checkpoint's
    if cfg.init_checkpoint and (not resuming or spec.kl_reference(cfg)):
        check_init_checkpoint(cfg.init_checkpoint)  # fail before the run dir is claimed
    if cfg.model.hf_path:
        check_hf_path(cfg.model.hf_path, cfg.model.tp, cfg.model.ep)
    return info, resuming


def _data(cfg: RunConfig, spec: JobSpec, is_main: bool) -> tuple:
    """(tokenizer, task, (train, validation, test sets), input fingerprints): the inputs,
    checked against those the run started with (data files, tokenizer, template; resume=force:
    warned), and the job's own check of its data (`JobSpec.check_data`), before the run is
    recorded (a fixed config may then reuse the run dir)."""
    tokenizer = run_tokenizer(cfg)
    task, train_set, val_set, test_set = build_task(cfg, tokenizer, model_max_len(cfg), is_main)
    inputs = input_fingerprints(cfg, tokenizer, train_set, test_set, val_set) \
        if spec.writes and is_main else {}
    if spec.writes:
        check_inputs(cfg.run_dir, inputs, cfg.resume, is_main)
    if spec.check_data is not None:
        spec.check_data(cfg, tokenizer, train_set, is_main)
    if spec.writes and is_main and not val_set and spec.band_key \
            and attrgetter(spec.band_key)(cfg):
        print(f"WARNING: no validation split (task.n_val=0, no data.val_files / "
              f"data.val_fraction): {spec.band_key} chooses on the test split that reports "
              "the results; set task.n_val (or data.val_fraction)", flush=True)
    return tokenizer, task, (train_set, val_set, test_set), inputs


def _init_weights(cfg: RunConfig, spec: JobSpec, policy: MoEPolicy, resuming: bool,
                  is_main: bool) -> str | None:
    """Load `init_checkpoint` into a run that starts (a resume's weights are its own
    checkpoint's); returns the step dir the run started from (its KL reference, pinned across
    resumes), None without one."""
    if not cfg.init_checkpoint:
        return None
    if not resuming:
        return load_init_weights(policy, cfg.init_checkpoint)
    return reference_dir(cfg, is_main) if spec.kl_reference(cfg) else None


def _resumes(cfg: RunConfig, spec: JobSpec) -> bool:
    """Whether this start resumes run_dir's checkpoint (a job that writes, complete steps
    there, resume on)."""
    if not spec.writes or cfg.resume is False:
        return False
    try:
        return ckpt.newest_step(os.path.join(cfg.run_dir, "checkpoints")) is not None
    except ValueError:  # a garbled `latest`: try_resume says so in one line
        return True


def _progress(rt: Runtime, label: str) -> ChunkProgress | None:
    return ChunkProgress(label, rt.info.is_main, rt.info.dp) if label else None


def evaluate_runtime(rt: Runtime, progress: str = "") -> dict[str, float]:
    """`eval/...`: greedy accuracy of `rt.policy` on the validation split (`rt.eval_set`);
    `progress`: a label, to print a progress line per batch of prompts under it."""
    return evaluate(rt.sampler, rt.tokenizer, rt.task, rt.eval_set,
                    max_new_tokens=rt.cfg.rollout.max_new_tokens,
                    progress=_progress(rt, progress))


def evaluate_test(rt: Runtime, step: int, progress: bool = False) -> dict[str, float]:
    """`test/accuracy`, `test/format_ok` (greedy) and `test/reward` (one response per prompt
    sampled at the rollout temperature and top-p, the mean reward) of `rt.policy` on the test
    split, at optimizer step `step` (its own seeded stream: nothing a run trains changes);
    `test/accuracy_trainer` beside them where the run's sampler is not the trainer's own clean
    decoder (`trainer_sampler`); {} without a test split. `progress`: a progress line per batch
    of prompts."""
    if not rt.test_set:
        return {}
    rollout = rt.cfg.rollout
    greedy = evaluate(rt.sampler, rt.tokenizer, rt.task, rt.test_set,
                      max_new_tokens=rollout.max_new_tokens,
                      progress=_progress(rt, "test" if progress else ""))
    reward = sampled_reward(rt.sampler, rt.tokenizer, rt.task, rt.test_set,
                            SamplingParams(max_new_tokens=rollout.max_new_tokens,
                                           temperature=rollout.temperature, top_p=rollout.top_p),
                            seeds.sampled_test(rt.cfg.seed, step),
                            progress=_progress(rt, "test/reward" if progress else ""))
    out = {"test/accuracy": greedy["eval/accuracy"], "test/format_ok": greedy["eval/format_ok"],
           "test/reward": reward}
    trainer = trainer_sampler(rt)
    if trainer is not None:
        out["test/accuracy_trainer"] = evaluate(
            trainer, rt.tokenizer, rt.task, rt.test_set, max_new_tokens=rollout.max_new_tokens,
            progress=_progress(rt, "test/trainer" if progress else ""))["eval/accuracy"]
    return out


def trainer_sampler(rt: Runtime) -> Sampler | None:
    """The trainer's own decoder over `rt.policy` (lean, the run's precision, clean routers)
    where the run's sampler may compute or route otherwise: an inference engine, or a decoder in
    another precision or with noisy routers (`sampler.Backend.mismatched`); None where the
    sampler is that decoder already. Its greedy test accuracy tells a network that broke from a
    network whose engine disagrees with it."""
    caps = backend_of(rt.cfg)
    if not (caps.engine or caps.mismatched(rt.cfg)):
        return None
    return clean_decoder(rt.policy, rt.tokenizer, rt.cfg)


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
    try:
        preset = preset_from_hf(path)
        preset.with_vocab(preset.vocab_size, multiple=tp).check_parallel(tp, ep)
    except ValueError as e:
        raise ConfigError(f"model.hf_path={path}: {e}") from None
