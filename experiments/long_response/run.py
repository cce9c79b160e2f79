"""GSPO vs GRPO on running_sum (61-71-token responses) from one in-band SFT cold start.

Usage:
    python -m experiments.long_response.run                      # SFT to the band, 2 arms x 3 seeds
    python -m experiments.long_response.run --jobs 2             # two RL runs at a time
    python -m experiments.long_response.run --seeds 0 --steps 3  # smoke test
    python -m experiments.long_response.run --plot-only          # tables and figures from runs/

SFT (sft.yaml) stops when held-out greedy accuracy first enters the band [0.25, 0.45]; both arms
(gspo.yaml; GRPO is the same file with `loss.name=grpo`) start from that checkpoint, refuse a start
outside the band, and spend the same rollout compute. Runs land in runs/long_response/<arm>_s<seed>
(each RL run's output in its own train.log there); figures in experiments/long_response/figures;
the result table is written into README.md between `<!-- table:main:begin/end -->`, headed by
the machine, versions and where the cold start stopped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from experiments.ablation.run import ROOT, cli, write_table
from megatron_gspo.jobs.band import cold_start_line
from tools import plot_run

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {"gspo": [], "grpo": ["loss.name=grpo"]}
STATS = ["eval/accuracy:final=eval accuracy, final (after 40 rollout batches)",
         "eval/accuracy:best=eval accuracy, best eval",
         "reward/mean:first10%=train reward, first 10% of steps",
         "reward/mean:last10%=train reward, last 10% of steps",
         "policy/clip_frac/token:mean=clipped tokens",
         "policy/clip_frac/seq:mean=clipped sequences",
         "moe/flip_rate/mean:mean=expert flip rate per step (loss positions)",
         "moe/flip_rate_all/mean:mean=expert flip rate per step (all tokens)",
         "moe/drift_vs_old/mean:mean=live routing vs pi_old's after the step",
         "response/length/mean:mean=response length (tokens)",
         "response/truncated_frac:best=truncated responses, worst batch",
         "train/grad_norm:best=gradient norm, largest step",
         "alert/reward_collapse:mean=rollout batches with a reward-collapse alert (fraction)",
         "alert/entropy_collapse:mean=rollout batches with an entropy-collapse alert (fraction)",
         "policy/entropy:mean=policy entropy"]


def train(arm: str, seed: int, sft_dir: str, root: str, steps: int | None) -> str:
    """One RL run (a subprocess, output in its train.log); returns its run dir."""
    run_dir = f"{root}/{arm}_s{seed}"
    overrides = [*ARMS[arm], f"init_checkpoint={sft_dir}", f"run_dir={run_dir}",
                 f"seed={seed}", "resume=false"] + ([f"train.steps={steps}"] if steps else [])
    path = os.path.join(ROOT, run_dir)
    os.makedirs(path, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", "--config",
           os.path.join(HERE, "gspo.yaml"), *overrides]
    print("$", " ".join(cmd[1:]), flush=True)
    with open(os.path.join(path, "train.log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="rollout batches per run")
    ap.add_argument("--jobs", type=int, default=1, help="RL runs at a time")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    t0, root, sft_dir = time.time(), "runs/long_response", "runs/long_response/sft"
    if not os.path.exists(os.path.join(ROOT, sft_dir, "checkpoints/latest")) \
            and not args.plot_only:
        cli("sft", "--config", os.path.join(HERE, "sft.yaml"), f"run_dir={sft_dir}")
    print(cold_start_line(os.path.join(ROOT, sft_dir)), flush=True)
    grid = [(arm, seed) for arm in args.arms for seed in args.seeds]
    taken = [f"{root}/{a}_s{s}" for a, s in grid if os.path.exists(os.path.join(ROOT, root,
                                                                                 f"{a}_s{s}"))]
    if taken and not args.plot_only:  # fail before any run, not after the first
        ap.error(f"run dirs exist: {' '.join(taken)}; remove them to re-run, or --plot-only")
    if args.plot_only:
        runs = [os.path.join(ROOT, f"{root}/{arm}_s{seed}") for arm, seed in grid]
    else:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(lambda job: train(*job, sft_dir, root, args.steps), grid))
    if plot_run.main([*runs, "--out", os.path.join(HERE, "figures"), "--group-by-prefix"]):
        return 2  # it printed the one-line reason (a run without metrics.jsonl)
    write_table(runs, "main", os.path.join(ROOT, sft_dir), stats=STATS,
                readme=os.path.join(HERE, "README.md"))
    print(f"long_response done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
