"""Rollout seconds of the lean KV-cache decoder vs megatron's static-inference one, side by side.

    python -m bench.decoder                          # 64 x 128-token responses, 6 rounds
    python -m bench.decoder --max-new-tokens 32 --rounds 10 --prompts 4 --group-size 4

One trainer (the `bench.throughput --force-length` set-up: qwen3-moe-tiny, every response
exactly N tokens, 1 torch thread) samples rollout batches with `rollout.decoder=lean`
(`moe.inference.decode.LeanKVDecoder`) and `megatron` (`moe.inference.decode.KVCacheDecoder`) in alternation, after
one warm-up batch each; the policy does not change between them. Prints each decoder's best and
median seconds per rollout batch and the ratio megatron / lean of the best (> 1: lean faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from bench.throughput import build_ours, parse_args as bench_args
from tools.result_table import cpu_name

KINDS = ("lean", "megatron")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6, help="measured batches per decoder")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    bargs = bench_args(["--force-length", "--skip-trl", "--max-new-tokens",
                        str(args.max_new_tokens), "--prompts", str(args.prompts),
                        "--group-size", str(args.group_size)])
    seconds = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench_decoder_") as tmp:
        trainer, _ = build_ours(bargs, tmp + "/run")
        for it in range(args.rounds + 1):
            for kind in KINDS:
                trainer.policy.decoder = kind
                start = time.perf_counter()
                trainer.rollout(it)
                if it:  # round 0 warms up
                    seconds[kind].append(time.perf_counter() - start)
    B = args.prompts * args.group_size
    print(f"machine: {cpu_name('unknown CPU')}; torch {torch.__version__}, 1 thread; "
          f"{B} sequences x {args.max_new_tokens} new tokens; {args.rounds} rounds each, "
          "alternating")
    print("| decoder | best s | median s |\n|---|---|---|")
    for kind in KINDS:
        print(f"| {kind} | {min(seconds[kind]):.3f} | {statistics.median(seconds[kind]):.3f} |")
    print(f"megatron / lean (best): {min(seconds['megatron']) / min(seconds['lean']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
