"""The positive control's arms: GRPO with and without Routing Replay, and GSPO, under a routing
disagreement between the sampler and the trainer (or a volatile trainer routing).

Usage:
    python -m experiments.positive_control.run --lever engine --levels 0.3 --seeds 0 1 2
    python -m experiments.positive_control.run --lever engine --levels 0.3 --arms grpo grpo_r3
    python -m experiments.positive_control.run --series rescore --levels 0.3 --arms grpo_sl
    python -m experiments.positive_control.run --report-only

Levers (`--lever`):
- `engine`: `rollout.decoders.router_noise_std` = level: the sampler's routers pick their top-k from
  noisy logits in rollouts and evaluations (an inference engine whose routing differs from the
  trainer's, as a bf16 engine's does at scale; the R3 paper's setting). R3 replays the routing
  the sampler used; R2 and no replay route cleanly in the trainer. Every arm is evaluated by
  that sampler, as an engine serves the policy.
- `trainer`: `train.router_noise_std` = level: noisy top-k in the loss's forward only (the GSPO
  paper's expert volatility between pi_old and the policy being updated; R2 removes it).

Each run: rl.yaml from the candidate's cold start (`--candidate`, the screen's), one
`megatron-gspo train` subprocess with 1 torch thread, `--workers` at a time; runs already
finished are kept. `--series NAME`: a series of its own, from its own cold start, under
runs/positive_control/NAME/ (the first series has none). The report (`report.py`) reads
runs/positive_control/[NAME/]<lever>/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

from experiments.positive_control import report
from experiments.positive_control.common import (CANDIDATES, HERE, ROOT, cold_start, py,
                                                 series_root)
from experiments.replay_dose_response.run import finished

GRPO = ["loss.name=grpo", "loss.eps_low=0.2", "loss.eps_high=0.27"]
ARMS = {"grpo_clean": GRPO,  # the lever at 0 (its level is ignored): the reference
        "grpo": GRPO,
        "grpo_r2": [*GRPO, "train.routing_replay=r2"],
        "grpo_r3": [*GRPO, "train.routing_replay=r3"],
        "grpo_tis": [*GRPO, "loss.tis_cap=2.0"],
        "gspo": ["loss.name=gspo", "loss.eps_low=3e-4", "loss.eps_high=4e-4"]}
ARMS["gspo_r3"] = [*ARMS["gspo"], "train.routing_replay=r3"]
# pi_old = the sampler's own log-probs (no recompute; the GSPO paper's sec. 4.3 suggestion)
SL = ["rollout.use_sampler_logprobs=true"]
ARMS.update({"gspo_sl": [*ARMS["gspo"], *SL], "gspo_sl_r3": [*ARMS["gspo"], *SL,
                                                             "train.routing_replay=r3"],
             "grpo_sl": [*GRPO, *SL], "grpo_sl_r3": [*GRPO, *SL, "train.routing_replay=r3"],
             # dual-clip PPO at verl's default c: negative-advantage ratios above 3 held at 3 A
             "grpo_sl_dual": [*GRPO, *SL, "loss.dual_clip=3.0"]})
LEVERS = {"engine": ("rollout.decoders.router_noise_std",
                     ["rollout.decoders.router_noise=fixed"]),
          "engine_fresh": ("rollout.decoders.router_noise_std",
                           ["rollout.decoders.router_noise=fresh"]),
          "trainer": ("train.router_noise_std", [])}


def run_dir(lever: str, candidate: str, arm: str, level: float, seed: int,
            series: str = "") -> str:
    tag = "" if candidate == "top4" else f"{candidate}/"
    lv = "0" if arm == "grpo_clean" else f"{level:g}"
    return f"{series_root(series)}/{lever}/{tag}{arm}_n{lv}_s{seed}"


def run_one(lever: str, candidate: str, sft_dir: str, arm: str, level: float, seed: int,
            extra: list[str], series: str = "") -> str:
    rd = run_dir(lever, candidate, arm, level, seed, series)
    path = os.path.join(ROOT, rd)
    if finished(path):
        return rd
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "checkpoints", "latest")):
        shutil.rmtree(path)  # an interrupted run restarts clean (a saved one resumes)
    t0 = time.time()
    key, how = LEVERS[lever]
    py("megatron_gspo.cli", "train", "--config", os.path.join(HERE, "rl.yaml"),
       *CANDIDATES[candidate], *ARMS[arm], *how,
       f"{key}={0.0 if arm == 'grpo_clean' else level}", f"seed={seed}",
       f"init_checkpoint={sft_dir}", f"run_dir={rd}", *extra,
       log=os.path.join(ROOT, series_root(series), "logs", rd.replace("/", "_") + ".log"))
    print(f"done {rd} in {time.time() - t0:.0f}s", flush=True)
    return rd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lever", choices=sorted(LEVERS), default="engine")
    ap.add_argument("--candidate", choices=sorted(CANDIDATES), default="top4")
    ap.add_argument("--levels", nargs="+", type=float, default=[0.3])
    ap.add_argument("--arms", nargs="+", choices=sorted(ARMS),
                    default=["grpo_clean", "grpo", "grpo_r2", "grpo_r3", "gspo"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--series", default="", help="a series of its own (its own cold start)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra KEY=VALUE for every run")
    args = ap.parse_args(argv)
    if not args.report_only:
        sft_dir, _ = cold_start(args.candidate, args.series)
        jobs = sorted({(arm, 0.0 if arm == "grpo_clean" else lv, seed)
                       for seed in args.seeds for lv in args.levels for arm in args.arms},
                      key=lambda j: (j[2], j[0], j[1]))
        with ThreadPoolExecutor(args.workers) as pool:
            for f in [pool.submit(run_one, args.lever, args.candidate, sft_dir, arm, lv, seed,
                                  args.overrides, args.series) for arm, lv, seed in jobs]:
                f.result()
    return report.main(["--collect"])


if __name__ == "__main__":
    raise SystemExit(main())
