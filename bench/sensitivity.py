"""What the routing-sensitivity metrics cost, measured side by side on one RL recipe.

    python -m bench.sensitivity                   # the ablation's recipe on qwen3-moe-tiny
    python -m bench.sensitivity --set model.preset=qwen3-moe-tiny-deep --rounds 3

Two ratios, each of best rounds alternated in one process on one torch thread (other jobs only
slow a round down), on the recipe of experiments/ablation (16 prompts x G=8 of 2-digit addition,
up to 5 new tokens, 4 minibatches, flips measured every optimizer step):

- `moe/route_sensitivity` (`train.route_sensitivity_every`, off by default): one call of
  `megatron_gspo.algo.sensitivity.route_sensitivity` on a rollout batch (L + 1 no-grad forwards)
  against one whole RL iteration (`Trainer.iteration`: rollout, pi_old's pass, the minibatch
  steps and their flip measurements);
- `moe/router_margin` (with every flip measurement): the flip measurement's "after" forward
  (`megatron_gspo.algo.flips.routing_of`) of one minibatch with its router scores recorded,
  packed and reduced to the margins, against the same forward without them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from bench.throughput import cpu_model
from megatron_gspo.algo.flips import routing_of
from megatron_gspo.algo.margins import margin_metrics
from megatron_gspo.algo.sensitivity import margin_rows, route_sensitivity
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs.rl import Trainer
from moe.routing.scores import RouterScores, record_router_scores

RECIPE = ["model.preset=qwen3-moe-tiny", "task.name=addition", "task.kwargs.num_digits=2",
          "task.n_train=4000", "task.n_test=8", "rollout.prompts_per_batch=16",
          "rollout.group_size=8", "rollout.max_new_tokens=5", "train.num_minibatches=4",
          "train.flip_every=1", "train.eval_every=0", "train.save_every=0", "optim.lr=1e-4",
          "wandb.mode=disabled"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    p.add_argument("--fraction", type=float, default=0.1,
                   help="train.route_sensitivity_fraction")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the recipe (repeatable)")
    args = p.parse_args(argv)
    if args.rounds < 1 or not 0 < args.fraction <= 1:
        p.error(f"--rounds={args.rounds} --fraction={args.fraction}: expected >= 1, (0, 1]")
    return args


def best_of(rounds: int, fns: dict) -> dict:
    """{name: best seconds} of the zero-argument `fns`, alternating, after one warm-up round."""
    best = {}
    for r in range(1 + rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    return best


def margin_forward(policy, mb, small: float | None) -> None:
    """The flip measurement's "after" forward of `mb`, with the router margin when `small`."""
    if small is None:
        routing_of(policy, mb.tokens_BT, mb.valid_BT)
        return
    with record_router_scores(policy) as recorded:
        cache = routing_of(policy, mb.tokens_BT, mb.valid_BT)
    scores = RouterScores.from_recorded(recorded, cache.valid_BT, cache.num_experts)
    margin_metrics(scores, margin_rows(policy, scores, mb.response_BT), small)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_sensitivity_") as tmp:
        cfg = load_config(None, [*RECIPE, *args.set, f"run_dir={tmp}/run"])
        trainer = Trainer.from_config(cfg)
        policy, batch = trainer.policy, trainer.rollout(0)
        mb = trainer.prepare(batch)[0].select(torch.arange(len(batch) // 4))
        L = policy.preset.num_layers
        sens = best_of(args.rounds, {
            "iteration": trainer.iteration,
            "sensitivity": lambda: route_sensitivity(
                policy, batch.tokens_BT, batch.valid_BT, batch.response_BT, args.fraction,
                torch.Generator().manual_seed(0), cfg.rollout.temperature)})
        margin = best_of(args.rounds, {"plain": lambda: margin_forward(policy, mb, None),
                                       "margin": lambda: margin_forward(policy, mb, 0.01)})
        trainer.rt.close()
    print(f"machine: {cpu_model()}, 1 torch thread; best of {args.rounds} alternating rounds; "
          f"{cfg.model.preset} ({L} MoE layers), {len(batch)} sequences per rollout batch; "
          f"overrides: {' '.join(args.set) or 'none'}\n")
    print("| measured | time | against | time | ratio |\n|---|---|---|---|---|")
    print(f"| route sensitivity ({L + 1} forwards, fraction {args.fraction:g}) | "
          f"{sens['sensitivity']:.3f} s | one RL iteration | {sens['iteration']:.3f} s | "
          f"{sens['sensitivity'] / sens['iteration']:.2f} |")
    print(f"| flip \"after\" forward with the router margin | {margin['margin'] * 1e3:.1f} ms | "
          f"without | {margin['plain'] * 1e3:.1f} ms | {margin['margin'] / margin['plain']:.3f} |")
    extra = cfg.train.num_minibatches * (margin["margin"] - margin["plain"])
    print(f"| the margin's share of an iteration ({cfg.train.num_minibatches} measured steps) | "
          f"{extra * 1e3:.1f} ms | one RL iteration | {sens['iteration']:.3f} s | "
          f"{extra / sens['iteration']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
