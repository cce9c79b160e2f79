"""The run config's sections, one frozen dataclass per component: the model and its layout, the
task, the optimizer, the RL loop, the SFT cold start, wandb. (The policy loss is in
`megatron_gspo.config.loss`, rollout sampling in `.rollout`, the dataset sections in `.data`,
the top level in `.schema`.)

Every field has a docstring (a string literal right under it) that `megatron-gspo config`
prints. `__post_init__` only checks (`fields.validate` / `fields.check`: one-line ConfigErrors
naming the dotted key); it never changes a value, so the saved config is the one given. Values
derived from others are properties (`ModelConfig.resolved_dispatcher`).
Names that a registry of a higher room holds (task, loss, reward, sampler) are checked at set-up,
`megatron_gspo.run.names`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_gspo.config.fields import Band, OptionalPath, check, check_band, may_change, validate
from moe.model.presets import PRESETS
from moe.model.settings import RECOMPUTE_MODULES, OptimSettings, layout_problems, resolve_dispatcher


@dataclass(frozen=True)
class ModelConfig:
    """Policy architecture and parallel layout."""
    _section: ClassVar[str] = "model"

    preset: str = "qwen3-moe-tiny"
    """Model preset name (validated by `moe.model.presets`); ignored when hf_path is set."""
    tp: int = 1
    """Tensor-parallel size."""
    ep: int = 1
    """Expert-parallel size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: required when tp > 1 (megatron-core's rule for MoE),
    invalid when tp == 1."""
    dispatcher: Literal["auto", "alltoall", "allgather"] = "auto"
    """MoE token dispatcher; 'auto' is 'alltoall' when ep > 1, else 'allgather' (same numbers
    on one EP rank, without the all-to-all's identity sort copies; `resolved_dispatcher`)."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter / compute dtype. bf16 / fp16 train with fp32 main grads and fp32 master weights
    (megatron's Float16 optimizer); fp16 adds loss scaling (optim.loss_scale)."""
    aux_loss_coeff: float = 0.0
    """MoE load-balancing auxiliary loss coefficient (0 = off)."""
    dist_timeout_min: float = may_change(10.0)
    """Timeout of every collective (torch.distributed and megatron's groups), in minutes: a rank
    waiting longer on its peers fails with the backend's timeout error instead of hanging
    (torch's default is 30)."""
    hf_path: OptionalPath = None
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
    preset_overrides: dict = field(default_factory=dict)
    """Architecture fields of model.preset to replace, e.g. {num_experts: 64, topk: 2,
    moe_ffn_hidden_size: 32, norm_topk_prob: false} (any `moe.model.presets.MoEPreset` field but
    name, vocab_size, max_seq_len, hf_model_type; random init). Not with hf_path."""
    recompute_granularity: Literal["off", "selective", "full"] = may_change("off")
    """megatron's activation recompute for long responses: 'selective' re-runs
    recompute_modules in the backward, 'full' every transformer layer. Same grads (routing
    replay included), less activation memory, one more forward."""
    recompute_modules: str = may_change("moe")
    """Comma-separated modules for 'selective': moe (the whole MoE layer: router, dispatch,
    experts), core_attn."""
    attention: Literal["megatron", "sdpa"] = "sdpa"
    """Core attention of the local (CPU) layer spec: one torch SDPA call (`moe.model.attention`), or
    megatron's unfused DotProductAttention (experiments published before SDPA became the
    default ran with it and pin it; equal to fp32 rounding, which can flip an occasional sampled
    token). In bf16 / fp16, SDPA keeps scores and softmax in fp32 where megatron's unfused path
    rounds the scores to 16 bits: closer to exact, and no [B, H, T, T] scores tensor."""

    def __post_init__(self):
        validate(self, nonempty=("preset", "hf_path"),
                 ge={"tp": 1, "ep": 1, "aux_loss_coeff": 0, "vocab_multiple": 1,
                     "max_seq_len": 2, "num_layers": 1},
                 gt={"dist_timeout_min": 0})
        modules = [m.strip() for m in self.recompute_modules.split(",")]
        check(self, "recompute_modules", all(m in RECOMPUTE_MODULES for m in modules),
              f"expected a comma-separated subset of {', '.join(RECOMPUTE_MODULES)}")
        check(self, "preset", self.preset in PRESETS, f"unknown preset; valid: {sorted(PRESETS)}")
        check(self, "num_layers", self.num_layers is None or self.hf_path is None,
              "only with model.preset (model.hf_path's depth comes from its config.json)")
        check(self, "preset_overrides", not self.preset_overrides or self.hf_path is None,
              "only with model.preset (model.hf_path's architecture is its config.json's)")
        try:
            PRESETS[self.preset].with_overrides(self.preset_overrides)
        except (TypeError, ValueError) as e:
            check(self, "preset_overrides", False, str(e))
        for name, msg in layout_problems(self):  # the rules live in moe.model.gpt
            check(self, name, False, msg)

    @property
    def resolved_dispatcher(self) -> str:
        """The dispatcher the model is built with: `dispatcher`, 'auto' resolved
        (`moe.model.settings.resolve_dispatcher`)."""
        return resolve_dispatcher(self.dispatcher, self.ep)


@dataclass(frozen=True)
class TaskConfig:
    """Verifiable task and its train / validation / test splits.

    Megatron-LM's train / valid / test (verl's val_files is the validation split): the evals
    during training (`eval/accuracy`, train.eval_every, sft.eval_every) and whatever chooses
    (sft.target_accuracy, train.start_accuracy) read the validation split; the test split is
    evaluated at a run's first and last step (`test/...`) and chooses nothing. n_test was named
    n_eval before the validation split existed: a config or run record with n_eval still loads
    (as n_test), and draws the same test split."""
    _section: ClassVar[str] = "task"
    _renamed: ClassVar[dict] = {"n_eval": "n_test"}

    name: str = "addition"
    """Task name (see `megatron_gspo.tasks.toy`, `megatron_gspo.tasks.running_ops`), or dataset
    (prompts from files: the data section). Checked against the registry at set-up
    (`megatron_gspo.run.names`)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the task constructor, e.g. {num_digits: 2}."""
    n_train: int = 2000
    """Number of training prompts."""
    n_test: int = 128
    """Number of held-out test prompts: evaluated at a run's first and last step (`test/...`),
    never read by anything that chooses. Formerly n_eval (still read). The same (task, n_test,
    seed) draws the same test prompts whatever n_train and n_val are."""
    n_val: int = 0
    """Number of held-out validation prompts, disjoint from train and test (drawn after both, so
    they stay as without it): what evals during training and the accuracy bands read. 0 = no
    validation split: they read the test split, as before this split existed (a warning says so
    where a band chooses on it)."""
    seed: int = 1234
    """Seed of the train / validation / test split."""

    def __post_init__(self):
        validate(self, nonempty=("name",), ge={"n_train": 1, "n_test": 0, "n_val": 0})
        check(self, "kwargs", all(isinstance(k, str) for k in self.kwargs), "keys must be str")


@dataclass(frozen=True)
class OptimConfig(OptimSettings):
    """megatron-core's Adam and lr schedule; the fields are `moe.model.settings.OptimSettings`'s."""
    _section: ClassVar[str] = "optim"

    def __post_init__(self):
        validate(self)
        for name, msg in self.problems():
            check(self, name, False, msg)


@dataclass(frozen=True)
class TrainConfig:
    """RL loop: iterations, minibatching, Routing Replay, instrumentation."""
    _section: ClassVar[str] = "train"

    steps: int = may_change(20)
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
    record it through the KV cache (needs rollout.decoders.kv_cache, no sequence parallelism), an
    inference engine reports its own."""
    flip_every: int = may_change(1)
    """Measure per-layer expert flips every k optimizer steps (0 = never), the router margin
    (`moe/router_margin/...`, from the same forward's router scores) and, from a rollout
    batch's second step, `policy/routing_log_ratio` (one more no-grad forward)."""
    router_margin_small: float = may_change(0.01)
    """The threshold of `moe/router_margin_small/layer_XX`: the fraction of loss positions whose
    router-probability gap between their K-th and (K+1)-th expert is below it (> 0; a
    probability, so compare with 1 / num_experts, 0.0625 for qwen3-moe-tiny)."""
    route_sensitivity_every: int = may_change(0)
    """Measure `moe/route_sensitivity/layer_XX` every k rollout batches, on the rollout batch at
    pi_old's weights before its first optimizer step (0 = never): L + 1 no-grad forwards of the
    whole batch (`megatron_gspo.algo.sensitivity`; train.logprob_max_tokens does not split
    them). Changes nothing that is trained."""
    route_sensitivity_fraction: float = may_change(0.1)
    """The fraction of loss positions whose K-th expert is swapped for their (K+1)-th, one layer
    at a time, in `moe/route_sensitivity` (in (0, 1])."""
    pack: bool = may_change(True)
    """Sequence packing: every forward over a rollout batch (pi_old, R3's replayed pi_old, the
    KL reference, the loss's forwards and backwards, the flip, margin and sensitivity forwards,
    eval's full-recompute sampling) runs its rows' real tokens as one sequence, positions
    restarting and attention confined to each sequence (`moe.model.packed`), instead of every
    row at the batch's padded width; routing caches replay in packed order. The same numbers to
    float rounding (tests/megatron_gspo/jobs/test_rl_packing.py); false: the padded step.
    Needs model.attention=sdpa (or TransformerEngine). A speed knob: may change on resume."""
    balance_dp: bool = may_change(True)
    """Packed runs with data parallelism: after sampling, whole groups (a prompt's G responses)
    are swapped between data-parallel ranks until their real tokens are near equal, each rank
    keeping its number of rows (`algo.packing.balance_groups`), so no rank's longer answers
    keep the others waiting at the gradient all-reduce. `train/dp_tokens/max_over_mean` (and
    `..._before`) measure it; a resume may change it (it moves rows, not what a step
    computes). false: each rank trains on the rows it sampled."""
    logprob_max_tokens: int = may_change(4096)
    """Token budget per forward of the no-grad passes over a whole rollout batch: pi_old, R3's
    replayed pi_old, the reference policy; 0 = all at once. Packed (train.pack): real tokens,
    rows binned first-fit decreasing, a row over the budget alone; padded: sequences x padded
    length, consecutive rows, at least one. Bounds their activation and logits memory (verl's
    log_prob_max_token_len_per_gpu; raise it on a GPU); short batches stay one forward, as
    per-forward overhead dominates there on CPU (`bench/step.py --pi-old`). The same
    numbers as one pass to fp32 rounding (GEMMs over fewer rows); ranks agree on the number of
    forwards (`megatron_gspo.algo.packing`). A memory knob: may change on resume."""
    micro_max_tokens: int = may_change(0)
    """Token budget per forward and backward of an optimizer step: each minibatch runs in as
    few microbatches as keep within it, their gradients accumulated into the one optimizer
    step; 0 = the whole minibatch in one forward. Packed (train.pack): real tokens, rows binned
    first-fit decreasing, a row over the budget alone; padded: sequences x padded length,
    consecutive rows, at least one. Bounds a train step's activation memory (verl's
    ppo_max_token_len_per_gpu; `megatron-gspo plan` sizes it). The same update to float
    rounding: each microbatch's loss, a mean over its sequences, weighs its share of the
    minibatch's rows, and the metrics cover the whole minibatch (`megatron_gspo.jobs.rl_step`);
    the router noise draws continue over the microbatches. Ranks agree on the number of
    microbatches (`megatron_gspo.algo.packing`). A memory knob: may change on resume."""
    router_noise_std: float = 0.0
    """Routing-volatility knob (0 = off): Gaussian noise of this std on the router logits picks
    the top-k experts in the loss's forward only (gate weights stay those of the clean logits;
    sampler, pi_old, eval and flip-measurement forwards are clean; seeded per optimizer step).
    Under train.routing_replay=r2/r3 the replayed top-k is forced, so it has no effect: it adds
    exactly the routing-induced noise replay removes (`moe.routing.noise`)."""
    eval_every: int = may_change(10)
    """Evaluate every k iterations (0 = never)."""
    save_every: int = may_change(10)
    """Checkpoint every k iterations and at the end (0 = never)."""
    keep_checkpoints: int = may_change(0)
    """Keep the newest k checkpoint steps (`latest` and the complete ones before it), deleting
    older step dirs after each save (0 = keep all). May change on resume."""
    log_every: int = may_change(1)
    """Print a progress line every k iterations (metrics.jsonl gets every step)."""
    collapse_reward_drop: float = 0.5
    """Alert when the rolling reward falls by this fraction from its best."""
    collapse_entropy_floor: float = 0.05
    """Alert when the mean token entropy falls below this."""
    max_skipped_steps: int = 10
    """Abort after this many consecutive steps skipped for NaN / inf loss or grad norm."""
    start_accuracy: Band = may_change(None)
    """[low, high]: refuse to start (before any RL step) when the initial policy's held-out
    accuracy, the iteration-0 eval (run for this check also with eval_every 0), is outside this
    band, so that every arm of an experiment starts where its recipe says
    (`megatron_gspo.jobs.band`). None = no check."""

    def __post_init__(self):
        validate(self, ge={"steps": 1, "num_minibatches": 1, "log_every": 1, "flip_every": 0,
                            "logprob_max_tokens": 0, "micro_max_tokens": 0,
                            "router_noise_std": 0,
                            "eval_every": 0, "save_every": 0, "keep_checkpoints": 0,
                            "max_skipped_steps": 0, "route_sensitivity_every": 0,
                            "collapse_entropy_floor": 0}, gt={"router_margin_small": 0})
        check(self, "route_sensitivity_fraction", 0 < self.route_sensitivity_fraction <= 1,
              "must be in (0, 1]")
        check(self, "collapse_reward_drop", 0 < self.collapse_reward_drop <= 1,
               "must be in (0, 1]")
        check_band(self, "start_accuracy")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised cold start (`megatron-gspo sft`)."""
    _section: ClassVar[str] = "sft"

    steps: int = may_change(300)
    """Unit: optimizer steps (one batch of batch_size examples each), unlike train.steps, which
    counts rollout batches."""
    batch_size: int = 64
    """Examples per step (over all data-parallel ranks)."""
    lr: float = 3e-3
    """Learning rate."""
    eval_every: int = may_change(100)
    """Evaluate every k steps (0 = never)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """lr schedule (megatron's OptimizerParamScheduler): constant, or linear / cosine decay from
    sft.lr to sft.min_lr at step sft.steps (with target_accuracy, sft.steps is the budget the
    decay spans, not where SFT stops)."""
    min_lr: float = 0.0
    """Floor of the linear / cosine decay."""
    pack: bool = may_change(True)
    """Run each step's batch as one packed forward (its rows' real tokens as one sequence,
    `moe.model.packed`) instead of padded to the longest row; the same loss to float rounding.
    Needs model.attention=sdpa (or TransformerEngine). A speed knob: may change on resume."""
    target_accuracy: Band = may_change(None)
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
