"""Cold-start SFT: teach the policy the task's format and part of its skill before RL.

Shape legend: B sequences, T tokens.

Cross-entropy on the reference answer (and <eos>) given `<bos> prompt`, token-mean over the
batch, in one forward per step: packed by default (`sft.pack`: the rows' real tokens as one
sequence, `moe.model.packed`), else every row padded to the longest. The GSPO paper starts RL from a cold-start fine-tuned model; here SFT is run only until
the policy is partially right (`eval/accuracy` well inside (0, 1)), so that groups of G samples
have non-zero reward variance and RL has something to learn.

The job gives the run loop (`megatron_gspo.run.loop`) its step, its evals (validation; test at
the first and last step), its state (`SFTState`) and its band (`sft.target_accuracy` on the
validation split, `megatron_gspo.jobs.band.SFTBand`); resume, preemption, the save at the end
and "already finished" are the loop's, as for RL.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.dist import reduce_metrics
from megatron_gspo.jobs.band import SFTBand
from megatron_gspo.run import seeds
from megatron_gspo.run.loop import RunLoop, Schedule
from megatron_gspo.run.oom import SFT_STEP, out_of_memory
from megatron_gspo.run.setup import (JobSpec, evaluate_runtime, evaluate_test, model_max_len,
                                     setup_runtime)
from megatron_gspo.tasks.datasets import check_sft_lengths
from moe.model.settings import OptimSettings


def sft_batch(tokenizer, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens/valid [B, T] of `<bos> prompt answer <eos>`, each row left-padded to the longest
    row, and the answer mask. T is the longest row, not the longest prompt plus the longest
    answer (that sum can exceed model.max_seq_len when every row fits)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    rows = [(bos + tokenizer.encode(ex.prompt), tokenizer.encode(ex.answer) + [tokenizer.eos_id])
            for ex in examples]
    T = max(len(p) + len(a) for p, a in rows)
    tokens_BT = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.long)
    valid_BT = torch.zeros(len(rows), T, dtype=torch.bool)
    target_BT = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, (prompt, answer) in enumerate(rows):
        tokens_BT[b, T - len(prompt) - len(answer):] = torch.tensor(prompt + answer)
        valid_BT[b, T - len(prompt) - len(answer):] = True
        target_BT[b, T - len(answer):] = True
    return tokens_BT, valid_BT, target_BT


@dataclass
class SFTState:
    """What an SFT checkpoint carries besides the weights, under the keys SFT checkpoints have
    always had (`job`, `step`, `gen`; the run loop adds the row and the band's record)."""

    gen: torch.Generator
    """This data-parallel rank's batch stream (`megatron_gspo.run.seeds.sft_batches`): one
    stream for the whole job, so its state is saved, not re-derived."""
    step: int = 0
    """SFT steps done (one optimizer step each: the metrics' step)."""

    done = property(lambda self: self.step)
    log_step = property(lambda self: self.step)

    def to_checkpoint(self) -> dict:
        return {"job": "sft", "step": self.step, "gen": self.gen.get_state()}

    @classmethod
    def from_checkpoint(cls, extra: dict) -> "SFTState":
        gen = torch.Generator()
        gen.set_state(extra["gen"])
        return cls(gen=gen, step=extra["step"])


@dataclass
class SFTJob:
    """Cold-start SFT as a job of the run loop: `sft.steps` cross-entropy steps on this rank's
    share of `sft.batch_size`, evaluated every `sft.eval_every` steps and at the last, saved at
    the last, stopped early inside `sft.target_accuracy` (`SFTBand`). ConfigError when the batch
    does not split evenly over the data-parallel ranks."""

    rt: object
    """The run's `megatron_gspo.run.setup.Runtime`."""
    step_tokens: int = field(init=False, default=0)
    """Valid tokens of the latest step's batch on this rank (the progress line's tokens/s)."""
    state: SFTState = field(init=False)
    band: SFTBand = field(init=False)
    schedule: Schedule = field(init=False)

    def __post_init__(self):
        cfg, info = self.rt.cfg, self.rt.info
        if cfg.sft.batch_size % info.dp:
            raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} is not divisible by the "
                              f"data-parallel size {info.dp}")
        self.state = SFTState(gen=seeds.sft_batches(cfg.seed, info.dp_rank))
        self.band, self.schedule = SFTBand(cfg), schedule(cfg)

    def iteration(self) -> dict:
        self.rt.policy.train(True)  # the sampler puts it back after an eval; the guard is cheap
        batch = draw_batch(self.rt, self.state.gen)
        self.step_tokens = int(batch[1].sum())  # the progress line's tokens/s
        with out_of_memory("an SFT step", self.rt.cfg, SFT_STEP):
            metrics = sft_step(self.rt, batch)
        self.state.step += 1
        return reduce_metrics(metrics)

    def evaluate(self) -> dict:
        return evaluate_runtime(self.rt)

    def test(self) -> dict:
        return evaluate_test(self.rt, self.state.log_step)

    def restore(self, extra: dict) -> None:
        self.state = SFTState.from_checkpoint(extra)
        self.band.resume(self.state.step, extra.get("eval", {}), extra.get("band") or {})


def schedule(cfg: RunConfig) -> Schedule:
    """SFT's steps for the run loop: `sft.steps`, after an eval of the initial policy; an eval
    and a progress line every `sft.eval_every` steps and at the last (none with 0); one
    checkpoint, at the last step (or where the band stops SFT)."""
    every = cfg.sft.eval_every
    return Schedule(total=cfg.sft.steps, steps_key="sft.steps", unit="SFT step",
                    units="SFT steps", eval_every=every, eval_last=bool(every), save_last=True,
                    progress_every=every, progress_last=bool(every),
                    progress_keys=("sft/loss", "eval/accuracy"))


UNUSED_SECTIONS = ("train", "loss", "rollout")
"""Config sections SFT does not read: a resume may change them."""


def optim_settings(cfg: RunConfig) -> OptimSettings:
    """SFT's optimizer: `optim`'s Adam at `sft.lr`, without warmup, constant or decaying to
    `sft.min_lr` at step `sft.steps` (`sft.lr_decay_style`)."""
    decay = cfg.sft.lr_decay_style
    return replace(cfg.optim, lr=cfg.sft.lr, min_lr=cfg.sft.min_lr, warmup_steps=0,
                   lr_decay_style=decay,
                   lr_decay_steps=0 if decay == "constant" else cfg.sft.steps)


def check_targets(cfg: RunConfig, tokenizer, train_set: list, is_main: bool) -> None:
    """A DataError naming an SFT example longer than the model; a warning counting targets
    longer than rollout.max_new_tokens, which eval and rollouts cut (`JobSpec.check_data`)."""
    cut = check_sft_lengths(tokenizer, train_set, model_max_len(cfg), cfg.rollout.max_new_tokens)
    if cut and is_main:
        print(f"WARNING: {cut} of {len(train_set)} SFT targets are longer than "
              f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}: eval and rollouts "
              "cut such answers", flush=True)


SPEC = JobSpec("sft", optim=optim_settings, unused_sections=UNUSED_SECTIONS,
               band_key="sft.target_accuracy", check_data=check_targets, pack_key="sft.pack")
"""What SFT needs of the run set-up: its optimizer, its band's key, its data check."""


def run_sft(cfg: RunConfig) -> dict:
    """Train `cfg.sft.steps` steps, evaluating every `cfg.sft.eval_every`; save a checkpoint at
    the end (and on SIGTERM / Ctrl-C / SIGHUP, then raise `Preempted`); resume a stopped run. With
    `sft.target_accuracy` stop (and save) at the first eval inside the band instead, and raise
    `AccuracyBandError` past it or when sft.steps runs out (`megatron_gspo.jobs.band`)."""
    rt = setup_runtime(cfg, SPEC)
    try:
        return RunLoop(rt, SFTJob(rt)).run()
    finally:
        rt.close()  # also when the job or the resume refused to start


def draw_batch(rt, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fresh batch (`sft_batch`) of this rank's share of `sft.batch_size` training examples,
    drawn from `gen`."""
    idx = torch.randint(len(rt.train_set), (rt.cfg.sft.batch_size // rt.info.dp,), generator=gen)
    return sft_batch(rt.tokenizer, [rt.train_set[i] for i in idx.tolist()])


def sft_step(rt, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict:
    """One cross-entropy step on `batch` (tokens, valid and target masks, [B, T]): one forward,
    packed under `sft.pack` (the policy's `pack`)."""
    policy = rt.policy
    tokens_BT, valid_BT, target_BT = batch
    policy.zero_grad()
    logp_BT = policy.token_logprobs(tokens_BT, valid_BT)
    target_BT = target_BT.to(logp_BT.device)
    loss = -(logp_BT * target_BT).sum() / target_BT.sum()
    policy.backward(loss)
    stepped, grad_norm = policy.step()
    return {"sft/loss": loss.item(), "train/grad_norm": grad_norm,
            "train/skipped": float(not stepped)}


run = run_sft
"""The CLI's entry (`megatron-gspo sft`)."""
