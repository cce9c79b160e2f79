"""Routing Replay cache memory (analytic, checked against a real run) and its time overhead.

Usage:
    python -m tools.replay_memory                       # qwen3-30b-a3b table + tiny-scale check
    python -m tools.replay_memory --preset small --prompts 64 --group 8 --tokens 2048
    python -m tools.replay_memory --measure-only        # just the measured tiny-scale part

The cache (`moe.model.memory.replay_cache_bytes`, shared with `megatron-gspo plan`) keeps, for every
valid token of a rollout batch, the K expert ids chosen at each of the
L MoE layers: bytes = tokens x L x K x itemsize, with itemsize 1 (uint8) for <= 256 experts and
2 (int16) above. Valid tokens only: the table gives every row at full length (the bound) and at
real lengths (`--real`: rows of that fraction of the full length on average). megatron's recorded indices are int64, so the compact cache is 8x smaller than
keeping them as recorded (4x above 256 experts). The cache is rank-local: a DP rank stores only
its own rows and, under sequence parallel, only its sequence shard.

The measured part builds `qwen3-moe-tiny` on CPU, records a padded batch, and checks that the
cache's real byte count equals the formula; then it times, side by side in one run, a training
forward/backward with and without replay and the flip measurement against a train step, and
prints the ratios (absolute CPU times are noise; ratios measured together are not).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

warnings.filterwarnings("ignore")  # megatron's install notes at import: before the imports below

import torch  # noqa: E402

from moe.model.memory import GIB, replay_cache_bytes  # noqa: E402 (the formula `plan` uses too)
from moe.platform.parallel import init_parallel  # noqa: E402
from moe.model.policy import MoEPolicy, OptimSettings  # noqa: E402
from moe.model.presets import get_preset  # noqa: E402
from moe.routing.replay import current_routing, replay_routing  # noqa: E402
from moe.model.settings import ParallelLayout  # noqa: E402
from tools.result_table import output_into  # noqa: E402

cache_bytes = replay_cache_bytes  # tokens x layers x K x itemsize (None: the compact dtype)


def table(preset_name: str, prompts: list[int], group: int, seq_tokens: list[int], dp: int,
          real: float = 0.25) -> str:
    """Cache sizes at full length (every row tokens/seq: the bound) and, in the last two
    columns, at real lengths: rows of `real` x tokens/seq on average (the cache holds real
    tokens only)."""
    p = get_preset(preset_name)
    compact = "uint8" if p.num_experts <= 256 else "int16"
    rows = [f"Routing Replay cache for {p.name}: L={p.num_layers} layers, K={p.topk} of "
            f"E={p.num_experts} experts, stored as {compact}; real: rows of {real:g} x tokens/seq "
            "on average",
            f"{'prompts':>8} {'G':>4} {'tokens/seq':>10} {'tokens':>14} {compact + ' GiB':>11} "
            f"{'int32 GiB':>10} {'int64 GiB':>10} {f'per DP rank (dp={dp}) GiB':>26} "
            f"{'real GiB':>9} {'real per DP rank':>17}"]
    for n in prompts:
        for t in seq_tokens:
            tokens = n * group * t
            c = cache_bytes(tokens, p.num_layers, p.topk, p.num_experts)
            i32 = cache_bytes(tokens, p.num_layers, p.topk, p.num_experts, 4)
            i64 = cache_bytes(tokens, p.num_layers, p.topk, p.num_experts, 8)
            r = cache_bytes(round(tokens * real), p.num_layers, p.topk, p.num_experts)
            rows.append(f"{n:>8} {group:>4} {t:>10} {tokens:>14,} {c / GIB:>11.2f} "
                        f"{i32 / GIB:>10.2f} {i64 / GIB:>10.2f} {c / dp / GIB:>26.3f} "
                        f"{r / GIB:>9.2f} {r / dp / GIB:>17.3f}")
    return "\n".join(rows)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(batch: int = 32, seq: int = 24, repeats: int = 7) -> dict:
    """Build qwen3-moe-tiny, check measured cache bytes == formula, time the overheads."""
    init_parallel(1, 1, seed=0)
    preset = get_preset("qwen3-moe-tiny")
    policy = MoEPolicy.build(preset, ParallelLayout(), real_vocab=preset.vocab_size,
                             optim=OptimSettings(lr=0.0))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, preset.vocab_size, (batch, seq), generator=g)
    valid = torch.ones(batch, seq, dtype=torch.bool)
    for b in range(batch):  # ragged left and right padding
        valid[b, : b % 5] = False
        valid[b, seq - (b % 3):] = False
    _, cache = current_routing(policy, tokens, valid)
    n_valid = int(valid.sum())
    formula = cache_bytes(n_valid, preset.num_layers, preset.topk, preset.num_experts)
    out = {"valid_tokens": n_valid, "measured_bytes": cache.nbytes, "formula_bytes": formula,
           "int64_bytes": n_valid * preset.num_layers * preset.topk * 8}

    def train_fwd_bwd(replay):
        policy.zero_grad()
        with replay_routing(policy, cache if replay else None):
            logp = policy.token_logprobs(tokens, valid)
        (logp * valid).sum().backward()

    def flip_measure():
        current_routing(policy, tokens, valid)

    for fn in (lambda: train_fwd_bwd(False), lambda: train_fwd_bwd(True), flip_measure):
        fn()  # warm-up
    # interleave the variants so machine noise hits them alike
    base, replay, flips = [], [], []
    for _ in range(repeats):
        base.append(_median_time(lambda: train_fwd_bwd(False), 1))
        replay.append(_median_time(lambda: train_fwd_bwd(True), 1))
        flips.append(_median_time(flip_measure, 1))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out.update(train_step_s=med(base), replay_step_s=med(replay), flip_measure_s=med(flips))
    out["replay_time_ratio"] = out["replay_step_s"] / out["train_step_s"]
    out["flip_time_ratio"] = out["flip_measure_s"] / out["train_step_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--dp", type=int, default=64, help="data-parallel ranks sharing the batch")
    ap.add_argument("--real", type=float, default=0.25,
                    help="the real-length columns: a mean row this fraction of tokens/seq (a "
                         "quarter: the long tail of reasoning RL)")
    ap.add_argument("--measure-only", action="store_true")
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--readme", default=None, metavar="PATH",
                    help="also write the report between PATH's <!-- table:replay_memory:begin/end "
                         "--> markers (tools/result_table.py)")
    args = ap.parse_args(argv)

    with output_into(args.readme, "replay_memory"):
        ok = report(args)
    return 0 if ok else 1


def report(args) -> bool:
    """Print the table and the tiny-scale measurement; False if the cache disagrees with the
    formula."""
    if not args.measure_only:
        print(table(args.preset, args.prompts, args.group, args.tokens, args.dp, args.real))
    if args.no_measure:
        return True
    m = measure()
    ok = m["measured_bytes"] == m["formula_bytes"]
    print(f"\nmeasured at tiny scale (qwen3-moe-tiny, {m['valid_tokens']} valid tokens): "
          f"cache {m['measured_bytes']} B, formula {m['formula_bytes']} B -> "
          f"{'agree' if ok else 'DISAGREE'}; as int64 it would be {m['int64_bytes']} B "
          f"({m['int64_bytes'] / m['measured_bytes']:.0f}x)")
    print(f"time, measured side by side: train fwd+bwd {m['train_step_s'] * 1e3:.1f} ms; "
          f"with replay x{m['replay_time_ratio']:.2f}; flip measurement (1 no-grad fwd) "
          f"x{m['flip_time_ratio']:.2f} of a train fwd+bwd")
    return ok


if __name__ == "__main__":
    sys.exit(main())
