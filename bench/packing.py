"""Sequence packing: a rollout batch's pi_old pass and optimizer steps, padded vs packed, and TRL's
GRPOTrainer on the same batch, side by side in one run.

    python -m bench.packing                                   # both presets, both points, TRL
    python -m bench.packing --presets qwen3-moe-tiny --rounds 3 --skip-trl
    python -m bench.packing --readme experiments/packing/README.md   # + between its markers

A fixed synthetic rollout batch (no sampling: the lengths are the point): `--prompts` x G rows of
a `--prompt-tokens` prompt and a response of at most `--max-new-tokens` random tokens, at two
points: (a) equal lengths, every response the maximum (packing can only cost here: the goal is
at most 5%), (b) a long tail, lognormal response lengths (sigma `--sigma`) whose mean is a
quarter of the maximum, clipped to [1, max] (the shape of reasoning RL: most answers far shorter
than the limit). The unit timed is what follows a rollout: `Trainer.prepare` (the pi_old pass,
routing recorded, advantages) and `train.num_minibatches` optimizer steps (`Trainer.train_step`:
forwards, backwards, Adam; flips off). Both of ours run every forward within the same token
budget (`train.micro_max_tokens` = `train.logprob_max_tokens` = `--budget`, default 4 full rows):
padded, rows x the batch's width; packed (`train.pack`), real tokens binned first-fit
decreasing. Same seed, same weights.

TRL (`bench.trl`): GRPOTrainer (sequence-level importance sampling, GSPO's clip range) on the
long-tail batch itself: its `rollout_func` returns the batch's prompt and completion ids (no
`model.generate`), and it splits the batch into the same minibatches (`steps_per_generation`,
which also makes it compute pi_old's log-probs: TRL skips them when a generation batch is one
step). It pads each forward's rows to the longest, as TRL's GRPO does. Timed: its pi_old pass
and steps (`bench.trl.trl_rows`: old_s + train_s); our two sides run at each of its generation
boundaries, outside its timed sections, so all three alternate.

real tokens/s = the batch's prompt + response tokens (no padding) / seconds; the median over the
measured rounds. Peak memory: each of our sides once more in a fresh child process (one torch
thread, a low `MALLOC_MMAP_THRESHOLD_` so freed tensors leave the resident set), the peak
resident set of one iteration above the one before it (`/proc/self/clear_refs`, Linux). On a
machine shared with other jobs absolute times are noise; the ratios come from the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's notice

import torch  # noqa: E402

from bench.throughput import cpu_model  # noqa: E402
from bench.trl import build_trl, step_timer_callback, trl_rows, trl_unavailable  # noqa: E402
from megatron_gspo.config.schema import load_config  # noqa: E402
from megatron_gspo.jobs.rl import Trainer  # noqa: E402
from megatron_gspo.rollout.batch import RolloutBatch  # noqa: E402
from megatron_gspo.tasks.toy import CharTokenizer  # noqa: E402
from tools.result_table import add_readme_args, output_into  # noqa: E402

PRESETS = ("qwen3-moe-tiny", "qwen3-moe-tiny-deep")
"""The CPU experiments' policy and the same layer 12 deep."""
FIRST_ID = 3  # CharTokenizer's pad, bos, eos are 0, 1, 2: the batch holds none of them


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(PRESETS), help="comma list of model presets")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    p.add_argument("--group-size", type=int, default=8, help="G: responses per prompt")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per batch (>= 2: "
                   "TRL computes pi_old's log-probs only then)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=240)
    p.add_argument("--sigma", type=float, default=1.0, help="the long tail's lognormal sigma")
    p.add_argument("--budget", type=int, default=0, help="tokens per forward (default: 4 rows "
                   "of full length)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per side and point")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--skip-memory", action="store_true", help="no child processes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a memory measurement
    add_readme_args(p, "packing")
    args = p.parse_args(argv)
    for name in ("prompts", "rounds", "prompt_tokens", "max_new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.minibatches < 2 or args.prompts * args.group_size % args.minibatches \
            or args.group_size < 2:
        p.error(f"--minibatches={args.minibatches} must be >= 2 and divide --prompts x "
                f"--group-size, which must be >= 2")
    if args.budget < 0 or args.warmup < 0 or not args.sigma > 0:
        p.error(f"--budget={args.budget}, --warmup={args.warmup} must be >= 0 and "
                f"--sigma={args.sigma} > 0")
    args.budget = args.budget or 4 * (args.prompt_tokens + args.max_new_tokens)
    return args


def response_lengths(point: str, rows: int, longest: int, sigma: float, seed: int) -> list[int]:
    """`rows` response lengths: all `longest` ("equal"), or lognormal with mean longest / 4
    (before clipping to [1, longest]) ("long tail")."""
    if point == "equal":
        return [longest] * rows
    mu = math.log(longest / 4) - sigma ** 2 / 2
    z = torch.randn(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [int(min(longest, max(1, round(x)))) for x in torch.exp(mu + sigma * z).tolist()]


def synthetic_batch(lengths: list[int], prompt: int, vocab: int, group: int,
                    seed: int) -> RolloutBatch:
    """Rows of a random `prompt`-token prompt (one per group) and a random response of each
    length, right-padded to the longest possible row; random rewards."""
    g = torch.Generator().manual_seed(seed + 1)
    B, longest = len(lengths), max(lengths)
    T = prompt + longest
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    valid_BT = torch.zeros(B, T, dtype=torch.bool)
    response_BT = torch.zeros(B, T, dtype=torch.bool)
    prompts = torch.randint(FIRST_ID, vocab, (B // group, prompt), generator=g)
    for b, n in enumerate(lengths):
        tokens_BT[b, :prompt] = prompts[b // group]
        tokens_BT[b, prompt:prompt + n] = torch.randint(FIRST_ID, vocab, (n,), generator=g)
        valid_BT[b, :prompt + n] = True
        response_BT[b, prompt:prompt + n] = True
    return RolloutBatch(tokens_BT, valid_BT, response_BT, torch.zeros(B, T),
                        torch.rand(B, generator=g), torch.arange(B) // group, [""] * B, [None] * B)


def build_side(args, preset: str, pack: bool, run_dir: str) -> Trainer:
    overrides = [f"run_dir={run_dir}", f"seed={args.seed}", f"model.preset={preset}",
                 f"model.max_seq_len={args.prompt_tokens + args.max_new_tokens}",
                 "task.name=addition", "task.kwargs.num_digits=2", "task.n_train=64",
                 "task.n_eval=8", f"rollout.prompts_per_batch={args.prompts}",
                 f"rollout.group_size={args.group_size}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", "loss.name=gspo",
                 f"train.num_minibatches={args.minibatches}", "train.steps=1000000",
                 "train.flip_every=0", "train.eval_every=0", "train.save_every=0",
                 "wandb.mode=disabled", "optim.lr=1e-4", "optim.grad_clip=1.0",
                 f"train.pack={str(pack).lower()}", f"train.micro_max_tokens={args.budget}",
                 f"train.logprob_max_tokens={args.budget}"]
    return Trainer.from_config(load_config(None, overrides))


def iteration(trainer: Trainer, batch: RolloutBatch) -> float:
    """Seconds of the pi_old pass and the minibatches' optimizer steps on `batch`."""
    t0 = time.perf_counter()
    full, _ = trainer.prepare(batch)
    for rows in torch.arange(len(batch)).chunk(trainer.cfg.train.num_minibatches):
        trainer.train_step(full.select(rows))
    return time.perf_counter() - t0


def peak_memory(args, preset: str, pack: bool, point: str) -> float:
    """MiB: our side's peak resident set of one iteration, in a fresh child process."""
    child = json.dumps({"preset": preset, "pack": pack, "point": point})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-m", "bench.packing", "--child", child,
                          *_passed(args)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _passed(args) -> list[str]:
    return [f"--prompts={args.prompts}", f"--group-size={args.group_size}",
            f"--minibatches={args.minibatches}", f"--prompt-tokens={args.prompt_tokens}",
            f"--max-new-tokens={args.max_new_tokens}", f"--sigma={args.sigma}",
            f"--budget={args.budget}", f"--seed={args.seed}"]


def child(args) -> int:
    """`--child`: one side's peak resident set over one iteration (after a warm-up one)."""
    a = json.loads(args.child)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        trainer = build_side(args, a["preset"], a["pack"], tmp + "/run")
        batch = point_batch(args, a["point"], trainer.policy.real_vocab)
        iteration(trainer, batch)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set restarts from the current one
        base = _rss("VmRSS")
        iteration(trainer, batch)
        print(json.dumps({"peak_mib": (_rss("VmHWM") - base) / 2 ** 20}))
        trainer.rt.close()
    return 0


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def point_batch(args, point: str, vocab: int) -> RolloutBatch:
    rows = args.prompts * args.group_size
    lengths = response_lengths(point, rows, args.max_new_tokens, args.sigma, args.seed)
    return synthetic_batch(lengths, args.prompt_tokens, vocab, args.group_size, args.seed)


def trl_side(args, trainer: Trainer, batch: RolloutBatch, run_ours, tmp: str):
    """TRL's GRPOTrainer training on `batch` (its rollout_func returns the batch's ids);
    `run_ours()` at each generation boundary."""
    prompt_ids = [row[valid & ~resp].tolist() for row, valid, resp in
                  zip(batch.tokens_BT, batch.valid_BT, batch.response_BT)]
    completion_ids = [row[resp].tolist() for row, resp in zip(batch.tokens_BT, batch.response_BT)]
    g = torch.Generator().manual_seed(args.seed + 2)

    def rollout(prompts, trl_trainer):
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def reward(completions, **_):
        return torch.rand(len(completions), generator=g).tolist()

    ns = SimpleNamespace(prompts=args.prompts, group_size=args.group_size,
                         minibatches=args.minibatches, max_new_tokens=args.max_new_tokens,
                         force_length=False, hf_experts=None, seed=args.seed)
    callback = step_timer_callback(1, args.minibatches, run_ours)
    return build_trl(ns, trainer.policy.preset, trainer.rt.train_set, trainer.rt.task,
                     args.warmup + args.rounds, tmp + "/trl", callback, rollout_func=rollout,
                     reward=reward)


def measure_preset(args, preset: str, trl_skip: str | None) -> list[dict]:
    """Per point: our two sides' median real tokens/s (and TRL's at the long tail)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        sides = {pack: build_side(args, preset, pack, f"{tmp}/{pack}") for pack in (False, True)}
        vocab = sides[True].policy.real_vocab
        for point in ("equal", "long tail"):
            batch = point_batch(args, point, vocab)
            seconds = {False: [], True: []}

            def run_ours():
                for pack, trainer in sides.items():
                    torch.set_num_threads(1)
                    seconds[pack].append(iteration(trainer, batch))

            trl = None
            if point == "long tail" and trl_skip is None:
                trl = trl_side(args, sides[True], batch, run_ours, tmp)
                trl.train()
            while len(seconds[True]) < args.warmup + args.rounds:
                run_ours()
            tokens = int(batch.valid_BT.sum())
            row = {"point": point, "mean_response": float(batch.response_BT.sum(1).float().mean()),
                   "tokens": tokens, "positions": batch.tokens_BT.numel()}
            for pack, name in ((False, "padded"), (True, "packed")):
                row[name] = tokens / statistics.median(seconds[pack][args.warmup:])
            if trl is not None:
                done = trl_rows(trl.bench_records)[args.warmup:]
                row["trl"] = statistics.median(r["train_tokens"] / (r["old_s"] + r["train_s"])
                                               for r in done)
            if not args.skip_memory:
                for pack, name in ((False, "padded_mib"), (True, "packed_mib")):
                    row[name] = peak_memory(args, preset, pack, point)
            rows.append(row)
        for trainer in sides.values():
            trainer.rt.close()
    return rows


def report(args, results: dict, trl_skip: str | None) -> None:
    print(f"rollout batch: {args.prompts} prompts x G={args.group_size} rows of a "
          f"{args.prompt_tokens}-token prompt and a response of at most {args.max_new_tokens}; "
          f"pi_old pass + {args.minibatches} optimizer steps; every forward within "
          f"{args.budget} tokens (train.micro_max_tokens = train.logprob_max_tokens); median "
          f"of {args.rounds} rounds after {args.warmup}, alternating"
          + ("" if trl_skip else " with TRL's"))
    print("| preset | point | mean response | real tokens (of positions) | padded tok/s | "
          "packed tok/s | packed / padded | padded peak MiB | packed peak MiB | TRL tok/s | "
          "packed / TRL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for preset, rows in results.items():
        for r in rows:
            mem = (f"{r['padded_mib']:.0f} | {r['packed_mib']:.0f}" if "packed_mib" in r
                   else "- | -")
            trl = (f"{r['trl']:.0f} | {r['packed'] / r['trl']:.2f}" if "trl" in r else "- | -")
            print(f"| {preset} | {r['point']} | {r['mean_response']:.1f} | {r['tokens']} "
                  f"({r['positions']}) | {r['padded']:.0f} | {r['packed']:.0f} | "
                  f"{r['packed'] / r['padded']:.2f} | {mem} | {trl} |")
    if trl_skip:
        print(f"TRL: skipped ({trl_skip})")
    print(f"goals: equal lengths, packed / padded >= 0.95; long tail, packed / padded >= 2 and "
          f"packed / TRL >= packed / padded")
    print(f"machine: {cpu_model()}, 1 torch thread (shared with other jobs: read the ratios); "
          f"seed {args.seed}, lognormal sigma {args.sigma}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    torch.set_num_threads(1)
    trl_skip = "--skip-trl" if args.skip_trl else trl_unavailable()
    results = {preset: measure_preset(args, preset, trl_skip)
               for preset in args.presets.split(",")}
    with output_into(args.readme, args.marker):
        report(args, results, trl_skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
