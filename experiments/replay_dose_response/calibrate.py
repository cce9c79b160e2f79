"""Calibrate `train.router_noise_std` to target per-step expert-flip rates on the cold start.

Usage (the runner calls it):
    python -m experiments.replay_dose_response.calibrate --config rl.yaml --out calib.json \
        [--targets 0.01 0.03 0.1] [KEY=VALUE ...]

Shape legend: B sequences, T tokens.

Samples one rollout batch with the cold-start policy (the config's init_checkpoint), then for a
grid of noise stds runs the loss's forward with `moe.routing.noise` several times and measures,
on the loss positions (`megatron_gspo.algo.flips`), the flip rate of the noisy routing vs the clean
one and the mean |log pi_noisy - log pi_clean| over response tokens (the routing-induced
log-ratio GRPO's first minibatch sees). The std for each target flip rate is interpolated
log-log between the grid points around it. Writes JSON {grid: [{std, flip_rate,
abs_log_ratio}], targets: {flip: std}}.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from megatron_gspo.algo.flips import flip_counts, loss_positions, token_rows
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs import evaluate
from megatron_gspo.rollout.generate import generate_rollouts
from megatron_gspo.rollout.sampler import SamplingParams
from megatron_gspo.run.setup import setup_runtime
from moe.routing.replay import RoutingReplayCache, current_routing, record_routing
from moe.routing.noise import router_noise

GRID = (0.003, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
DRAWS = 3


def noisy_draws(policy, batch, std: float, temperature: float, draws: int):
    """The clean forward's log-probs [B, T] and, for each of `draws` seeded router-noise draws
    at `std`, (its mean per-layer flip rate at the loss positions, its log-probs [B, T])."""
    tokens_BT, valid_BT = batch.tokens_BT, batch.valid_BT
    clean_BT, clean = current_routing(policy, tokens_BT, valid_BT, temperature)
    rows_N = token_rows(policy, clean, loss_positions(batch.response_BT))
    out = []
    for draw in range(draws):
        gen = torch.Generator().manual_seed(1000 + draw)
        with torch.no_grad(), router_noise(policy, std, gen), record_routing(policy) as rec:
            noisy_BT = policy.token_logprobs(tokens_BT, valid_BT, temperature)
        noisy = RoutingReplayCache.from_recorded(rec, policy.routed_valid(valid_BT),
                                                 policy.preset.num_experts, policy.router_rows)
        per_layer = flip_counts(clean, noisy, rows_N)["flip_rate"]
        out.append((sum(per_layer) / len(per_layer), noisy_BT))
    return clean_BT, out


def measure(policy, batch, std: float, temperature: float) -> dict:
    """Mean over DRAWS noise draws of the loss-position flip rate and response |log-ratio|."""
    resp_BT = batch.response_BT.float()
    clean_BT, draws = noisy_draws(policy, batch, std, temperature, DRAWS)
    flips = [flip for flip, _ in draws]
    lrs = [float(((noisy_BT - clean_BT).abs().cpu() * resp_BT).sum() / resp_BT.sum())
           for _, noisy_BT in draws]
    return {"std": std, "flip_rate": sum(flips) / DRAWS, "abs_log_ratio": sum(lrs) / DRAWS}


def one_rollout_batch(rt, cfg):
    """One rollout batch of the run's train prompts, seeded by `cfg.seed`, from `rt`'s sampler
    (`megatron_gspo.run.setup.setup_runtime`'s runtime)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    idx = torch.randint(len(rt.train_set), (cfg.rollout.prompts_per_batch,), generator=gen)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature)
    return generate_rollouts(rt.sampler, rt.tokenizer, rt.task,
                             [rt.train_set[i] for i in idx.tolist()],
                             group_size=cfg.rollout.group_size, params=params, generator=gen)


def interpolate(grid: list[dict], target: float) -> float:
    """The std whose flip rate is `target`, log-log between the bracketing grid points."""
    pts = sorted((g["flip_rate"], g["std"]) for g in grid if g["flip_rate"] > 0)
    for (f0, s0), (f1, s1) in zip(pts, pts[1:]):
        if f0 <= target <= f1:
            w = (math.log(target) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))
    raise ValueError(f"target flip rate {target} is outside the grid's "
                     f"[{pts[0][0]:.4g}, {pts[-1][0]:.4g}]; widen GRID")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--targets", nargs="+", type=float, default=[0.01, 0.03, 0.1])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = load_config(args.config, args.overrides)
    rt = setup_runtime(cfg, evaluate.SPEC)
    try:
        batch = one_rollout_batch(rt, cfg)
        grid = [measure(rt.policy, batch, std, cfg.rollout.temperature) for std in GRID]
    finally:
        rt.close()
    for g in grid:
        print(f"std={g['std']:<6} flip_rate={g['flip_rate']:.4f} "
              f"abs_log_ratio={g['abs_log_ratio']:.4f}", flush=True)
    out = {"grid": grid, "targets": {str(t): interpolate(grid, t) for t in args.targets}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("targets:", out["targets"], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
