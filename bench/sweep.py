"""Ours/TRL throughput ratios over response lengths and batch sizes (`bench.throughput --sweep`).

    python -m bench.throughput --sweep                       # 8,32,128,256 x 16,64 seqs
    python -m bench.throughput --sweep --lengths 8,128 --batches 8x8 --iterations 3
    python -m bench.sweep --out runs/bench_sweep             # the same, directly
    python -m bench.throughput --sweep --readme experiments/throughput/README.md
    python -m bench.throughput --sweep --skip-trl --peak-tflops 989 --set model.dtype=bf16
                                                  # a GPU: ours alone, model TFLOP/s and MFU

Each point is one `bench.throughput` run in a fresh process with `--force-length` (every
response exactly L tokens on both sides, so both generate and train on the same token counts)
and `--flip-cost` (a second copy of ours with `train.flip_every=1` alternates with the other
two). Every ratio in the table comes from one run: ours and TRL measured side by side, never
two runs' numbers divided. Columns:

  rollout, train   ours/TRL tokens per second (best iteration of each; > 1: ours faster)
  pi_old           TRL/ours seconds of the no-grad old-policy pass (> 1: ours faster; TRL's
                   also scores rewards and advantages in that section)
  flip cost        ours train seconds with flip_every=1 / without (1 = free)

`--skip-trl`: ours alone (TRL optional on a GPU): rollout and train tokens/s, train model
TFLOP/s (`bench.throughput_table.model_flops_line`), MFU with `--peak-tflops`, flip cost; no figure.

Writes OUT/sweep.md (the table, with date, machine and versions), OUT/sweep.json (every
summary) and OUT/sweep.png (the ratios vs length). sweep.md, sweep.json and the `--readme`
table are rewritten after every point, so a sweep stopped early (a time limit) leaves the
points it finished, headed "N of M points". Few iterations per point by default (4
measured after 1 warm-up): on 2 shared cores the 256-token points take minutes each; run it
under `nice -n 10`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

from tools.result_table import add_readme_args, write_into
from bench.throughput_table import model_tflops
from tools.plot_run import pyplot


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="8,32,128,256", help="response lengths (comma list)")
    p.add_argument("--batches", default="4x4,8x8",
                   help="PROMPTSxG rollout batches (comma list); 4 minibatches each")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per point")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default="runs/bench_sweep", help="output folder")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for our side (repeatable)")
    p.add_argument("--skip-trl", action="store_true", help="ours alone: rates, TFLOP/s, MFU")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak TFLOP/s for the run's dtype (MFU column)")
    add_readme_args(p, "sweep")  # e.g. --readme experiments/throughput/README.md
    args = p.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
        args.batches = [tuple(int(v) for v in b.split("x")) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--lengths={args.lengths!r} / --batches={args.batches!r}: expected e.g. "
                "8,32 and 4x4,8x8")
    if any(len(b) != 2 or b[0] * b[1] % 4 for b in args.batches) or min(args.lengths) < 1:
        p.error(f"--batches={args.batches}: PROMPTSxG with PROMPTS*G divisible by 4; "
                f"--lengths={args.lengths} >= 1")
    return args


def run_point(args, prompts: int, group: int, length: int, path: str) -> dict:
    cmd = [sys.executable, "-m", "bench.throughput", "--force-length", "--flip-cost",
           "--max-new-tokens", str(length), "--prompts", str(prompts), "--group-size",
           str(group), "--iterations", str(args.iterations), "--warmup", str(args.warmup),
           "--json", path] + [f"--set={s}" for s in args.set]
    cmd += ["--skip-trl"] if args.skip_trl else []
    cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(path) as f:
        return json.load(f)


def ratios(res: dict) -> dict:
    """Ratios of each side's best (least disturbed) iteration: on a shared 2-core machine other
    jobs only ever slow an iteration down, and with a few iterations one slowed iteration moves
    a median a lot."""
    ours, flip = res["ours"]["best"], res["flip"]["best"]
    if res.get("trl") is None:
        return {"flip_cost": flip["train_s"] / ours["train_s"]}
    trl = res["trl"]["best"]
    return {"rollout": ours["rollout_tps"] / trl["rollout_tps"],
            "train": ours["train_tps"] / trl["train_tps"],
            "pi_old": trl["old_s"] / ours["old_s"],
            "flip_cost": flip["train_s"] / ours["train_s"]}


def ours_table(points: list, peak_tflops: float | None) -> str:
    """Ours alone (`--skip-trl`): best-iteration rates, train model TFLOP/s, MFU, flip cost."""
    head = ["batch (seqs)", "length", "rollout tok/s", "train tok/s", "train model TFLOP/s",
            "MFU %", "flip cost"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        best = p["res"]["ours"]["best"]
        tflops, mfu = model_tflops(best["train_tps"], p["res"]["train_flops_per_token"],
                                   peak_tflops)
        mfu = "-" if mfu is None else f"{mfu:.2f}"
        lines.append(f"| {p['prompts']}x{p['group']} ({p['prompts'] * p['group']}) | "
                     f"{p['length']} | {best['rollout_tps']:.0f} | {best['train_tps']:.0f} | "
                     f"{tflops:.4g} | {mfu} | {p['ratios']['flip_cost']:.2f} |")
    return "\n".join(lines)


def table(points: list) -> str:
    head = ["batch (seqs)", "length", "rollout ours/TRL", "train ours/TRL", "pi_old TRL/ours s",
            "flip cost", "ours rollout tok/s", "TRL rollout tok/s", "ours train tok/s",
            "TRL train tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        r, ours, trl = p["ratios"], p["res"]["ours"]["best"], p["res"]["trl"]["best"]
        lines.append(f"| {p['prompts']}x{p['group']} ({p['prompts'] * p['group']}) | "
                     f"{p['length']} | {r['rollout']:.2f} | {r['train']:.2f} | "
                     f"{r['pi_old']:.2f} | {r['flip_cost']:.2f} | {ours['rollout_tps']:.0f} | "
                     f"{trl['rollout_tps']:.0f} | {ours['train_tps']:.0f} | "
                     f"{trl['train_tps']:.0f} |")
    return "\n".join(lines)


def plot(points: list, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    styles = {"rollout": "tab:blue", "train": "tab:orange", "pi_old": "tab:green",
              "flip_cost": "tab:red"}
    labels = {"rollout": "rollout tok/s ours/TRL", "train": "train tok/s ours/TRL",
              "pi_old": "pi_old s TRL/ours", "flip_cost": "flip cost (ours, on/off)"}
    batches = sorted({(p["prompts"], p["group"]) for p in points})
    for bi, (P, G) in enumerate(batches):
        pts = sorted((p for p in points if (p["prompts"], p["group"]) == (P, G)),
                     key=lambda p: p["length"])
        for key, color in styles.items():
            ax.plot([p["length"] for p in pts], [p["ratios"][key] for p in pts], color=color,
                    marker="os^v"[bi % 4], linestyle=["-", "--", ":", "-."][bi % 4],
                    label=f"{labels[key]}, {P * G} seqs")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("response length (tokens, forced on both sides)")
    ax.set_ylabel("ratio")
    ax.set_title("megatron-gspo vs TRL GRPOTrainer, qwen3-moe-tiny, CPU", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep_text(args, points: list, total: int) -> str:
    """sweep.md's text: the header line and the table of `points`; while they are fewer than
    the `total` the sweep runs, the header says so."""
    res0 = points[0]["res"]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    partial = f"**{len(points)} of {total} points** (the sweep stopped or is still running " \
        "after these). " if len(points) < total else ""
    return (f"{partial}Generated by `python -m bench.throughput --sweep` on {when}; machine: "
            f"{res0['cpu']}, device {res0.get('device', 'cpu')}; torch threads 1; "
            f"{res0['versions']}; host malloc {res0.get('malloc', 'untuned')}; "
            f"{args.warmup} warm-up + {args.iterations} measured iterations per point (ratios "
            f"and rates of each side's best iteration), "
            f"4 optimizer steps per rollout batch; ours overrides beyond the defaults: "
            f"{' '.join(args.set) or 'none'}.\n\n"
            + (ours_table(points, args.peak_tflops) if args.skip_trl else table(points)) + "\n")


def save(args, text: str, points: list) -> None:
    """OUT/sweep.md, OUT/sweep.json and, with --readme, the README's table: after every point,
    so a sweep stopped by a time limit leaves the points it measured."""
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(points, f, indent=1)
    if args.readme:
        write_into(args.readme, text.rstrip("\n"), args.marker)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    points = []
    total = len(args.batches) * len(args.lengths)
    for prompts, group in args.batches:
        for length in args.lengths:
            res = run_point(args, prompts, group, length,
                            os.path.join(args.out, f"point_{prompts}x{group}_{length}.json"))
            points.append({"prompts": prompts, "group": group, "length": length, "res": res,
                           "ratios": ratios(res)})
            print(f"{prompts}x{group} L={length}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in points[-1]["ratios"].items()), flush=True)
            text = sweep_text(args, points, total)
            save(args, text, points)
    print("\n" + text)
    if not args.skip_trl:
        plot(points, os.path.join(args.out, "sweep.png"))
    print(f"wrote {args.out}/sweep.md, sweep.json" + ("" if args.skip_trl else ", sweep.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
