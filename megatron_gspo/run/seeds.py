"""Every random stream of a run, derived from the config's one `seed` here and nowhere else.

A stream is a function of the seed and of where the run is (rollout batch, optimizer step,
data-parallel rank), never of how it got there, so a resumed run draws what an uninterrupted one
would; the one stream that runs through a whole job (SFT's batches) has its state saved in every
checkpoint instead. The multipliers are primes that keep the streams of neighbouring seeds,
iterations and ranks apart. They are part of every pinned result (tests/golden/golden_run.json):
a new one changes what a seed trains.

- the policy's initial weights and megatron's RNG trackers: `seed` itself
  (`megatron_gspo.run.setup.build_policy`, `moe.platform.parallel.init_parallel`);
- `sft_batches`: SFT's example draws, one stream per data-parallel rank for the whole job;
- `rollout_prompts`: the prompts of RL rollout batch `iteration` and the sampler's draws for
  them, per data-parallel rank (the same on every tensor-parallel rank of a replica);
- `minibatch_order`: how a rollout batch's rows are dealt into its minibatches;
- `router_noise`: `train.router_noise_std`'s draw for one optimizer step, on the policy's device;
- `route_sensitivity`: which loss positions `moe/route_sensitivity` swaps in rollout batch
  `iteration`, per data-parallel rank;
- `sampled_test`: the sampled responses of the test split's `test/reward` at optimizer step
  `step` (the same on every rank: each samples the whole test split).

The last two are streams of their own, so measuring them changes nothing a run trains.

`rollout.decoders.router_noise_std`'s draws (the sampler's routers) come from the rollout's
stream, one draw per rollout, and from `seed` itself in evaluations (`megatron_gspo.rollout.decoders`).

The config keeps `seed < 2**32`, so every derived seed fits torch's 64-bit generator seed.
"""

from __future__ import annotations

import torch

SFT_BATCHES = 31
ROLLOUT, ROLLOUT_ITERATION = 7_919, 104_729
MINIBATCH_ORDER = 1_000_003
ROUTER_NOISE, ROUTER_NOISE_OFFSET = 1_000_033, 17
ROUTE_SENSITIVITY = 1_000_037
TEST_SAMPLES = 1_000_039


def _generator(seed: int, device=None) -> torch.Generator:
    gen = torch.Generator() if device is None else torch.Generator(device)
    return gen.manual_seed(seed)


def sft_batches(seed: int, dp_rank: int) -> torch.Generator:
    """SFT's batch draws on data-parallel rank `dp_rank` (its state goes into checkpoints)."""
    return _generator(seed * SFT_BATCHES + dp_rank)


def rollout_prompts(seed: int, iteration: int, dp_rank: int) -> torch.Generator:
    """The prompts and sampling of rollout batch `iteration` (0-based) on `dp_rank`."""
    return _generator(seed * ROLLOUT + iteration * ROLLOUT_ITERATION + dp_rank)


def minibatch_order(seed: int, iteration: int) -> torch.Generator:
    """The permutation that deals rollout batch `iteration`'s rows into minibatches (the same
    on every rank: each permutes its own rows)."""
    return _generator(seed * MINIBATCH_ORDER + iteration)


def router_noise(seed: int, opt_step: int, device) -> torch.Generator:
    """Router-logit noise of optimizer step `opt_step` (0-based), drawn on `device`."""
    return _generator(seed * ROUTER_NOISE + opt_step + ROUTER_NOISE_OFFSET, device)


def route_sensitivity(seed: int, iteration: int, dp_rank: int) -> torch.Generator:
    """The positions `moe/route_sensitivity` swaps in rollout batch `iteration` on `dp_rank`."""
    return _generator(seed * ROUTE_SENSITIVITY + iteration * ROLLOUT_ITERATION + dp_rank)


def sampled_test(seed: int, step: int) -> torch.Generator:
    """The sampled responses of `test/reward` at optimizer step `step` (every rank alike)."""
    return _generator(seed * TEST_SAMPLES + step)
