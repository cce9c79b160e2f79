"""Peak memory and time of the log-prob pass at a 151,936-token vocabulary on CPU, before and
after the chunks of tokens (`moe.model.logprobs`), in one run.

    python -m bench.logprobs                          # 2 x 512 positions, fp32 and bf16
    python -m bench.logprobs --seqs 1 --positions 2048 --dtypes bf16 --rounds 5

The pass: the sampled tokens' log-probs from the output layer's logits [B, S, V], as the
trainer runs it after the output layer. `pi_old`: no grad, log-probs only (the no-grad pass
over a rollout batch); `loss`: log-probs and entropy, then the backward of a weighted sum
(the loss forward and its backward down to the logits' grad).
  before, fp32: `moe.model.logprobs.plain_token_logprobs` (a float32 log-softmax over [B, S, U]:
                what float32 policies ran);
  before, bf16: `chunked_token_logprobs` chunked by whole sequences, at least one (what 16-bit
                policies ran: at long sequences one sequence a chunk, a float32 [S, U] scratch);
  after:        `chunked_token_logprobs` (chunks of tokens: at most `CHUNK_ELEMENTS` float32
                elements of scratch, 64 MiB).
Each measurement is a fresh child process with one torch thread and a low fixed
`MALLOC_MMAP_THRESHOLD_` (freed tensors leave the resident set): it builds the logits, resets
its peak resident set (`/proc/self/clear_refs`) after a warm-up pass on two positions (one-time
set-up costs), runs the pass once, and reports the peak
resident set above the one before the pass (the logits and targets are already there; the
logits' grad is part of the loss pass) and the seconds. The arms alternate round by round; the
table gives each one's largest peak and median time. Timings on a shared machine: read the
after/before ratios, which come from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, re, sys, time
import torch
import moe.model.logprobs as lp
torch.set_num_threads(1)
a = json.loads(sys.argv[1])
lp.CHUNK_ELEMENTS = a["chunk_elements"] or lp.CHUNK_ELEMENTS
if a["arm"] == "before" and a["dtype"] != "fp32":  # 16-bit logits' chunks before: sequences
    def by_sequence(x_BSV, vocab):
        B, S, _ = x_BSV.shape
        step = max(1, lp.CHUNK_ELEMENTS // max(S * vocab, 1))
        return [slice(i, i + step) for i in range(0, B, step)]
    lp._chunks = by_sequence
fn = lp.plain_token_logprobs if a["arm"] == "before" and a["dtype"] == "fp32" \\
    else lp.chunked_token_logprobs
g = torch.Generator().manual_seed(0)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a["dtype"]]
B, S, V = a["seqs"], a["positions"], a["vocab"]
x_BSV = (torch.randn(B, S, V, generator=g) * 2).to(dtype)
target_BS = torch.randint(0, V, (B, S), generator=g)
w_BS = torch.randn(B, S, generator=g)
def run_pass(x_BSV, target_BS, w_BS):
    if a["pass"] == "pi_old":
        with torch.no_grad():
            fn(x_BSV, target_BS, V, a["temperature"])
        return
    x_BSV = x_BSV.detach().requires_grad_(True)
    logp_BS, _ = fn(x_BSV, target_BS, V, a["temperature"], with_entropy=True)
    (logp_BS * w_BS).sum().backward()
run_pass(x_BSV[:, :2].contiguous(), target_BS[:, :2], w_BS[:, :2])  # one-time set-up costs
def rss(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set restarts from the current one
base = rss("VmRSS")
t0 = time.perf_counter()
run_pass(x_BSV, target_BS, w_BS)
seconds = time.perf_counter() - t0
print(json.dumps({"peak_bytes": rss("VmHWM") - base, "seconds": seconds}))
"""


def measure(args, **arm) -> dict:
    """One child process's pass (see the module docstring)."""
    spec = {"seqs": args.seqs, "positions": args.positions, "vocab": args.vocab,
            "temperature": args.temperature, "chunk_elements": args.chunk_elements, **arm}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args) -> list[dict]:
    """Every (pass, dtype, arm) `args.rounds` times, arms alternating: one row each."""
    results: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for kind in ("pi_old", "loss"):
            for dtype in args.dtypes:
                for arm in ("before", "after"):
                    key = (kind, dtype, arm)
                    results.setdefault(key, []).append(measure(args, **{
                        "pass": kind, "dtype": dtype, "arm": arm}))
    return [{"pass": k[0], "dtype": k[1], "arm": k[2],
             "peak_mib": max(r["peak_bytes"] for r in rs) / 2 ** 20,
             "seconds": statistics.median(r["seconds"] for r in rs)}
            for k, rs in results.items()]


def table(rows: list[dict], args) -> str:
    logits_mib = args.seqs * args.positions * args.vocab * 4 / 2 ** 20
    lines = [f"{args.seqs} x {args.positions} positions, vocabulary {args.vocab:,}, temperature "
             f"{args.temperature}; float32 logits {logits_mib:.0f} MiB; {args.rounds} rounds",
             "| pass | logits | peak MiB before | peak MiB after | after / before | "
             "s before | s after | after / before |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {(r["pass"], r["dtype"], r["arm"]): r for r in rows}
    for kind in ("pi_old", "loss"):
        for dtype in args.dtypes:
            b, a = by[(kind, dtype, "before")], by[(kind, dtype, "after")]
            lines.append(f"| {kind} | {dtype} | {b['peak_mib']:.0f} | {a['peak_mib']:.0f} | "
                         f"{a['peak_mib'] / max(b['peak_mib'], 1e-9):.2f} | "
                         f"{b['seconds']:.2f} | {a['seconds']:.2f} | "
                         f"{a['seconds'] / b['seconds']:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=2, help="sequences B")
    p.add_argument("--positions", type=int, default=512, help="positions S per sequence")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary V (Qwen3's)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk-elements", type=int, default=0,
                   help="float32 elements per chunk (default: moe.model.logprobs.CHUNK_ELEMENTS)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    print(table(rows, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
