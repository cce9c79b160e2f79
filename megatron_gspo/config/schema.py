"""Run configuration: frozen dataclasses are the single source of truth.

Every field has a docstring (a string literal right under it, as in megatron-core's
TransformerConfig); `describe_config()` reads them with `ast` for `megatron-gspo config`. Values
are checked in `__post_init__` (a `ConfigError`, a ValueError, naming the dotted key and value).

Loading is strict and generic (it walks the dataclass fields, no per-section code):
    cfg = load_config("experiments/demo/gspo.yaml", ["loss.eps_low=3e-4", "train.steps=5"])
An unknown key at any level is an error naming the dotted key and listing the section's valid
keys. Override values are YAML (`1e-5`, `true`, `[1,2]`, `null`) coerced to the field's type.

The generic machinery (typing, coercion, YAML 1.2-style loading, overrides, field docstrings)
lives in `megatron_gspo.config.loader`; this module is the schema.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Sequence, Union

import yaml

from megatron_gspo.config.loader import (ConfigError, apply_override, build, check, describe_fields,
                                  field_docs, load_layered, validate)
from megatron_gspo.config.data import (DataConfig, FilterConfig, RewardConfig,  # noqa: F401
                                       check_data_sections, expand_user_paths)
from megatron_gspo.algo.losses import PolicyLossConfig
from moe.model import RECOMPUTE_MODULES, layout_problems, resolve_dispatcher
from moe.optim import OptimSettings

__all__ = ["ConfigError", "RunConfig", "config_from_dict", "config_to_dict", "describe_config",
           "field_docs", "load_config", "save_config"]


# ----------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class ModelConfig:
    """Policy architecture and parallel layout."""
    _section: ClassVar[str] = "model"

    preset: str = "qwen3-moe-tiny"
    """Model preset name (validated by `moe.presets`); ignored when hf_path is set."""
    tp: int = 1
    """Tensor-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: required when tp > 1 (megatron-core's rule for MoE),
    invalid when tp == 1."""
    dispatcher: Literal["auto", "alltoall", "allgather"] = "auto"
    """MoE token dispatcher; 'auto' resolves at load to 'alltoall' when ep > 1, else
    'allgather' (same numbers on one EP rank, without the all-to-all's identity sort copies;
    `moe.model.resolve_dispatcher`)."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter / compute dtype. bf16 / fp16 train with fp32 main grads and fp32 master weights
    (megatron's Float16 optimizer); fp16 adds loss scaling (optim.loss_scale)."""
    aux_loss_coeff: float = 0.0
    """MoE load-balancing auxiliary loss coefficient (0 = off)."""
    dist_timeout_min: float = 10.0
    """Timeout of every collective (torch.distributed and megatron's groups), in minutes: a rank
    waiting longer on its peers fails with the backend's timeout error instead of hanging
    (torch's default is 30)."""
    hf_path: Optional[str] = None
    """Local Hugging Face model folder (config.json, *.safetensors, tokenizer files) to start
    from: the architecture comes from its config.json (model.preset is then ignored), the
    weights are loaded into this run's TP/EP layout, the tokenizer and chat template are its own.
    Qwen3-MoE and Qwen2-MoE. Nothing is downloaded: a hub name is an error."""
    vocab_multiple: int = 128
    """With hf_path: the embedding is padded to a multiple of vocab_multiple * tp rows (megatron's
    make-vocab-size-divisible-by); padded logits are masked. The toy tokenizer pads to 16 * tp."""
    max_seq_len: Optional[int] = None
    """Maximum sequence length (prompt + response tokens) the model is built for; None = the
    preset's (64 for the tiny presets; long-response tasks and datasets need more), or
    config.json's with hf_path. RoPE has no length-bound parameters, so this changes no weight."""
    num_layers: Optional[int] = None
    """The preset's architecture with this many decoder layers (random init): a real model's
    layer shapes (e.g. qwen3-30b-a3b's 128 experts of hidden 2048) at a depth one device holds,
    for throughput and memory measurements. None = the preset's depth. Not with hf_path (a
    checkpoint's depth is its config.json's)."""
    recompute_granularity: Literal["off", "selective", "full"] = "off"
    """megatron's activation recompute for long responses: 'selective' re-runs
    recompute_modules in the backward, 'full' every transformer layer. Same grads (routing
    replay included), less activation memory, one more forward."""
    recompute_modules: str = "moe"
    """Comma-separated modules for 'selective': moe (the whole MoE layer: router, dispatch,
    experts), core_attn."""
    attention: Literal["megatron", "sdpa"] = "sdpa"
    """Core attention of the local (CPU) layer spec: one torch SDPA call (`moe.attention`), or
    megatron's unfused DotProductAttention (the experiments up to issue 16 ran with it and pin
    it; equal to fp32 rounding, which can flip an occasional sampled token). In bf16 / fp16,
    SDPA keeps scores and softmax in fp32 where megatron's unfused path rounds the scores to 16
    bits: closer to exact, and no [B, H, T, T] scores tensor."""

    def __post_init__(self):
        expand_user_paths(self, "hf_path")
        validate(self, nonempty=("preset", "hf_path"),
                 ge={"tp": 1, "ep": 1, "aux_loss_coeff": 0, "vocab_multiple": 1,
                     "max_seq_len": 2, "num_layers": 1},
                 gt={"dist_timeout_min": 0})
        object.__setattr__(self, "dispatcher", resolve_dispatcher(self.dispatcher, self.ep))
        check(self, "attention", self.attention in ("megatron", "sdpa"),
              "expected 'megatron' or 'sdpa'")
        modules = [m.strip() for m in self.recompute_modules.split(",")]
        check(self, "recompute_modules", all(m in RECOMPUTE_MODULES for m in modules),
              f"expected a comma-separated subset of {', '.join(RECOMPUTE_MODULES)}")
        from moe.presets import PRESETS

        check(self, "preset", self.preset in PRESETS, f"unknown preset; valid: {sorted(PRESETS)}")
        check(self, "num_layers", self.num_layers is None or self.hf_path is None,
              "only with model.preset (model.hf_path's depth comes from its config.json)")
        for name, msg in layout_problems(self):  # the rules live in moe.model
            check(self, name, False, msg)


@dataclass(frozen=True)
class TaskConfig:
    """Verifiable task and its train / eval splits."""
    _section: ClassVar[str] = "task"

    name: str = "addition"
    """Task name (see `megatron_gspo.tasks.toy`), or dataset (prompts from files: the data section)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the task constructor, e.g. {num_digits: 2}."""
    n_train: int = 2000
    """Number of training prompts."""
    n_eval: int = 128
    """Number of held-out eval prompts."""
    seed: int = 1234
    """Seed of the train / eval split."""

    def __post_init__(self):
        validate(self, nonempty=("name",), ge={"n_train": 1, "n_eval": 0})
        check(self, "kwargs", all(isinstance(k, str) for k in self.kwargs), "keys must be str")
        from megatron_gspo.tasks.toy import TASKS, task_kwarg_names

        check(self, "name", self.name in TASKS or self.name == "dataset",
              f"unknown task; valid: {sorted(TASKS) + ['dataset']}")
        bad = [] if self.name == "dataset" else \
            [k for k in self.kwargs if k not in task_kwarg_names(self.name)]
        if bad:
            raise ConfigError(f"task.kwargs.{bad[0]}: unknown argument of task {self.name!r}; "
                              f"valid: {task_kwarg_names(self.name)}")


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of G responses per prompt."""
    _section: ClassVar[str] = "rollout"

    prompts_per_batch: int = 8
    """Prompts per rollout batch (over all data-parallel ranks)."""
    group_size: int = 8
    """G: responses sampled per prompt (>= 2, advantages are group-normalised)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (0 < top_p <= 1)."""
    max_new_tokens: int = 8
    """Maximum response length in tokens."""
    use_sampler_logprobs: bool = False
    """Use the sampler's log-probs as pi_old instead of a recompute forward (the GSPO paper's
    claim that inference-engine likelihoods can be used directly, sec. 4.3)."""
    sampler_dtype: Literal["same", "bf16"] = "same"
    """Precision of the sampler's forwards: "same" as the trainer, or "bf16" (autocast) for a
    real train-inference mismatch with an fp32 trainer (`megatron_gspo.rollout.precision`): log-probs and
    MoE routing then differ between sampler and trainer; pi_old, loss and eval stay as trained."""
    kv_cache: bool = True
    """Sample with megatron-core's static KV cache (one new column per step); False recomputes
    the full forward each step. Sequence parallelism always recomputes."""
    backend: str = "lean"
    """The sampler (`megatron_gspo.rollout.sampler`): "lean" (our KV-cache decoder in the
    trainer process: walks megatron's layers itself, caches rotated keys, attends per K/V group;
    `moe.decode`), "megatron" (`GPTModel.forward` with megatron-core's static inference context:
    the same routing and logits to fp32 rounding, slower), "megatron_engine" (megatron-core's
    dynamic inference engine over the same weights: paged KV cache, CUDA graphs; GPU and
    megatron-core >= 0.19 only), or any name registered with `register_sampler`."""
    decoder: Literal["lean", "megatron"] = "lean"
    """The older spelling of backend=lean|megatron: with backend left at "lean",
    decoder=megatron selects the megatron sampler."""
    cuda_graphs: bool = True
    """backend=megatron_engine: replay its decode steps as CUDA graphs (megatron's own,
    `cuda_graph_impl=local` at block scope; training forwards stay eager)."""
    engine_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """backend=vllm: the engine's precision ("auto": the model's, model.dtype); bf16 with an
    fp32 trainer is the train-inference mismatch R3 removes."""
    engine_kv_cache_gb: float = 1.0
    """backend=vllm: the engine's KV cache, in GiB (vLLM otherwise reserves a fraction of the
    host's or GPU's memory)."""
    push_check_tol: Optional[float] = None
    """backend=vllm: after each weight push the engine's and the trainer's log-probs of a fixed
    probe sequence may differ by at most this (nats) or the run stops before sampling; None:
    1e-4 for a float32 engine, 0.25 for bfloat16."""

    def __post_init__(self):
        validate(self, nonempty=("backend",),
                 ge={"prompts_per_batch": 1, "group_size": 2, "max_new_tokens": 1},
                 gt={"temperature": 0, "engine_kv_cache_gb": 0, "push_check_tol": 0})
        check(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")

    @property
    def sampler(self) -> str:
        """The sampler's registered name: `backend`, or `decoder` while backend is "lean"."""
        return self.decoder if self.backend == "lean" else self.backend

    @property
    def engine_graphs(self) -> bool:
        """Whether the policy is built with megatron's inference CUDA graphs."""
        return self.sampler == "megatron_engine" and self.cuda_graphs


@dataclass(frozen=True)
class LossConfig(PolicyLossConfig):
    """Policy loss (GSPO / GRPO) and its clipping: `losses.PolicyLossConfig`'s fields (one
    definition; eps None resolves to the loss's paper default at load) plus the advantage's
    epsilon. A new loss hyper-parameter is one field in `PolicyLossConfig`."""
    _section: ClassVar[str] = "loss"

    adv_eps: float = 1e-6
    """Epsilon in the group advantage (r - mean) / (std + eps)."""

    def __post_init__(self):
        validate(self, nonempty=("name",), gt={"adv_eps": 0})
        super().__post_init__()

    def _fail(self, field: str, why: str, error: type[Exception] = ValueError) -> None:
        check(self, field, False, why)


@dataclass(frozen=True)
class OptimConfig(OptimSettings):
    """megatron-core's Adam and lr schedule; the fields are `moe.optim.OptimSettings`'s."""
    _section: ClassVar[str] = "optim"

    def __post_init__(self):
        validate(self)
        for name, msg in self.problems():
            check(self, name, False, msg)


def check_band(obj, name: str) -> None:
    """Field `name` is None or an accuracy band [low, high] with 0 <= low < high <= 1 (stored
    as a list of two floats)."""
    band = getattr(obj, name)
    if band is None:
        return
    try:
        if any(isinstance(x, bool) for x in band):  # not dropped: [true, 0.2, 0.4] is no band
            raise TypeError(band)
        lo, hi = (float(x) for x in band)
    except (TypeError, ValueError):
        check(obj, name, False, "expected [low, high], two accuracies in [0, 1]")
    check(obj, name, 0 <= lo < hi <= 1, "expected [low, high] with 0 <= low < high <= 1")
    object.__setattr__(obj, name, [lo, hi])


@dataclass(frozen=True)
class TrainConfig:
    """RL loop: iterations, minibatching, Routing Replay, instrumentation."""
    _section: ClassVar[str] = "train"

    steps: int = 20
    """Unit: rollout batches (iterations), NOT optimizer steps: each rollout batch takes
    `num_minibatches` optimizer steps, so a run makes steps * num_minibatches of them (the
    metrics' `step` counts optimizer steps; `train/iteration` counts rollout batches). eval_every,
    save_every and log_every count rollout batches too."""
    num_minibatches: int = 4
    """N optimizer steps per rollout batch; must divide prompts_per_batch * group_size. N = 1
    makes GSPO plain on-policy policy gradient (every ratio is 1, nothing is clipped)."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Routing Replay: off; r2 = replay pi_old's routing from its training-side forward (GSPO
    paper sec. 5.3); r3 = replay the routing the sampler used (arXiv 2510.11370): our decoders
    record it through the KV cache (needs rollout.kv_cache, no sequence parallelism), an
    inference engine reports its own."""
    flip_every: int = 1
    """Measure per-layer expert flips every k optimizer steps (0 = never)."""
    logprob_max_tokens: int = 4096
    """Token budget (sequences x padded length, at least one sequence) per forward of the
    no-grad passes over a whole rollout batch: pi_old, R3's replayed pi_old, the reference
    policy; 0 = all at once. Bounds their activation and logits memory (verl's
    log_prob_max_token_len_per_gpu; raise it on a GPU); short batches stay one forward, as
    per-forward overhead dominates there on CPU (`bench/step.py --pi-old`). The same
    numbers as one pass to fp32 rounding (GEMMs over fewer rows); ranks agree on the number of
    forwards. A memory knob: may change on resume."""
    router_noise_std: float = 0.0
    """Routing-volatility knob (0 = off): Gaussian noise of this std on the router logits picks
    the top-k experts in the loss's forward only (gate weights stay those of the clean logits;
    sampler, pi_old, eval and flip-measurement forwards are clean; seeded per optimizer step).
    Under train.routing_replay=r2/r3 the replayed top-k is forced, so it has no effect: it adds
    exactly the routing-induced noise replay removes (`moe.router_noise`)."""
    eval_every: int = 10
    """Evaluate every k iterations (0 = never)."""
    save_every: int = 10
    """Checkpoint every k iterations and at the end (0 = never)."""
    keep_checkpoints: int = 0
    """Keep the newest k checkpoint steps (`latest` and the complete ones before it), deleting
    older step dirs after each save (0 = keep all). May change on resume."""
    log_every: int = 1
    """Print a progress line every k iterations (metrics.jsonl gets every step)."""
    collapse_reward_drop: float = 0.5
    """Alert when the rolling reward falls by this fraction from its best."""
    collapse_entropy_floor: float = 0.05
    """Alert when the mean token entropy falls below this."""
    max_skipped_steps: int = 10
    """Abort after this many consecutive steps skipped for NaN / inf loss or grad norm."""
    start_accuracy: Optional[list] = None
    """[low, high]: refuse to start (before any RL step) when the initial policy's held-out
    accuracy, the iteration-0 eval (run for this check also with eval_every 0), is outside this
    band, so that every arm of an experiment starts where its recipe says
    (`megatron_gspo.jobs.band`). None = no check."""

    def __post_init__(self):
        validate(self, ge={"steps": 1, "num_minibatches": 1, "log_every": 1, "flip_every": 0,
                            "logprob_max_tokens": 0, "router_noise_std": 0,
                            "eval_every": 0, "save_every": 0, "keep_checkpoints": 0,
                            "max_skipped_steps": 0,
                            "collapse_entropy_floor": 0})
        check(self, "collapse_reward_drop", 0 < self.collapse_reward_drop <= 1,
               "must be in (0, 1]")
        check_band(self, "start_accuracy")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised cold start (`megatron-gspo sft`)."""
    _section: ClassVar[str] = "sft"

    steps: int = 300
    """Unit: optimizer steps (one batch of batch_size examples each), unlike train.steps, which
    counts rollout batches."""
    batch_size: int = 64
    """Examples per step (over all data-parallel ranks)."""
    lr: float = 3e-3
    """Learning rate."""
    eval_every: int = 100
    """Evaluate every k steps (0 = never)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """lr schedule (megatron's OptimizerParamScheduler): constant, or linear / cosine decay from
    sft.lr to sft.min_lr at step sft.steps (with target_accuracy, sft.steps is the budget the
    decay spans, not where SFT stops)."""
    min_lr: float = 0.0
    """Floor of the linear / cosine decay."""
    target_accuracy: Optional[list] = None
    """[low, high]: stop at the first eval (every sft.eval_every steps) whose held-out accuracy
    is in [low, high] and save there; sft.steps is then a budget: exhausting it is an error
    (the checkpoint is kept), and so is an eval that jumps past high (`megatron_gspo.jobs.band`).
    Makes the cold start land in the same place on any machine; None = run sft.steps."""

    def __post_init__(self):
        validate(self, ge={"steps": 1, "batch_size": 1, "lr": 0, "eval_every": 0, "min_lr": 0})
        check(self, "min_lr", self.min_lr <= self.lr, f"must be <= sft.lr={self.lr}")
        check_band(self, "target_accuracy")
        check(self, "target_accuracy", self.target_accuracy is None or self.eval_every > 0,
              f"is checked at the evals: needs sft.eval_every > 0 (got {self.eval_every})")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases mirror of metrics.jsonl."""
    _section: ClassVar[str] = "wandb"

    mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode (needs `pip install -e .[wandb]` unless disabled)."""
    project: str = "megatron-gspo"
    """wandb project."""
    name: Optional[str] = None
    """wandb run name (None = wandb's default)."""

    def __post_init__(self):
        validate(self, nonempty=("project",))


@dataclass(frozen=True)
class RunConfig:
    """Top level of an experiment file."""
    _section: ClassVar[str] = ""

    run_dir: str = "runs/default"
    """Output directory: metrics.jsonl, resolved config, checkpoints/."""
    seed: int = 0
    """Global seed (model init, sampling, minibatch order); 0 <= seed < 2**32."""
    init_checkpoint: Optional[str] = None
    """Initial weights: a run dir (its latest checkpoint) or a step dir, any parallel layout."""
    resume: Union[bool, Literal["force"]] = True
    """Resume from run_dir's newest good checkpoint if there is one. A run dir belongs to one
    run: resuming with a different job or semantic config is refused (`megatron_gspo.run.rundir`);
    "force" resumes anyway with the new config; false refuses a run dir holding checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy architecture and parallel layout."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Verifiable task."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout sampling."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """RL loop."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised cold start."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """wandb logging."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset files (task.name=dataset)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Dataset reward."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """DAPO rollout filters."""

    def __post_init__(self):
        expand_user_paths(self, "run_dir", "init_checkpoint")
        validate(self, nonempty=("run_dir", "init_checkpoint"), ge={"seed": 0})
        # derived seeds (seed * 1_000_033 + step, ...) must fit torch's 64-bit generator seed
        check(self, "seed", self.seed < 2**32, "must be < 2**32")
        check_data_sections(self)
        batch = self.rollout.prompts_per_batch * self.rollout.group_size
        n = self.train.num_minibatches
        if batch % n:
            raise ConfigError(
                f"train.num_minibatches={n} does not divide the rollout batch "
                f"rollout.prompts_per_batch * rollout.group_size = {batch}")
        if self.loss.tis_cap is not None and self.rollout.use_sampler_logprobs:
            raise ConfigError(f"loss.tis_cap={self.loss.tis_cap} weights by pi_old / pi_sampler: "
                              "with rollout.use_sampler_logprobs=true pi_old is the sampler's, "
                              "so every weight would be 1")
        for key in ("is_mask_token", "is_mask_seq", "icepop"):
            if getattr(self.loss, key) is not None and self.rollout.use_sampler_logprobs:
                raise ConfigError(
                    f"loss.{key}={getattr(self.loss, key)} reads pi_old / pi_sampler: with "
                    "rollout.use_sampler_logprobs=true pi_old is the sampler's, so every ratio "
                    "would be 1")
        if self.train.routing_replay == "r3" and self.rollout.sampler in ("lean", "megatron") \
                and (not self.rollout.kv_cache or self.model.sequence_parallel):
            raise ConfigError(
                "train.routing_replay=r3 records routing through the KV-cache sampler: it needs "
                f"rollout.kv_cache=true (got {self.rollout.kv_cache}) and "
                f"model.sequence_parallel=false (got {self.model.sequence_parallel})")


def config_from_dict(d: dict) -> RunConfig:
    """Strict: unknown keys at any level, wrong types or bad values raise ConfigError."""
    return build(RunConfig, d)


def config_to_dict(cfg) -> dict:
    """Plain nested dict; `config_from_dict(config_to_dict(cfg)) == cfg`."""
    return dataclasses.asdict(cfg)


def load_config(path: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """YAML experiment file (None = all defaults; `base: other.yaml` inherits, see
    `strict.load_layered`), then `a.b=c` overrides; all strict."""
    raw = {} if path is None else load_layered(path)
    for item in overrides:
        apply_override(RunConfig, raw, item)
    return config_from_dict(raw)


def save_config(cfg: RunConfig, path: str) -> None:
    """Write the resolved config as YAML atomically (tmp file + os.replace)."""
    text = ("# resolved megatron-gspo config (megatron-gspo ... --config THIS_FILE)\n"
            + yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False))
    from megatron_gspo.run.checkpoint import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def describe_config() -> str:
    """Every key with its type, default and docstring (`megatron-gspo config`)."""
    lines = ["megatron-gspo config keys (YAML sections, or dotted key=value overrides):", ""]
    describe_fields(RunConfig, "", lines)
    return "\n".join(lines)
