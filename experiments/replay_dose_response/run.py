"""Routing Replay dose-response: GRPO, GRPO + R2 and GSPO under calibrated routing volatility.

Usage:
    python -m experiments.replay_dose_response.run             # full grid (README's numbers)
    python -m experiments.replay_dose_response.run --quick     # 1 seed, 2 levels, 3 batches
    python -m experiments.replay_dose_response.run --plot-only # table + figure from the runs
    python -m experiments.replay_dose_response.run --workers 1 --seeds 0 1 2 3

1. The cold start: the ablation's SFT checkpoint (runs/ablation/sft, experiments/ablation/
   sft.yaml), built if absent, shared by every run.
2. Calibration (`calibrate.py`): on one rollout batch of the cold start, the router-noise std
   that flips 1%, 3% and 10% of the loss positions' expert activations.
3. The grid: GRPO and GSPO at noise 0 and the three calibrated stds; GRPO + R2 once per seed,
   because under replay the noise has no effect by construction (`moe.routing.noise`), so its
   runs at every level are the same run. Then a real train-inference mismatch at noise 0: the
   sampler under bf16 autocast (`rollout.decoders.sampler_dtype=bf16`) with GRPO, GRPO + R3 and
   GRPO + TIS (`loss.tis_cap=2`). Each run: rl.yaml (8 minibatches per rollout batch),
   `--workers` runs at a time, each a `megatron-gspo train` subprocess with 1 torch thread.
4. Summary: per run, the last held-out eval accuracy, the mean measured per-step flip rate on
   the loss positions (`moe/flip_rate/mean`), GRPO's token clip fraction and the routing-induced
   |log-ratio| (`policy/log_ratio/abs_mean` on each rollout batch's first minibatch, where
   pi == pi_old). The Markdown table goes between the README's `<!-- table:dose:... -->` markers
   and to runs/replay_dose_response/table.md; the figure to figures/dose_response.png (--quick:
   tables and figure only under runs/replay_dose_response_quick).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

from experiments.replay_dose_response import report
from megatron_gspo.jobs.band import cold_start_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = "runs/replay_dose_response"
SFT_DIR = "runs/ablation/sft"
ARMS = {"grpo": ["loss.name=grpo", "loss.eps_low=0.2", "loss.eps_high=0.27"],
        "grpo_r2": ["loss.name=grpo", "loss.eps_low=0.2", "loss.eps_high=0.27",
                    "train.routing_replay=r2"],
        "gspo": ["loss.name=gspo", "loss.eps_low=3e-4", "loss.eps_high=4e-4"]}
TARGETS = (0.01, 0.03, 0.1)
# The precision mismatch (noise 0): the sampler under bf16 autocast, the trainer fp32.
BF16 = ["rollout.decoders.sampler_dtype=bf16"]
MISMATCH_ARMS = {"grpo_bf16": [*ARMS["grpo"], *BF16],
                 "grpo_r3_bf16": [*ARMS["grpo"], *BF16, "train.routing_replay=r3"],
                 "grpo_tis_bf16": [*ARMS["grpo"], *BF16, "loss.tis_cap=2.0"]}


def py(*args: str, log: str | None = None) -> None:
    """`python -m ...` from the repo root with one torch thread; output to `log` if given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    if log is None:
        subprocess.run(cmd, cwd=ROOT, check=True, env=env)
        return
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=ROOT, check=True, env=env, stdout=f, stderr=subprocess.STDOUT)


def levels(calib: dict, quick: bool, targets=None) -> dict[str, float]:
    """{level label: noise std}: 0 and each calibrated target (of `targets`, default all)."""
    out = {"n0": 0.0}
    for t in TARGETS[-1:] if quick else (targets or TARGETS):
        out[f"f{round(t * 100):02d}"] = calib["targets"][str(t)]
    return out


def jobs(lv: dict[str, float], seeds, mismatch: bool) -> list[tuple[str, str, float, int]]:
    """(arm, level, std, seed) per run; GRPO + R2 only at n0 (noise-independent); with
    `mismatch`, the bf16-sampler arms (level "mm", noise 0) after the grid."""
    out = []
    for seed in seeds:
        for level, std in lv.items():
            for arm in ARMS:
                if arm != "grpo_r2" or level == "n0":
                    out.append((arm, level, std, seed))
    if mismatch:
        out += [(arm, "mm", 0.0, seed) for seed in seeds for arm in MISMATCH_ARMS]
    return out


def finished(path: str) -> bool:
    """Whether the run in `path` saved its last rollout batch: `latest` is its train.steps (a
    Ctrl-C or SIGTERM saves an earlier one)."""
    try:
        with open(os.path.join(path, "checkpoints", "latest")) as f:
            step = int(f.read())
        with open(os.path.join(path, "train_config.yaml")) as f:
            return step >= int(yaml.safe_load(f)["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_one(job, root: str, extra: list[str], config: str = os.path.join(HERE, "rl.yaml")) -> str:
    arm, level, std, seed = job
    run_dir = f"{root}/{arm}_{level}_s{seed}" if level != "mm" else f"{root}/{arm}_s{seed}"
    path = os.path.join(ROOT, run_dir)
    if finished(path):
        return run_dir
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "checkpoints", "latest")):
        shutil.rmtree(path)  # an interrupted run restarts clean
    # (one a signal stopped saved a checkpoint: the same command resumes it)
    t0 = time.time()
    py("megatron_gspo.cli", "train", "--config", config,
       *{**ARMS, **MISMATCH_ARMS}[arm],
       f"train.router_noise_std={std}", f"seed={seed}", f"run_dir={run_dir}", *extra,
       log=os.path.join(ROOT, root, "logs", os.path.basename(run_dir) + ".log"))
    print(f"done {run_dir} in {time.time() - t0:.0f}s", flush=True)
    return run_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: seed 0, levels n0 and f10, 3 rollout batches, 64 evals")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--no-mismatch", action="store_true",
                    help="skip the bf16-sampler arms (GRPO, GRPO + R3, GRPO + TIS)")
    ap.add_argument("--sft-dir", default=SFT_DIR,
                    help="cold-start checkpoint (built with experiments/ablation/sft.yaml if "
                         "absent)")
    ap.add_argument("--config", default=os.path.join(HERE, "rl.yaml"),
                    help="the RL recipe (rl_long.yaml: running_sum's 61-71-token answers)")
    ap.add_argument("--tag", default="",
                    help="variant: runs/replay_dose_response_TAG, README markers dose_TAG, "
                         "figure dose_response_TAG.png")
    ap.add_argument("--targets", nargs="+", type=float, default=None,
                    help=f"flip-rate targets to calibrate and run (default {TARGETS})")
    args = ap.parse_args(argv)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    tag = f"_{args.tag}" if args.tag else ""
    root = RUNS + tag + ("_quick" if args.quick else "")
    # the smoke test's 64-prompt eval is not the one the band is defined on: no band check
    extra = ["train.steps=3", "train.eval_every=3", "train.save_every=3", "task.n_eval=64",
             "train.start_accuracy=null"] if args.quick else []
    calib_path = os.path.join(ROOT, root, "calibration.json")
    t0 = time.time()
    if not args.plot_only:
        os.makedirs(os.path.join(ROOT, root, "logs"), exist_ok=True)
        if not os.path.exists(os.path.join(ROOT, args.sft_dir, "checkpoints", "latest")):
            py("megatron_gspo.cli", "sft", "--config",
               os.path.join(ROOT, "experiments/ablation/sft.yaml"), f"run_dir={args.sft_dir}")
        if not os.path.exists(calib_path):
            py("experiments.replay_dose_response.calibrate", "--config", args.config,
               "--out", calib_path, f"init_checkpoint={args.sft_dir}")
        with open(calib_path) as f:
            calib = json.load(f)
        grid = jobs(levels(calib, args.quick, args.targets), seeds, not args.no_mismatch)
        print(f"{len(grid)} runs, {args.workers} at a time", flush=True)
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(lambda j: run_one(j, root, [f"init_checkpoint={args.sft_dir}",
                                                      *extra], args.config), grid))

    cold = cold_start_line(os.path.join(ROOT, args.sft_dir)).replace(ROOT + os.sep, "")
    report.main(os.path.join(ROOT, root), calib_path,
                readme=None if args.quick else os.path.join(HERE, "README.md"),
                figure_path=os.path.join(ROOT, root, "dose_response.png") if args.quick
                else os.path.join(HERE, "figures", f"dose_response{tag}.png"),
                marker="dose" + tag, cold_start=cold)
    print(f"dose-response done in {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
