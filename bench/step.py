"""Forward and backward of one training minibatch: our policy vs HF's Qwen3-MoE, side by side.

    python -m bench.step                        # 4 x 135 and 16 x 135 tokens, 20 rounds
    python -m bench.step --shapes 4x135 --rounds 40
    python -m bench.step --set model.attention=megatron   # ours with other settings
    python -m bench.step --readme experiments/throughput/README.md   # + between markers
    python -m bench.step --pi-old 4096 --shapes 64x24,64x135,64x270 --skip-hf

Isolates the part of a train step that is the model (`bench.throughput` times whole
iterations): token log-probs of a fixed random batch (no padding), their sum, backward. Ours is
the trainer's policy (`MoEPolicy.token_logprobs`, megatron DDP's grad hooks included); HF is the
same-shaped random `Qwen3MoeForCausalLM` the throughput bench gives TRL (SDPA attention, grouped
experts), log-softmax and gather on its logits. The two alternate round by round, one torch
thread; the table reports each side's best round (other jobs only slow a round down) and ours/HF.
No optimizer step: see `bench.throughput` for whole iterations.

`--pi-old N`: also pi_old's no-grad pass over the B sequences (`moe.routing.replay.current_routing`,
routing recorded) in one forward against forwards of at most N tokens
(`train.logprob_max_tokens`), alternating, best round each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from bench.throughput import build_ours, cpu_model, parse_args as bench_args
from bench.trl import hf_model
from moe.routing.replay import chunk_count, current_routing
from tools.result_table import add_readme_args, output_into


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4x135,16x135", help="BxT minibatches (comma list)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per side and shape")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for our side (repeatable)")
    p.add_argument("--pi-old", type=int, default=0, metavar="N",
                   help="also time pi_old's pass in one forward vs forwards of <= N tokens")
    p.add_argument("--skip-hf", action="store_true", help="no forward + backward table")
    add_readme_args(p, "bench_step")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes={args.shapes!r}: expected e.g. 4x135,16x135")
    if any(len(s) != 2 or s[0] < 1 or not 2 <= s[1] <= 272 for s in args.shapes):
        p.error(f"--shapes={args.shapes}: B >= 1 and 2 <= T <= 272")
    if args.pi_old < 0 or (args.skip_hf and not args.pi_old):
        p.error(f"--pi-old={args.pi_old}: expected N >= 1 (or 0 = off, then without --skip-hf)")
    return args


def best_of(rounds: int, fns: dict, warmup: int = 1) -> dict:
    """{name: best seconds per phase} of the zero-argument `fns` (each returns its phases'
    seconds, `wall` / `timed`), alternating, after `warmup` unmeasured rounds."""
    best = {}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            seconds = fn()
            if r >= warmup:
                best[name] = tuple(map(min, best.get(name, seconds), seconds))
    return best


def wall(fn) -> tuple[float]:
    """(seconds,) of one call."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0,)


def pi_old_rows(policy, shapes, budget: int, rounds: int) -> list[str]:
    """Markdown rows: pi_old's pass in one forward vs in forwards of <= `budget` tokens."""
    rows = [f"| B x T | one forward ms | forwards of <= {budget} tokens ms | forwards | "
            "one / chunked |", "|---|---|---|---|---|"]
    for B, T in shapes:
        tokens_BT = torch.randint(3, policy.real_vocab, (B, T),
                                  generator=torch.Generator().manual_seed(1))
        valid_BT = torch.ones(B, T, dtype=torch.bool)
        n = chunk_count(B, T, budget)
        best = best_of(rounds, {k: lambda k=k: wall(lambda: current_routing(
            policy, tokens_BT, valid_BT, n_chunks=k)) for k in sorted({1, n})})
        (one,), (chunked,) = best[1], best[n]
        rows.append(f"| {B} x {T} | {one * 1e3:.1f} | {chunked * 1e3:.1f} | {n} | "
                    f"{one / chunked:.2f} |")
    return rows


def timed(fn) -> tuple[float, float]:
    """(forward s, backward s) of one round."""
    t0 = time.perf_counter()
    loss = fn()
    t1 = time.perf_counter()
    loss.backward()
    return t1 - t0, time.perf_counter() - t1


def hf_rows(policy, shapes, rounds: int) -> list[str]:
    """Markdown rows: forward and backward of ours vs HF's model per BxT shape."""
    hf = hf_model(policy.preset, "grouped_mm")
    hf.config._attn_implementation = "sdpa"
    hf.train()
    rows = ["| B x T | ours fwd ms | ours bwd ms | HF fwd ms | HF bwd ms | ours/HF time |",
            "|---|---|---|---|---|---|"]
    for B, T in shapes:
        g = torch.Generator().manual_seed(0)
        tokens_BT = torch.randint(3, policy.real_vocab, (B, T), generator=g)
        valid_BT = torch.ones(B, T, dtype=torch.bool)

        def ours():
            policy.zero_grad()
            return policy.token_logprobs(tokens_BT, valid_BT).sum()

        def theirs():
            hf.zero_grad()
            logits = hf(input_ids=tokens_BT).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(-1, tokens_BT[:, 1:, None]).sum()

        best = best_of(rounds, {"ours": lambda: timed(ours), "hf": lambda: timed(theirs)},
                       warmup=2)
        (of, ob), (hf_f, hf_b) = best["ours"], best["hf"]
        rows.append(f"| {B} x {T} | {of * 1e3:.1f} | {ob * 1e3:.1f} | {hf_f * 1e3:.1f} | "
                    f"{hf_b * 1e3:.1f} | {(of + ob) / (hf_f + hf_b):.2f} |")
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    longest = max(t for _, t in args.shapes)
    tables = []
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        trainer, _ = build_ours(bench_args(["--skip-trl", "--max-new-tokens", str(longest - 8)]
                                           + [f"--set={s}" for s in args.set]), tmp + "/run")
        if not args.skip_hf:
            tables.append(hf_rows(trainer.policy, args.shapes, args.rounds))
        if args.pi_old:
            tables.append(pi_old_rows(trainer.policy, args.shapes, args.pi_old, args.rounds))
        trainer.rt.close()
    with output_into(args.readme, args.marker):
        print(f"machine: {cpu_model()}, 1 torch thread; best of {args.rounds} alternating "
              f"rounds; ours overrides: {' '.join(args.set) or 'none'}")
        for rows in tables:
            print("\n" + "\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
