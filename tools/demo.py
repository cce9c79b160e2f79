"""The CPU demo: cold-start SFT of qwen3-moe-tiny, then a short GSPO run; prints test accuracy.

Usage:
    python -m tools.demo                 # what `make demo` runs (a few minutes on 2 cores)
    python -m tools.demo --fresh         # delete runs/demo first
    python -m tools.demo train.steps=4   # overrides go to the GSPO run

SFT runs until the validation accuracy enters experiments/ablation/sft.yaml's band (the same on
any CPU; the step count is this machine's) and is skipped when runs/demo/sft already holds a
checkpoint; the GSPO run refuses to start outside the band. Prints the cold start (its run, step,
start accuracy and the SFT step that reached it), and the test split's accuracy before and after
RL: the band chose on the validation split, so the test split reports without having chosen.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings

warnings.filterwarnings("ignore")

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                    "demo")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    from megatron_gspo.jobs.band import cold_start_line
    from megatron_gspo.run.checkpoint import latest_step
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.run.metrics import read_jsonl
    from megatron_gspo.jobs.sft import run_sft
    from megatron_gspo.jobs.rl import Trainer

    sft_cfg = load_config(os.path.join(HERE, "sft.yaml"))
    rl_cfg = load_config(os.path.join(HERE, "gspo.yaml"), args.overrides)
    if args.fresh:
        shutil.rmtree("runs/demo", ignore_errors=True)
    t0 = time.time()
    band = sft_cfg.sft.target_accuracy
    if latest_step(os.path.join(sft_cfg.run_dir, "checkpoints")) is None:
        print(f"== cold-start SFT until validation accuracy is in [{band[0]}, {band[1]}] (at most "
              f"{sft_cfg.sft.steps} steps) -> {sft_cfg.run_dir}")
        run_sft(sft_cfg)
    else:
        print(f"== reusing the SFT checkpoint in {sft_cfg.run_dir}")
    print(cold_start_line(sft_cfg.run_dir))
    print(f"== GSPO ({rl_cfg.train.steps} rollout batches x {rl_cfg.train.num_minibatches} "
          f"minibatches) -> {rl_cfg.run_dir}")
    shutil.rmtree(rl_cfg.run_dir, ignore_errors=True)
    Trainer.from_config(rl_cfg).train()
    tests = [r for r in read_jsonl(os.path.join(rl_cfg.run_dir, "metrics.jsonl"))
             if "test/accuracy" in r]  # the initial policy's and the last step's
    before, after = tests[0]["test/accuracy"], tests[-1]["test/accuracy"]
    print(f"\ntest accuracy ({rl_cfg.task.name}, {rl_cfg.task.n_test} test prompts, greedy; the "
          f"band [{band[0]}, {band[1]}] chose the cold start on {rl_cfg.task.n_val} validation "
          f"prompts): before RL {before:.3f} -> after {after:.3f}   "
          f"[{time.time() - t0:.0f}s total]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
