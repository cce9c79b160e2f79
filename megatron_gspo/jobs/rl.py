"""GSPO / GRPO trainer: rollout -> old-policy pass -> N off-policy minibatch steps, repeat.

Shape legend: B sequences, T tokens, L MoE layers.

One iteration (GSPO paper, sec. 5.1 set-up): sample G responses for each of `prompts_per_batch`
prompts with the current policy (= pi_old), compute pi_old's log-probs (and record its routing)
in one no-grad forward, compute group advantages, then split the rollout batch into
`num_minibatches` minibatches and take one optimizer step on each. Step m > 1 sees a policy
that has moved m-1 times since pi_old, which is what makes the importance ratio (and clipping)
matter; with one minibatch GSPO reduces to on-policy policy gradient (docs/pitfalls.md#minibatches).

What it measures besides what it trains is its instruments' (`megatron_gspo.jobs.instruments`,
the config's `instruments:`), called at fixed points: after pi_old's pass, around each optimizer
step's forwards, before and after its update, at the end of the rollout batch and after an eval.
The built-in ones (`jobs.rl_instruments`) measure expert flips (`megatron_gspo.algo.flips`: the
top-k sets of the same tokens just before and just after a step, and after it vs pi_old), the
routing log-ratio, route sensitivity, the per-expert load, throughput and collapse alerts.

Parts: `Trainer(rt, cfg, ref_policy=..., loss_fn=...)` is the RL job over parts built elsewhere
(`Trainer.from_config` is the CLI's factory); the run loop (`megatron_gspo.run.loop`) drives it
as it drives SFT: resume, the start eval and `train.start_accuracy`, logging, saves, preemption.
The rollout batch becomes one `Minibatch` (tokens, pi_old log-probs, advantages, routing caches)
whose `select(rows)` gives each optimizer step's rows; counters live in `TrainerState`, which
checkpoints carry. The metrics helpers are `megatron_gspo.jobs.rl_metrics`.

Routing Replay: `r2` replays pi_old's routing from the no-grad training-side forward (GSPO
paper, sec. 5.3); `r3` replays the routing the sampler itself used (recorded step by step through
the KV cache) in pi_old's forward too, so pi_old's log-probs are those of the sampler's routing
and the first minibatch is on-policy (ratio 1). It logs `rollout/routing_mismatch/...`, the flip
rate of the sampler's routing vs the training-side live recompute of the same weights, and
`rollout/logprob_mismatch_r3/...`, the sampler's log-probs vs pi_old's replayed ones (what is
left after R3: the precision). Departure: by default both sides run the same weights in the same
framework and precision, so the mismatch is float rounding only
(`rollout.decoders.sampler_dtype=bf16` makes it real, `megatron_gspo.rollout.precision`); with a separate inference engine (vLLM/SGLang
kernels, bf16) it is what R3 exists to remove.
With `rollout.max_staleness` > 0 (docs/staleness.md) pi_old is still this recompute (AReaL's
proximal policy), the older sampler's log-probs the behaviour's; `tis` corrects between them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

import torch

from megatron_gspo.algo.advantages import group_advantages
from megatron_gspo.algo.flips import loss_positions, sampler_mismatch, token_rows
from megatron_gspo.algo.corrections import correction_inputs
from megatron_gspo.algo.packing import microbatches
from megatron_gspo.algo.losses import PolicyLossFn, get_policy_loss
from megatron_gspo.config.schema import RunConfig, local_prompts
from megatron_gspo.dist import reduce_metrics
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs.band import StartBand
from megatron_gspo.jobs import rl_instruments  # noqa: F401 (the built-in instruments registered)
from megatron_gspo.jobs.instruments import Instruments, Step, check_instruments
from megatron_gspo.jobs.rl_metrics import replay_diff, response_metrics, rollout_metrics
from megatron_gspo.jobs.rl_rollouts import balance_over_dp, check_layout, rollouts_of
from megatron_gspo.jobs.rl_step import accumulate, forward_logprobs, noise_inputs
from megatron_gspo.rollout.backends import backend_of
from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.filters import overlong_filter, rollout_health
from megatron_gspo.rollout.overlap import staleness_metrics
from megatron_gspo.run import seeds
from megatron_gspo.run.init import load_init_weights
from megatron_gspo.run.loop import RunLoop, Schedule
from megatron_gspo.run.metrics import Timer
from megatron_gspo.run.oom import OLD_PASS, ROLLOUT, TRAIN_STEP, out_of_memory
from megatron_gspo.run.setup import (JobSpec, Runtime, build_policy, evaluate_runtime,
                                     evaluate_test, packs, setup_runtime)
from moe.routing.replay import RoutingReplayCache, current_routing
from moe.model.settings import OptimSettings

PROGRESS_KEYS = ("reward/mean", "eval/accuracy", "policy/clip_frac/token",
                 "moe/flip_rate/mean", "train/grad_norm")
UNUSED_SECTIONS = ("sft",)
"""Config sections RL does not read: a resume may change them."""


def optim_settings(cfg: RunConfig) -> OptimSettings:
    """RL's optimizer: `optim` as configured, lr_decay_steps 0 meaning its last update
    (train.steps x train.num_minibatches); ConfigError when a linear / cosine decay would end
    within the warmup."""
    total = cfg.train.steps * cfg.train.num_minibatches
    settings = replace(cfg.optim, lr_decay_steps=cfg.optim.lr_decay_steps or total)
    if settings.lr_decay_style != "constant" and settings.lr_decay_steps <= settings.warmup_steps:
        end = (f"optim.lr_decay_steps={cfg.optim.lr_decay_steps}" if cfg.optim.lr_decay_steps
               else f"train.steps x train.num_minibatches = {total}")
        raise ConfigError(f"optim.warmup_steps={settings.warmup_steps}: the lr decay "
                          f"(optim.lr_decay_style={settings.lr_decay_style}) ends at {end}; it "
                          "must end after the warmup")
    return settings


def kl_reference(cfg: RunConfig) -> bool:
    """init_checkpoint is the frozen KL reference (RL with a KL)."""
    return cfg.loss.kl_coef > 0


def check_run(cfg: RunConfig, info) -> None:
    """RL's own checks before the run dir is claimed: the layout, the instruments' names."""
    check_layout(cfg, info)
    check_instruments(cfg.instruments)


SPEC = JobSpec("train", optim=optim_settings, unused_sections=UNUSED_SECTIONS,
               kl_reference=kl_reference, band_key="train.start_accuracy",
               pack_key="train.pack", check_layout=check_run)
"""What RL needs of the run set-up: its optimizer, its KL reference, its band's key."""


@dataclass
class Minibatch:
    """Everything one optimizer step reads, row-aligned with the rollout; `select(rows)` slices
    all of it at once (a whole rollout batch is one, and so is each minibatch of it)."""

    rollout: RolloutBatch
    """Tokens, masks, rewards (and the sampler's routing under R3)."""
    old_logp_BT: torch.Tensor
    """pi_old's log-probs of the sampled tokens (the trainer's recompute, or the sampler's)."""
    adv_B: torch.Tensor
    """One group advantage per sequence."""
    old_routing: RoutingReplayCache
    """pi_old's routing (the drift statistics compare against it)."""
    replay: RoutingReplayCache | None = None
    """The routing forced in the policy forward: pi_old's (R2), the sampler's (R3) or None."""
    ref_logp_BT: torch.Tensor | None = None
    """The frozen reference policy's log-probs (KL), or None."""

    def select(self, rows: torch.Tensor) -> "Minibatch":
        def take(value):
            if value is None:
                return None
            return value[rows] if torch.is_tensor(value) else value.select(rows)
        return Minibatch(**{f.name: take(getattr(self, f.name))
                            for f in dataclasses.fields(self)})

    def __len__(self) -> int:
        return len(self.rollout)

    tokens_BT = property(lambda self: self.rollout.tokens_BT)
    valid_BT = property(lambda self: self.rollout.valid_BT)
    response_BT = property(lambda self: self.rollout.response_BT)


@dataclass
class TrainerState:
    """What a checkpoint carries besides the weights; resuming restores it."""

    iteration: int = 0
    """Rollout batches done (`train.steps` counts these)."""
    opt_step: int = 0
    """Optimizer steps done (`train.num_minibatches` per rollout batch); the metrics' step."""
    skipped_in_a_row: int = 0
    """Consecutive steps skipped for a non-finite loss or grad norm."""
    reward_ema: float | None = None
    best_reward_ema: float | None = None

    done = property(lambda self: self.iteration)
    log_step = property(lambda self: self.opt_step)

    def to_checkpoint(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_checkpoint(cls, extra: dict) -> "TrainerState":
        """The state saved in `extra` (keys it does not know, the run loop's included, are
        left)."""
        return cls(**{f.name: extra[f.name] for f in dataclasses.fields(cls) if f.name in extra})


class Trainer:
    """The RL job over parts built elsewhere: `rt` (process groups, policy, tokenizer, task and
    splits, sampler, metrics logger, run dir), the config's sections, a reference policy for the
    KL (or None) and the loss function. `Trainer.from_config` builds the parts the way the CLI
    does; tests pass their own. Building it resumes run_dir's checkpoint (`self.loop`, the run
    loop of `megatron_gspo.run.loop`, which `train()` runs); the job's part is one rollout batch
    (`iteration`), the eval, its state (`TrainerState`) and its band (`train.start_accuracy`)."""

    def __init__(self, rt: Runtime, cfg: RunConfig, *, ref_policy=None,
                 loss_fn: PolicyLossFn | None = None):
        self.rt, self.cfg, self.policy, self.ref_policy = rt, cfg, rt.policy, ref_policy
        self.loss_fn = loss_fn or get_policy_loss(cfg.loss.name)
        self.local_prompts = local_prompts(cfg, rt.info.dp)
        self.state, self.band, self.schedule = TrainerState(), StartBand(cfg), schedule(cfg)
        self.timer = Timer()
        self.step_tokens = 0  # valid tokens of the latest rollout batch on this rank
        self.filter_metrics: dict = {}  # dynamic sampling's, of the last rollout
        self.loop = RunLoop(rt, self)  # resumes: self.state is the checkpoint's from here on
        self.instruments = Instruments(cfg.instruments, self)  # jobs.rl_instruments
        self.rollouts = rollouts_of(self)  # sampled now, or beside training (max_staleness)

    @classmethod
    def from_config(cls, cfg: RunConfig, **parts) -> "Trainer":
        """Claim the run dir and build every part from `cfg` (the CLI's path); `parts`
        (`loss_fn`) replace the default ones."""
        rt = setup_runtime(cfg, SPEC)
        try:
            ref_policy = None
            if kl_reference(cfg):  # frozen reference = the initial weights
                ref_policy = build_policy(cfg, rt.tokenizer.vocab_size, None, pack=packs(cfg, SPEC))
                if cfg.init_checkpoint:  # the step the run started from, not today's newest
                    load_init_weights(ref_policy, cfg.init_checkpoint, step_dir=rt.init_dir)
            return cls(rt, cfg, ref_policy=ref_policy, **parts)
        except BaseException:
            rt.close()
            raise

    def train(self) -> dict:
        """Run to `train.steps` rollout batches (`megatron_gspo.run.loop.RunLoop.run`); a signal
        saves and raises `Preempted`. Returns the last rollout batch's row."""
        try:
            return self.loop.run()
        finally:
            self.rollouts.close()  # batches sampled ahead are dropped, in one line
            self.instruments.close()

    def restore(self, extra: dict) -> None:
        self.state = TrainerState.from_checkpoint(extra)

    def evaluate(self) -> dict:
        self.rollouts.idle()  # its sampler may be the engine that samples beside training
        metrics = evaluate_runtime(self.rt)
        return {**metrics, **self.instruments.on_eval(metrics)}

    def test(self) -> dict:
        self.rollouts.idle()
        return evaluate_test(self.rt, self.state.opt_step)

    # ------------------------------------------------------------------ one rollout batch
    def iteration(self) -> dict:
        """One rollout batch: sample, pi_old pass, `train.num_minibatches` optimizer steps. Logs
        each minibatch's row but the last, whose metrics (with timings and the instruments'
        of the whole batch) it returns for the run loop to log."""
        cfg, it = self.cfg, self.state.iteration
        self.timer.reset()
        with self.timer("rollout_wait"), out_of_memory("the rollout", cfg, ROLLOUT):
            batch = self.rollout(it)
        balance = {}
        if cfg.train.balance_dp and self.policy.pack:  # groups between DP ranks, by tokens
            batch, balance = balance_over_dp(batch, cfg.rollout.group_size, self.rt.info.dp_rank,
                                             self.rt.tokenizer.pad_id)
        self.step_tokens = int(batch.valid_BT.sum())  # the progress line's tokens/s
        with self.timer("old_forward"), out_of_memory("the no-grad pass over the rollout batch",
                                                      cfg, OLD_PASS):
            full, shared = self.prepare(batch)
        measured = self.instruments.on_rollout(full, it)  # at pi_old's weights
        shared.update(staleness_metrics(batch, it), **balance, **{"train/iteration": it})
        order = torch.randperm(len(batch), generator=seeds.minibatch_order(cfg.seed, it))
        metrics = {}
        mbs = [full.select(rows) for rows in order.chunk(cfg.train.num_minibatches)]
        for m, mb in enumerate(mbs):
            with self.timer("train"), out_of_memory("an optimizer step", cfg, TRAIN_STEP):
                metrics = self.train_step(mb, next_mb=mbs[m + 1] if m + 1 < len(mbs) else None,
                                          first=m == 0)
            metrics = reduce_metrics({**metrics, **shared, "train/minibatch": m})
            if m < cfg.train.num_minibatches - 1:
                self.rt.logger.log(self.state.opt_step, metrics)
        self.state.iteration = it + 1
        metrics.update(measured, **self.timer.as_metrics())
        metrics.update(self.instruments.on_iteration(full, metrics))
        return metrics

    def prepare(self, batch: RolloutBatch) -> tuple[Minibatch, dict]:
        """pi_old's no-grad pass (log-probs, routing), advantages and the replay source: the
        whole rollout batch as one `Minibatch`, plus the metrics all its steps share."""
        cfg = self.cfg
        # forwards of <= logprob_max_tokens, as many on every rank (algo/packing.py)
        chunks = microbatches(batch.valid_BT, cfg.train.logprob_max_tokens, self.policy.pack)
        live_logp_BT, live_routing = current_routing(
            self.policy, batch.tokens_BT, batch.valid_BT, cfg.rollout.temperature,
            start=batch.response_start, chunks=chunks)
        old_logp_BT, old_routing = live_logp_BT, live_routing
        if cfg.train.routing_replay == "r3":  # pi_old routes as the sampler did (on-policy)
            old_logp_BT, old_routing = self.batch_logprobs(self.policy, batch, chunks,
                                                           batch.routing), batch.routing
        ref_logp_BT = None if self.ref_policy is None else \
            self.batch_logprobs(self.ref_policy, batch, chunks)
        adv_B, adv_metrics = group_advantages(batch.rewards_B, cfg.rollout.group_size,
                                              eps=cfg.loss.adv_eps)
        adv_B, overlong_metrics = overlong_filter(adv_B, batch, cfg.filter.overlong)
        shared = {**rollout_metrics(batch, live_logp_BT), **adv_metrics, **rollout_health(batch),
                  **overlong_metrics, **self.filter_metrics}
        replay = {"off": None, "r2": old_routing, "r3": batch.routing}[cfg.train.routing_replay]
        if replay is not None:
            shared["replay/cache_bytes"] = replay.nbytes
        if batch.routing is not None:  # how far the sampler's routing is from the recompute's
            rows_N = token_rows(self.policy, live_routing, loss_positions(batch.response_BT))
            shared.update(sampler_mismatch(live_routing, batch.routing, rows_N))
            if cfg.train.routing_replay == "r3":
                shared.update(rollout_metrics(batch, old_logp_BT, "rollout/logprob_mismatch_r3/"))
        pi_old_BT = batch.sampler_logp_BT if cfg.rollout.use_sampler_logprobs else old_logp_BT
        return Minibatch(batch, pi_old_BT, adv_B, old_routing, replay, ref_logp_BT), shared

    @torch.no_grad()
    def batch_logprobs(self, policy, batch: RolloutBatch, chunks: list,
                       routing=None) -> torch.Tensor:
        """`policy`'s log-probs of a rollout batch, a forward per row selector of `chunks`;
        with `routing`, replaying it (R3's pi_old pass under the sampler's routing)."""
        return forward_logprobs(policy, batch.tokens_BT, batch.valid_BT, chunks,
                                self.cfg.rollout.temperature, batch.response_start, routing)

    def records_sampler_routing(self) -> bool:
        """Record the sampler's routing: for R3, and to measure the sampler-trainer routing
        mismatch where it can differ and the backend can record it (`rollout.sampler.Backend`):
        an inference engine's, or our decoder's in another precision, with noisy routers or
        older weights (`rollout.max_staleness`; KV cache, no sequence parallelism); one rollout
        round only."""
        cfg = self.cfg
        if cfg.train.routing_replay == "r3":
            return True
        if cfg.filter.dynamic_sampling:
            return False
        caps = backend_of(cfg)
        return (caps.engine or caps.mismatched(cfg) or cfg.rollout.max_staleness > 0) \
            and caps.records_routing(cfg)

    def rollout(self, it: int) -> RolloutBatch:
        """Rollout batch `it`: sampled now by the run's sampler, or (`rollout.max_staleness`)
        taken from those sampled beside the trainer (`jobs.rl_rollouts`)."""
        batch, self.filter_metrics, seconds = self.rollouts.take(it)
        self.timer.add("rollout", seconds)  # its sampling's, wherever it ran
        return batch

    # ------------------------------------------------------------------ one optimizer step
    def train_step(self, mb: Minibatch, next_mb: Minibatch | None = None,
                   first: bool = False) -> dict:
        """One optimizer step on a minibatch (its forwards and backwards in microbatches of
        `train.micro_max_tokens`, `rl_step.accumulate`); `mb.replay` (R2/R3 rows) forces its
        routing. `first`: no step since pi_old's pass; `next_mb`: the iteration's next
        minibatch (both let the flip measurement reuse routing it already has,
        `flips.FlipSchedule`). The instruments' hooks: around the forwards, before and after
        the update (`jobs.instruments`)."""
        cfg, policy = self.cfg, self.policy
        step = Step(self.state.opt_step, mb, next_mb, first)
        tis, tis_metrics = self.tis(mb)
        policy.zero_grad()
        noise = noise_inputs(cfg, mb, self.state.opt_step, policy.device)
        with self.instruments.forwards(step) as record:
            step.done = done = accumulate(policy, mb, cfg, self.loss_fn, tis, record, noise)
        metrics = dict(done.metrics)
        metrics.update(tis_metrics, **response_metrics(mb, done.logp_BT, done.entropy_BT))
        if mb.replay is not None:
            metrics["replay/route_diff"] = replay_diff(done.replayed)
        metrics.update(self.instruments.before_update(step))  # the weights the loss used
        stepped, grad_norm = policy.step() if done.finite else (False, float("nan"))
        metrics.update(self.guard(stepped), **{"train/grad_norm": grad_norm,
                                               "train/lr": policy.lr})
        step.stepped = stepped
        metrics.update(self.instruments.on_step(step))
        self.state.opt_step += 1
        return metrics

    def tis(self, mb: Minibatch) -> tuple[dict, dict]:
        """The train-inference corrections from pi_old (trainer) / pi_sampler as the loss's
        keyword arguments (`loss.tis_cap`, `is_mask_token`, `is_mask_seq`, `icepop`;
        `corrections.correction_inputs`), and their metrics; both empty when all are off (no
        forward)."""
        return correction_inputs(mb.old_logp_BT, mb.rollout.sampler_logp_BT, mb.response_BT,
                                 self.cfg.loss)

    def guard(self, stepped: bool) -> dict:
        """NaN/inf guard: a bad step is skipped and counted; too many in a row aborts."""
        state = self.state
        state.skipped_in_a_row = 0 if stepped else state.skipped_in_a_row + 1
        if state.skipped_in_a_row > self.cfg.train.max_skipped_steps:
            raise FloatingPointError(
                f"{state.skipped_in_a_row} consecutive optimizer steps had a non-finite "
                f"loss or grad norm (train.max_skipped_steps={self.cfg.train.max_skipped_steps}); "
                f"checkpoints in {self.cfg.run_dir} are untouched")
        return {"train/skipped": float(not stepped)}


def schedule(cfg: RunConfig) -> Schedule:
    """RL's steps for the run loop: `train.steps` rollout batches; the initial policy's eval
    when `train.eval_every` or `train.start_accuracy` asks for it, then every `eval_every`; a
    checkpoint every `train.save_every` and after the last (none with 0); a progress line every
    `train.log_every`."""
    t = cfg.train
    return Schedule(total=t.steps, steps_key="train.steps", unit="rollout batch",
                    units="rollout batches", start_eval=bool(t.eval_every or t.start_accuracy),
                    eval_every=t.eval_every, save_every=t.save_every,
                    save_last=bool(t.save_every), progress_every=t.log_every,
                    progress_keys=PROGRESS_KEYS)


def run(cfg: RunConfig) -> dict:
    """The CLI's entry (`megatron-gspo train`): build every part from `cfg` and train."""
    return Trainer.from_config(cfg).train()
