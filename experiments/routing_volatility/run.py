"""How volatile is expert routing under RL updates: flip rate vs layer depth, lr and minibatches.

Usage:
    python experiments/routing_volatility/run.py                 # the sweep below (~10 min CPU)
    python experiments/routing_volatility/run.py --steps 10      # quicker
    python experiments/routing_volatility/run.py --plot-only

GRPO without Routing Replay from the ablation's cold-start checkpoint (run the ablation first, or
this script runs its SFT). Flips are measured on every optimizer step: the top-k sets of the
same tokens just before vs just after the step. Sweeps learning rate at 4 minibatches, and the
number of minibatches per rollout batch at lr 1e-4. Prints per-layer mean flip rates and the
Spearman correlation of flip rate with depth for each run.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "experiments", "ablation"))

from run import cli, load_plot_tool  # noqa: E402  (experiments/ablation/run.py)

SWEEP = {  # name -> overrides
    "lr3e-5_n4": ["optim.lr=3e-5", "train.num_minibatches=4"],
    "lr1e-4_n4": ["optim.lr=1e-4", "train.num_minibatches=4"],
    "lr3e-4_n4": ["optim.lr=3e-4", "train.num_minibatches=4"],
    "lr1e-4_n2": ["optim.lr=1e-4", "train.num_minibatches=2"],
    "lr1e-4_n8": ["optim.lr=1e-4", "train.num_minibatches=8"],
}


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", nargs="+", default=list(SWEEP), choices=list(SWEEP))
    ap.add_argument("--out", default=os.path.join(HERE, "figures"))
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.plot_only and not os.path.exists(
            os.path.join(ROOT, "runs/ablation/sft/checkpoints/latest")):
        cli("sft", "--config", os.path.join(ROOT, "experiments/ablation/sft.yaml"))
    dirs = []
    for name in args.runs:
        run_dir = f"runs/routing_volatility/{name}"
        dirs.append(os.path.join(ROOT, run_dir))
        if not args.plot_only:
            cli("train", "--config", os.path.join(ROOT, "experiments/ablation/grpo.yaml"),
                f"run_dir={run_dir}", "resume=false", f"train.steps={args.steps}",
                "train.eval_every=0", *SWEEP[name])
    plot = load_plot_tool()
    plot.main([*dirs, "--out", args.out])
    print(f"\n{'run':<12} {'flip mean':>9}  per-layer mean flip rate (layer 0 first)   "
          f"spearman(depth, flip)")
    for row in plot.summarize(plot.load_runs(dirs)):
        layers = row["flip_rate_layers"]
        xs = sorted(layers)
        ys = [layers[i] for i in xs]
        print(f"{row['label']:<12} {row['flip_rate_mean']:>9.4f}  "
              f"{' '.join(f'{y:.4f}' for y in ys):<40} {spearman(xs, ys):>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
