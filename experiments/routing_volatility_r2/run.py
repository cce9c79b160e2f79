"""The arms where the screen says go: GRPO, GRPO + R2, GSPO, GSPO + R2 under a lever that moves
routing between pi_old and the policy being updated, paired by seed.

Usage:
    python -m experiments.routing_volatility_r2.run --candidate top4 --lever noise_1 \
        --seeds 0 1 2 3 4
    python -m experiments.routing_volatility_r2.run --report-only

Each run: experiments/positive_control/rl.yaml (8 prompts x G=8, 4 minibatches, lr 1e-4, 40
rollout batches, test split at the first and last step only) from the candidate's cold start
(`common.CANDIDATES`, the screen's), with the lever (`common.LEVERS`) and the arm; one
`megatron-gspo train` subprocess with 1 torch thread, `--workers` at a time; finished runs are
kept, an interrupted one restarts. Then `report.py --collect` distills runs/ into results/ and
writes the README's tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from experiments.positive_control.common import ROOT, py
from experiments.replay_dose_response.run import finished
from experiments.routing_volatility_r2 import report
from experiments.routing_volatility_r2.common import (CANDIDATES, LEVERS, RL_YAML, RUNS,
                                                      cold_start)

GSPO = ["loss.name=gspo", "loss.eps_low=3e-4", "loss.eps_high=4e-4"]
ARMS = {"grpo": [],  # rl.yaml's loss: GRPO, clip [0.8, 1.27] per token
        "grpo_r2": ["train.routing_replay=r2"],
        "gspo": GSPO,
        "gspo_r2": [*GSPO, "train.routing_replay=r2"]}


def run_dir(candidate: str, lever: str, arm: str, seed: int) -> str:
    return f"{RUNS}/{candidate}/{lever}/{arm}_s{seed}"


def run_one(candidate: str, lever: str, sft_dir: str, arm: str, seed: int,
            extra: list[str]) -> str:
    rd = run_dir(candidate, lever, arm, seed)
    path = os.path.join(ROOT, rd)
    if finished(path):
        return rd
    if os.path.isdir(path):
        shutil.rmtree(path)  # an interrupted run restarts clean
    t0 = time.time()
    py("megatron_gspo.cli", "train", "--config", RL_YAML, *CANDIDATES[candidate],
       *LEVERS[lever], *ARMS[arm], f"seed={seed}", f"init_checkpoint={sft_dir}",
       f"run_dir={rd}", *extra, log=os.path.join(ROOT, RUNS, "logs",
                                                  rd.replace("/", "_") + ".log"))
    print(f"done {rd} in {time.time() - t0:.0f}s", flush=True)
    return rd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidate", choices=sorted(CANDIDATES), default="top4")
    ap.add_argument("--lever", choices=sorted(LEVERS), default="noise_1")
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE for every run")
    args = ap.parse_args(argv)
    if not args.report_only:
        sft_dir, _ = cold_start(args.candidate)
        jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]  # seed-major: paired
        with ThreadPoolExecutor(args.workers) as pool:
            for f in [pool.submit(run_one, args.candidate, args.lever, sft_dir, arm, seed,
                                  args.overrides) for arm, seed in jobs]:
                f.result()
    return report.main(["--collect"])


if __name__ == "__main__":
    raise SystemExit(main())
