"""Train iterations with glibc's own malloc thresholds vs `megatron_gspo.run.host`'s, side by side.

    python -m bench.malloc                          # 64 x 128-token responses, 3 rounds
    python -m bench.malloc --prompts 4 --group-size 4 --rounds 4
    python -m bench.malloc --readme experiments/throughput/README.md --marker malloc

The setting is process-wide (and `bench.throughput` runs ours and TRL in one process), so
each measurement is a fresh child process: `MEGATRON_GSPO_MALLOC=system` or not, alternating
round by round. A child builds the bench's trainer (`bench.throughput --force-length
--skip-trl`), samples one rollout batch, then times `--iterations` train iterations on it (pi_old
pass + 4 optimizer steps; no sampling) and counts its minor page faults (getrusage). The table
gives each setting's best and median iteration over all its rounds, and faults per iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.throughput import cpu_model
from tools.result_table import add_readme_args, output_into

CHILD = """
import json, resource, sys, tempfile, time
import torch
from megatron_gspo.run.host import malloc_state
from bench.throughput import build_ours, parse_args
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
with tempfile.TemporaryDirectory(prefix="bench_malloc_") as tmp:
    trainer, _ = build_ours(parse_args(["--force-length", "--skip-trl", "--max-new-tokens",
                                        str(args["length"]), "--prompts", str(args["prompts"]),
                                        "--group-size", str(args["group"])]), tmp + "/run")
    trainer.iteration()  # warm-up, and the sampled batch every timed iteration reuses
    batch = trainer.rollout(trainer.state.iteration)
    trainer.rollout = lambda i: batch
    seconds, faults = [], 0
    for _ in range(args["iterations"]):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        trainer.iteration()
        seconds.append(time.perf_counter() - t0)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    trainer.rt.close()
print(json.dumps({"seconds": seconds, "faults": faults / args["iterations"],
                  "tuned": malloc_state().startswith("tuned")}))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--iterations", type=int, default=5, help="timed iterations per child")
    p.add_argument("--rounds", type=int, default=3, help="children per setting, alternating")
    add_readme_args(p, "malloc")
    return p.parse_args(argv)


def child(args, setting: str) -> dict:
    env = dict(os.environ)
    env.pop("MEGATRON_GSPO_MALLOC", None)
    if setting == "system":
        env["MEGATRON_GSPO_MALLOC"] = "system"
    spec = json.dumps({"length": args.max_new_tokens, "prompts": args.prompts,
                       "group": args.group_size, "iterations": args.iterations})
    proc = subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    if proc.returncode:
        raise RuntimeError(f"child ({setting}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {"system": [], "tuned": []}
    for _ in range(args.rounds):
        for setting in runs:
            runs[setting].append(child(args, setting))
    rows = ["| malloc | best iteration s | median iteration s | minor faults per iteration |",
            "|---|---|---|---|"]
    for setting, results in runs.items():
        if any(r["tuned"] != (setting == "tuned") for r in results):
            raise RuntimeError(f"a {setting!r} child ran with the other setting (environment?)")
        seconds = [s for r in results for s in r["seconds"]]
        faults = statistics.mean(r["faults"] for r in results)
        rows.append(f"| {setting} | {min(seconds):.3f} | {statistics.median(seconds):.3f} | "
                    f"{faults:.0f} |")
    best = {k: min(s for r in v for s in r["seconds"]) for k, v in runs.items()}
    with output_into(args.readme, args.marker):
        print(f"machine: {cpu_model()}, 1 torch thread; {args.prompts * args.group_size} "
              f"sequences x {args.max_new_tokens} forced tokens; {args.rounds} child processes "
              f"per setting, alternating, {args.iterations} train iterations each (pi_old pass "
              f"+ 4 optimizer steps on one sampled batch)\n")
        print("\n".join(rows))
        print(f"\nbest iteration, system / tuned: {best['system'] / best['tuned']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
