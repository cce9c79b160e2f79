"""How volatile is expert routing under RL updates: flip rate vs layer depth, lr and minibatches.

Usage:
    python -m experiments.routing_volatility.run                 # both presets, 6 runs each
    python -m experiments.routing_volatility.run --presets qwen3-moe-tiny --steps 10
    python -m experiments.routing_volatility.run --plot-only

GRPO without Routing Replay from a cold-start SFT checkpoint, on qwen3-moe-tiny (4 MoE layers;
the ablation's checkpoint, made here if missing) and qwen3-moe-tiny-deep (the same layer, 12
deep; its own SFT with the ablation's recipe). Flips are measured on every optimizer step: the
top-k sets of the same tokens just before vs just after the step. Sweeps the learning rate at 4
minibatches, and the number of minibatches per rollout batch at lr 1e-4. Prints per-layer mean
flip rates, the Spearman correlation of flip rate with depth, and the mean flip rate of the
deepest third of layers over that of the shallowest third. Figures go to figures/<preset>/;
the tables (with the machine, the cold starts' accuracies, the clip fraction and the final
reward per run) go into README.md between `<!-- table:main:begin/end -->`.
"""

from __future__ import annotations

import argparse
import os
import sys

from experiments.ablation.run import cli
from megatron_gspo.jobs.band import cold_start_line
from tools import plot_run
from tools import result_table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PRESETS = {"qwen3-moe-tiny": "4 MoE layers", "qwen3-moe-tiny-deep": "12 MoE layers"}
STATS = ["policy/clip_frac/token:mean=token clip fraction",
         "reward/mean:last10%=final training reward (last 3 rollout batches)",
         "moe/flip_rate/mean:mean=mean flip rate"]
SWEEP = {  # name -> overrides
    "lr3e-5_n4": ["optim.lr=3e-5", "train.num_minibatches=4"],
    "lr1e-4_n4": ["optim.lr=1e-4", "train.num_minibatches=4"],
    "lr3e-4_n4": ["optim.lr=3e-4", "train.num_minibatches=4"],
    "lr1e-3_n4": ["optim.lr=1e-3", "train.num_minibatches=4"],
    "lr1e-4_n2": ["optim.lr=1e-4", "train.num_minibatches=2"],
    "lr1e-4_n8": ["optim.lr=1e-4", "train.num_minibatches=8"],
}


def spearman(xs, ys) -> float:
    """Spearman's rho: Pearson's r of the ranks, tied values sharing their mean rank (so layers
    with equal flip rates, e.g. none at all, add no correlation); NaN for a constant series."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
                end += 1
            for i in order[start:end + 1]:
                r[i] = (start + end) / 2
            start = end + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


def sft_checkpoint(preset: str) -> str:
    """The cold-start checkpoint for `preset`: the ablation's for qwen3-moe-tiny, else its own
    SFT with the ablation's recipe (run here when missing)."""
    run_dir = "runs/ablation/sft" if preset == "qwen3-moe-tiny" else \
        f"runs/routing_volatility/{preset}/sft"
    if not os.path.exists(os.path.join(ROOT, run_dir, "checkpoints/latest")):
        cli("sft", "--config", os.path.join(ROOT, "experiments/ablation/sft.yaml"),
            f"model.preset={preset}", f"run_dir={run_dir}")
    return run_dir


def depth_table(dirs: list) -> str:
    """Per run: mean flip rate, per-layer means, Spearman(depth, flip), deepest/shallowest."""
    lines = [f"{'run':<12} {'flip mean':>9}  {'spearman':>8}  {'deep/shallow':>12}  "
             "per-layer mean flip rate (layer 0 first)"]
    for row in plot_run.summarize(plot_run.load_runs(dirs)):
        layers = row["flip_rate_layers"]
        xs = sorted(layers)
        ys = [layers[i] for i in xs]
        third = max(1, len(ys) // 3)
        ratio = (sum(ys[-third:]) / third) / max(sum(ys[:third]) / third, 1e-12)
        lines.append(f"{row['label']:<12} {row['flip_rate_mean']:>9.4f}  "
                     f"{spearman(xs, ys):>8.2f}  {ratio:>12.2f}  "
                     + " ".join(f"{y:.4f}" for y in ys))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="rollout batches per run")
    ap.add_argument("--runs", nargs="+", default=list(SWEEP), choices=list(SWEEP))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--out", default=os.path.join(HERE, "figures"))
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    tables, results = [], []
    for preset in args.presets:
        init = None if args.plot_only else sft_checkpoint(preset)
        sft_dir = os.path.join(ROOT, "runs/ablation/sft" if preset == "qwen3-moe-tiny" else
                               f"runs/routing_volatility/{preset}/sft")
        dirs = []
        for name in args.runs:
            run_dir = f"runs/routing_volatility/{preset}/{name}"
            dirs.append(os.path.join(ROOT, run_dir))
            # a run a signal stopped saved a checkpoint: the same command resumes it
            fresh = not os.path.exists(os.path.join(ROOT, run_dir, "checkpoints", "latest"))
            if not args.plot_only:
                cli("train", "--config", os.path.join(ROOT, "experiments/ablation/grpo.yaml"),
                    f"model.preset={preset}", f"init_checkpoint={init}", f"run_dir={run_dir}",
                    *(["resume=false"] if fresh else []), f"train.steps={args.steps}",
                    "train.eval_every=0", "train.save_every=0", *SWEEP[name])
        if plot_run.main([*dirs, "--out", os.path.join(args.out, preset)]):
            return 2  # it printed the one-line reason (a run without metrics.jsonl)
        tables.append(f"\n{preset} ({PRESETS[preset]}), GRPO, {args.steps} rollout batches:\n"
                      + depth_table(dirs))
        results.append(f"{preset} ({PRESETS[preset]}); "
                       + cold_start_line(sft_dir).replace(ROOT + os.sep, "") + ":\n\n"
                       + result_table.format_table(plot_run.load_runs(dirs), STATS, header="")
                       .lstrip("\n"))
    text = "\n".join(tables)
    print(text)
    block = "\n\n".join([result_table.machine_line(), "```" + text + "\n```", *results])
    try:  # generated, never hand-typed: between the README's table:main markers
        result_table.write_into(os.path.join(HERE, "README.md"), block, "main")
    except ValueError as e:
        print(f"note: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
