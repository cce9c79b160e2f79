"""GSPO vs GRPO vs GRPO + Routing Replay on qwen3-moe-tiny, from one cold-start checkpoint.

Usage:
    python -m experiments.ablation.run                    # `make ablation`: 3 arms x 3 seeds
    python -m experiments.ablation.run --seeds 0 --steps 20 --arms gspo grpo
    python -m experiments.ablation.run --plot-only        # redraw figures from runs/ablation
    python -m experiments.ablation.run --profile gpu-small   # `small` preset on one GPU
    python -m experiments.ablation.run --tag stress --set optim.lr=3e-4 \
        --set train.num_minibatches=8 --set train.steps=80 --set train.eval_every=20 --seeds 0 1

Every arm starts from the same SFT checkpoint and spends the same rollout compute (same prompts
per batch, group size, response length and number of rollout batches); each rollout batch is split
into 4 minibatches (4 optimizer steps). Runs land in runs/ablation/<arm>_s<seed> (each starts
afresh, except an arm holding a checkpoint, which resumes: one a signal stopped, or any under
`--profile gpu-small`'s periodic saves; a finished one only says so); figures and the
summary table in experiments/ablation/figures (or --out). `--profile gpu-small` lays
gpu_small.yaml over every command's config (as dotted overrides) and writes to
runs/ablation_gpu_small and experiments/ablation/figures_gpu_small.

The shared SFT stops when its held-out accuracy enters sft.yaml's band (the arms refuse a start
outside it); the runner prints that start accuracy and SFT step, and writes the result table
(`tools/result_table.py`, machine and versions named) into README.md between
`<!-- table:main:begin/end -->` (`table:stress:...` for `--tag stress`, and so on).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from megatron_gspo.jobs.band import cold_start_line
from megatron_gspo.config.yamlfile import load_yaml, mapping_to_overrides
from tools import plot_run
from tools import result_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = ("gspo", "grpo", "grpo_r2")
# Rows of the README's result tables (tools/result_table.py: KEY:REDUCER=label).
STATS = ["eval/accuracy:start=eval accuracy at the start (SFT checkpoint)",
         "eval/accuracy:final=eval accuracy, final", "eval/accuracy:best=eval accuracy, best eval",
         "reward/mean:first10%=train reward, first 10% of steps",
         "reward/mean:last10%=train reward, last 10% of steps",
         "policy/clip_frac/token:mean=clipped tokens",
         "policy/clip_frac/seq:mean=clipped sequences",
         "moe/flip_rate/mean:mean=expert flip rate per step",
         "moe/any_flip/mean:mean=tokens with any flipped expert per step",
         "moe/drift_vs_old/mean:mean=live routing vs pi_old's after the step",
         "policy/entropy:mean=policy entropy",
         "adv/zero_std_frac:mean=groups with zero reward variance"]  # + the mean flip rate of each layer
PROFILES = {"cpu": None, "gpu-small": "gpu_small.yaml"}


def profile_overrides(profile: str) -> list[str]:
    """The profile's YAML (config format, no `base`) as `key=value` overrides; [] for cpu.

    Read with the config loader's YAML 1.2 resolver, so `off` stays a string as in any config."""
    if PROFILES[profile] is None:
        return []
    return mapping_to_overrides(load_yaml(os.path.join(HERE, PROFILES[profile])) or {})


def cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "megatron_gspo.cli", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="rollout batches per run")
    ap.add_argument("--profile", choices=list(PROFILES), default="cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every RL run (repeatable); use with --tag")
    ap.add_argument("--tag", default="", help="variant name: runs/ablation[_profile]_TAG, "
                                              "figures[_profile]_TAG (same SFT checkpoint)")
    ap.add_argument("--out", default=None, help="figures folder (default: figures[_profile])")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    if args.set and not args.tag:
        ap.error("--set changes the runs: give them a --tag so they do not overwrite the default")
    t0 = time.time()
    suffix = "" if args.profile == "cpu" else "_" + args.profile.replace("-", "_")
    sft_dir = f"runs/ablation{suffix}/sft"
    suffix += f"_{args.tag}" if args.tag else ""
    root, out = f"runs/ablation{suffix}", args.out or os.path.join(HERE, "figures" + suffix)
    base = profile_overrides(args.profile)
    runs = []
    if not os.path.exists(os.path.join(ROOT, sft_dir, "checkpoints/latest")) \
            and not args.plot_only:
        cli("sft", "--config", os.path.join(HERE, "sft.yaml"), *base, f"run_dir={sft_dir}")
    print(cold_start_line(os.path.join(ROOT, sft_dir)), flush=True)
    for arm in args.arms:
        for seed in args.seeds:
            run_dir = f"{root}/{arm}_s{seed}"
            runs.append(os.path.join(ROOT, run_dir))
            if args.plot_only:
                continue
            # an arm a signal stopped saved a checkpoint: the same command resumes it
            fresh = not os.path.exists(os.path.join(ROOT, run_dir, "checkpoints", "latest"))
            overrides = [*base, *args.set, f"init_checkpoint={sft_dir}", f"run_dir={run_dir}",
                         f"seed={seed}", *(["resume=false"] if fresh else [])]
            if args.steps:
                overrides.append(f"train.steps={args.steps}")
            if fresh and os.path.exists(os.path.join(ROOT, run_dir, "metrics.jsonl")):
                os.remove(os.path.join(ROOT, run_dir, "metrics.jsonl"))
            cli("train", "--config", os.path.join(HERE, f"{arm}.yaml"), *overrides)
    if plot_run.main([*runs, "--out", out, "--group-by-prefix"]):
        return 2  # it printed the one-line reason (a run without metrics.jsonl)
    write_table(runs, suffix.lstrip("_") or "main", os.path.join(ROOT, sft_dir))
    print(f"ablation done in {time.time() - t0:.0f}s")
    return 0


def write_table(runs: list[str], marker: str, sft_dir: str, stats: list[str] | None = None,
                readme: str | None = None) -> None:
    """The result table (tools/result_table.py; the header names the machine and where the
    cold start stopped; rows `stats`, default this experiment's, plus each layer's flip rate)
    into `readme`'s (default this folder's README.md) `table:MARKER` markers, or printed when it
    has none for this variant."""
    loaded = plot_run.load_runs(runs, group_by_prefix=True)
    layers = [f"{key}:mean=flip rate, layer {i}" for i, key in plot_run.layer_keys(loaded)]
    cold = cold_start_line(sft_dir).replace(ROOT + os.sep, "")
    header = f"{result_table.machine_line()} {cold[0].upper()}{cold[1:]}."
    table = result_table.format_table(loaded, (STATS if stats is None else stats) + layers,
                                      header=header)
    readme = readme or os.path.join(HERE, "README.md")
    try:
        result_table.write_into(readme, table, marker)
    except ValueError as e:
        print(f"note: {e}; the table:")
    print(table)


if __name__ == "__main__":
    sys.exit(main())
