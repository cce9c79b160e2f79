"""Iterations per second and the trainer's idle share, synchronous vs rollouts sampled beside
the trainer (`rollout.max_staleness`), side by side in one run.

    python -m bench.staleness                         # vLLM engine server (TP 1): k = 0 vs 1
    python -m bench.staleness --staleness 0 1 2 --rounds 4 --block 6
    python -m bench.staleness --backend lean          # our decoder's weight copy in a thread
    python -m bench.staleness --readme docs/staleness.md    # the report into the page's table

Each side is one trainer (`bench.throughput.build_ours`: qwen3-moe-tiny-hd32 on 2-digit
addition, GSPO, P prompts x G, N minibatches, no flips, no evals) with `rollout.max_staleness`
set to its k. With `--backend vllm-server` (the default) each side has its own engine server
of one worker, both bound to the last core of this process's (`rollout.vllm.cpu_bind`), and the
trainers run on the other cores (the benchmark's thread and every thread it starts, the
producer included, pinned there once the servers are up): the engine on its own core. With
`--backend lean` the producer thread samples with a weight copy in this process, unpinned.

Sides alternate in blocks of `--block` iterations, `--rounds` times; the first iteration of a
block is not measured (a k > 0 side starts a block with a batch it sampled during the block
before), and before each block the other sides finish what they sample (`idle`), so no side's
engine works during another's block. Per iteration: its wall time; the weight push
(`time/weight_sync`: the trainer's own work, at k = 0 inside its rollout, at k > 0 when it
publishes); the trainer's idle time, `time/rollout_wait` less the push (waiting for samples:
the whole sampling at k = 0; the stale-weight guard's probe after a push counts here);
`time/rollout` (the batch's sampling, wherever it ran). Reported: iterations/s (1 / the median
wall), the idle share and the push share (their totals / the total wall), the medians, and k's
ratios to k = 0. No timing is asserted anywhere; on a machine shared with other jobs the
ratios, measured side by side, are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench.throughput import VLLM_PRESET, build_ours, vllm_unavailable
from tools.result_table import add_readme_args, cpu_name, output_into

BACKENDS = {"vllm-server": ("rollout.backend=vllm", "rollout.vllm.mode=server",
                            "rollout.vllm.tensor_parallel_size=1"),
            "lean": ()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=sorted(BACKENDS), default="vllm-server")
    p.add_argument("--staleness", nargs="+", type=int, default=[0, 1])
    p.add_argument("--rounds", type=int, default=3, help="blocks per side")
    p.add_argument("--block", type=int, default=6, help="iterations per block (first unmeasured)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every side (repeatable)")
    add_readme_args(p, "staleness_bench")
    args = p.parse_args(argv)
    if args.block < 2 or args.rounds < 1 or min(args.staleness) < 0:
        p.error("--block must be >= 2, --rounds >= 1, every --staleness >= 0")
    return args


def build_sides(args, tmp: str) -> dict:
    """{k: trainer}; with engine servers, their workers bound to the last core, and this thread
    (and those it starts later) moved to the others once they are up."""
    cores = sorted(os.sched_getaffinity(0))
    engine = BACKENDS[args.backend]
    bind = (f"rollout.vllm.cpu_bind={cores[-1]}",) if engine else ()
    opts = argparse.Namespace(max_new_tokens=args.max_new_tokens, seed=args.seed,
                              with_vllm=True, prompts=args.prompts, group_size=args.group_size,
                              minibatches=args.minibatches, set=args.set, force_length=False)
    sides = {k: build_ours(opts, os.path.join(tmp, f"k{k}"),
                           (*engine, *bind, f"rollout.max_staleness={k}"))[0]
             for k in args.staleness}
    if engine and len(cores) > 1:
        os.sched_setaffinity(0, cores[:-1])
    return sides


def measure(args) -> dict:
    """{k: [(wall, idle, rollout, push) per measured iteration]}, the blocks alternating."""
    out: dict = {k: [] for k in args.staleness}
    with tempfile.TemporaryDirectory(prefix="bench_staleness_") as tmp:
        sides = build_sides(args, tmp)
        try:
            for _ in range(args.rounds):
                for k, trainer in sides.items():
                    for other in sides.values():
                        other.rollouts.idle()
                    for i in range(args.block):
                        t0 = time.perf_counter()
                        m = trainer.iteration()
                        push = m.get("time/weight_sync", 0.0)
                        if i:
                            out[k].append((time.perf_counter() - t0,
                                           m["time/rollout_wait"] - push, m["time/rollout"],
                                           push))
        finally:
            for trainer in sides.values():
                trainer.rollouts.close()
                trainer.rt.close()
    return out


def report(args, res: dict) -> None:
    def stats(rows):
        wall = sum(r[0] for r in rows)
        return (1 / statistics.median(r[0] for r in rows), sum(r[1] for r in rows) / wall,
                sum(r[3] for r in rows) / wall)
    rate0, idle0, _ = stats(res[min(res)])
    print("| rollout.max_staleness | iterations/s (median) | trainer idle share | push share | "
          "s per iteration (median) | sampling s per batch (median) | iterations/s vs "
          f"k = {min(res)} | idle share vs k = {min(res)} |")
    print("|---|---|---|---|---|---|---|---|")
    for k, rows in res.items():
        rate, idle, push = stats(rows)
        print(f"| {k} | {rate:.3f} | {idle:.3f} | {push:.3f} | "
              f"{statistics.median(r[0] for r in rows):.3f} | "
              f"{statistics.median(r[2] for r in rows):.3f} | {rate / rate0:.2f}x | "
              f"{idle / idle0 if idle0 else float('nan'):.2f}x |")
    where = ("one engine server of 1 worker per side, bound to the last core; the trainers "
             "on the others" if BACKENDS[args.backend] else
             "the lean decoder over a weight copy, in a thread of the trainer's process")
    print(f"\nbackend: {args.backend} ({where}); {VLLM_PRESET}, {args.prompts} prompts x "
          f"G={args.group_size}, {args.minibatches} minibatches, max_new_tokens="
          f"{args.max_new_tokens}; {args.rounds} rounds of {args.block}-iteration blocks per "
          f"side, alternating, the first of each block unmeasured ({len(res[min(res)])} measured "
          "each)")
    print(f"machine: {cpu_name('unknown CPU')}, {os.cpu_count()} cores (shared with other "
          "jobs unless stated otherwise)")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if BACKENDS[args.backend] and (why := vllm_unavailable()):
        print(f"--backend {args.backend}: {why}", file=sys.stderr)
        return 2
    res = measure(args)
    with output_into(args.readme, args.marker):
        report(args, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
