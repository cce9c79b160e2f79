"""Staleness 0, 1, 2 x {GRPO, GRPO + R3, GSPO} from the positive control's cold start.

Usage:
    python -m experiments.staleness.run                        # every arm, k and seed
    python -m experiments.staleness.run --staleness 1 --arms grpo grpo_r3 --seeds 0 1
    python -m experiments.staleness.run --report-only          # tables from results/

Each run: rl.yaml (the positive control's recipe with TIS at cap 2, the decoupled objective's
correction) from the positive control's cold start (`experiments.positive_control.common.
cold_start`: SFT on running_sum until validation accuracy enters [0.25, 0.45]), with
`rollout.max_staleness=k`: rollout batch j sampled by the lean decoder over a weight copy of
its own, in a thread beside the trainer, by the weights of version max(0, j - k). One
`megatron-gspo train` subprocess with one torch thread, `--workers` at a time; finished runs
are kept. The report (`report.py`) reads runs/staleness/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from experiments.positive_control.common import ROOT, cold_start, py
from experiments.replay_dose_response.run import finished
from experiments.staleness import report

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "rl.yaml")
RUNS = "runs/staleness"
GRPO = ["loss.name=grpo", "loss.eps_low=0.2", "loss.eps_high=0.27"]
ARMS = {"grpo": GRPO,
        "grpo_r3": [*GRPO, "train.routing_replay=r3"],
        "gspo": ["loss.name=gspo", "loss.eps_low=3e-4", "loss.eps_high=4e-4"]}


def run_dir(arm: str, k: int, seed: int) -> str:
    return f"{RUNS}/{arm}_k{k}_s{seed}"


def run_one(sft_dir: str, arm: str, k: int, seed: int, extra: list[str]) -> str:
    rd = run_dir(arm, k, seed)
    path = os.path.join(ROOT, rd)
    if finished(path):
        return rd
    if os.path.isdir(path):  # an interrupted run starts again clean (its queue is gone)
        shutil.rmtree(path)
    t0 = time.time()
    py("megatron_gspo.cli", "train", "--config", CONFIG, *ARMS[arm],
       f"rollout.max_staleness={k}", f"seed={seed}", f"init_checkpoint={sft_dir}",
       f"run_dir={rd}", *extra, log=os.path.join(ROOT, RUNS, "logs", rd.replace("/", "_") + ".log"))
    print(f"done {rd} in {time.time() - t0:.0f}s", flush=True)
    return rd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE for every run")
    args = ap.parse_args(argv)
    if not args.report_only:
        sft_dir, _ = cold_start("top4")
        jobs = [(arm, k, seed) for seed in args.seeds for k in args.staleness
                for arm in args.arms]
        with ThreadPoolExecutor(args.workers) as pool:
            for f in [pool.submit(run_one, sft_dir, *job, args.overrides) for job in jobs]:
                f.result()
    return report.main(["--collect"])


if __name__ == "__main__":
    raise SystemExit(main())
