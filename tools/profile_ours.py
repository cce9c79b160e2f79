"""torch.profiler top-10 of our GSPO iteration at a forced response length (bench set-up).

    python -m tools.profile_ours                           # 64 x 128-token responses
    python -m tools.profile_ours --max-new-tokens 32 --iterations 1 --top 15
    python -m tools.profile_ours --readme experiments/throughput/README.md --marker profile_after

Same trainer and overrides as `tools.bench_throughput --force-length --skip-trl` (qwen3-moe-tiny,
8 prompts x G=8, 4 minibatches, flip_every=0, 1 thread). After `--warmup` iterations, two
profiler sessions: (1) `--iterations` rollouts (KV-cache sampling + reward), (2) as many
iterations on a fixed, already sampled batch (pi_old pass + 4 optimizer steps). Prints for each
the operators with the largest self CPU time (markdown, as experiments/throughput/README.md
shows them) and the trainer's own phase timings (slower than unprofiled runs).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from tools.bench_throughput import build_ours, cpu_model, parse_args as bench_args
from tools.result_table import add_readme_args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--iterations", type=int, default=2, help="profiled iterations per session")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=10, help="rows per table")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override (repeatable)")
    add_readme_args(p, "profile")
    return p.parse_args(argv)


def top_table(prof, n: int) -> str:
    """Markdown: the n operators with the largest self CPU time."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1.0
    out = ["| operator | self CPU ms | % | calls |", "|---|---|---|---|"]
    for e in rows:
        out.append(f"| `{e.key}` | {e.self_cpu_time_total / 1e3:.1f} | "
                   f"{100 * e.self_cpu_time_total / total:.1f} | {e.count} |")
    out.append(f"| total | {total / 1e3:.1f} | 100 | "
               f"{sum(e.count for e in prof.key_averages())} |")
    return "\n".join(out)


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    args = parse_args(argv)
    bargs = bench_args(["--force-length", "--skip-trl", "--max-new-tokens",
                        str(args.max_new_tokens)] + [f"--set={s}" for s in args.set])
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="profile_ours_") as tmp:
        trainer, overrides = build_ours(bargs, tmp + "/run")
        for _ in range(args.warmup):
            trainer.iteration()
        it = trainer.state.iteration
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as rollout_prof:
            batches = [trainer.rollout(it + i) for i in range(args.iterations)]
        rollout_s = (time.perf_counter() - t0) / args.iterations
        trainer.rollout = lambda i: batches[0]
        with profile(activities=[ProfilerActivity.CPU]) as train_prof:
            timings = [trainer.iteration() for _ in range(args.iterations)]
        trainer.rt.close()
    text = "\n".join([
        f"machine: {cpu_model()}; torch {torch.__version__}, 1 thread; {len(batches[0])} "
        f"sequences x {args.max_new_tokens} new tokens; overrides: {' '.join(overrides[1:])}",
        f"\nrollout ({args.iterations} batches), top {args.top} by self CPU time:\n",
        top_table(rollout_prof, args.top),
        f"\npi_old pass + 4 optimizer steps ({args.iterations} iterations), top {args.top} "
        "by self CPU time:\n",
        top_table(train_prof, args.top),
        f"\nprofiled seconds per iteration: rollout {rollout_s:.3f}; " + "; ".join(
            f"{k} {sum(t[f'time/{k}'] for t in timings) / len(timings):.3f}"
            for k in ("old_forward", "train"))])
    print(text)
    if args.readme:
        from tools.result_table import write_into

        write_into(args.readme, text, args.marker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
