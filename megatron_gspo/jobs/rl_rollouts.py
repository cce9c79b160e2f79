"""Where RL's rollout batches come from: sampled by the run's sampler when the trainer asks (the
synchronous loop), or beside the trainer, at most `rollout.max_staleness` versions old
(`megatron_gspo.rollout.overlap`).

Shape legend: B sequences.

`sample_batch` draws rollout batch j's prompts (a function of the seed and j only:
`seeds.rollout_prompts`), samples G responses to each and, unless told not to, scores them:
the same batch j whichever thread samples it and whenever. `rollouts_of` builds the producer
of k > 0: the backend's `beside` sampler (our decoders over a weight copy of their own, built
here with `make_policy`; engine servers over their own weights), `sample_batch` unscored in the
producer's thread, the rewards scored on the trainer's thread when it takes the batch.
"""

from __future__ import annotations

import time

import torch

from megatron_gspo.algo.packing import balance_groups
from megatron_gspo.config.schema import RunConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.batch import RolloutBatch
from megatron_gspo.rollout.filters import concat_batches, sample_rollouts
from megatron_gspo.rollout.generate import generate_rollouts, score_rollouts
from megatron_gspo.rollout.overlap import StaleRollouts
from megatron_gspo.rollout.sampler import SamplingParams
from megatron_gspo.run import seeds
from megatron_gspo.run.setup import build_policy
from moe.platform.parallel import ParallelInfo, all_gather_over_dp, exchange_over_dp


def sample_batch(trainer, it: int, sampler, score: bool = True) -> tuple[RolloutBatch, dict]:
    """Rollout batch `it` of `trainer` (`megatron_gspo.jobs.rl.Trainer`) sampled by `sampler`
    (the run's, or a `Beside` one), and its filter and sampler metrics; `score=False` leaves
    the rewards to `generate.score_rollouts`."""
    cfg, rt = trainer.cfg, trainer.rt
    # Same draw on every TP rank of a DP replica; deterministic per iteration (resumable).
    gen = seeds.rollout_prompts(cfg.seed, it, rt.info.dp_rank)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            record_routing=trainer.records_sampler_routing())

    def draw() -> RolloutBatch:
        idx = torch.randint(len(rt.train_set), (trainer.local_prompts,), generator=gen)
        return generate_rollouts(sampler, rt.tokenizer, rt.task,
                                 [rt.train_set[i] for i in idx.tolist()],
                                 group_size=cfg.rollout.group_size,
                                 params=params, generator=gen, max_rows=cfg.rollout.max_batch_rows,
                                 score=score)
    batch, metrics = sample_rollouts(draw, cfg.filter, trainer.local_prompts,
                                     cfg.rollout.group_size, rt.tokenizer.pad_id)
    metrics.update(getattr(sampler, "metrics", {}))  # e.g. the weight sync
    return batch, metrics


class Synchronous:
    """`rollout.max_staleness` = 0: each batch sampled by the run's sampler when the trainer
    asks for it (the synchronous loop), with `StaleRollouts`'s interface."""

    def __init__(self, trainer):
        self.trainer = trainer

    def take(self, it: int) -> tuple[RolloutBatch, dict, float]:
        t0 = time.perf_counter()
        batch, metrics = sample_batch(self.trainer, it, self.trainer.rt.sampler)
        return batch, metrics, time.perf_counter() - t0

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def rollouts_of(trainer) -> Synchronous | StaleRollouts:
    """Where `trainer`'s rollout batches come from: `Synchronous`, or (`rollout.max_staleness`
    > 0) the producer of batches sampled beside it by the backend's `beside` sampler."""
    cfg, rt = trainer.cfg, trainer.rt
    if not cfg.rollout.max_staleness:
        return Synchronous(trainer)
    beside = rt.sampler.beside(lambda: build_policy(cfg, rt.tokenizer.vocab_size, optim=None))
    return StaleRollouts(lambda j, sampler: sample_batch(trainer, j, sampler, score=False),
                         beside, cfg.rollout.max_staleness, cfg.train.steps,
                         finish=lambda batch: score_rollouts(batch, rt.task),
                         say=lambda line: rt.info.is_main and print(line, flush=True))


def check_layout(cfg: RunConfig, info: ParallelInfo) -> None:
    """RL's check of the process layout: `rollout.max_staleness` > 0 samples in a thread of the
    one trainer process (its sampler's collectives would interleave with training's)."""
    if cfg.rollout.max_staleness and info.world_size > 1:
        raise ConfigError(f"rollout.max_staleness={cfg.rollout.max_staleness} samples beside "
                          "the trainer in a thread of its process: it needs one trainer "
                          f"process (this run has {info.world_size})")


def balance_over_dp(batch: RolloutBatch, group_size: int, dp_rank: int, pad_id: int
                    ) -> tuple[RolloutBatch, dict]:
    """`train.balance_dp`: this rank's rollout batch after whole groups were swapped between
    the data-parallel ranks to even out their real tokens (`algo.packing.balance_groups`; its
    own groups first, then those received, by rank), and the metrics of the balance (the same
    on every rank). Collective over the data-parallel group; the batch itself without one."""
    G = group_size
    tokens_RG = all_gather_over_dp(batch.valid_BT.sum(1).view(-1, G).sum(1).tolist())
    if len(tokens_RG) == 1:
        return batch, {}
    plan = balance_groups(tokens_RG)

    def rows(groups: list[int]) -> torch.Tensor:
        return torch.tensor([g * G + i for g in groups for i in range(G)], dtype=torch.long)

    outgoing = {dst: batch.select(rows([g for r, g in held if r == dp_rank]))
                for dst, held in enumerate(plan)
                if dst != dp_rank and any(r == dp_rank for r, _ in held)}
    incoming = exchange_over_dp(outgoing)
    kept = batch.select(rows([g for r, g in plan[dp_rank] if r == dp_rank]))
    parts = [p for p in [kept, *(incoming[r] for r in sorted(incoming))] if len(p)]
    before = [sum(t) for t in tokens_RG]
    after = [sum(tokens_RG[r][g] for r, g in held) for held in plan]
    return concat_batches(parts, pad_id, align=True), {
        "train/dp_tokens/max_over_mean": max(after) * len(after) / max(sum(after), 1),
        "train/dp_tokens/max_over_mean_before": max(before) * len(before) / max(sum(before), 1),
        "train/dp_groups_moved": float(sum(r != d for d, held in enumerate(plan)
                                           for r, _ in held))}
