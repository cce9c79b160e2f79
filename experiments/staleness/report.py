"""The staleness experiment's tables, from the runs' metrics.jsonl.

Usage:
    python -m experiments.staleness.report --collect   # runs/staleness -> results/, tables
    python -m experiments.staleness.report             # tables from results/ into README
    python -m experiments.staleness.report --print     # print only

`--collect` distills each finished run's metrics.jsonl into `results/<run>.json` (committed):
test accuracy at the first and last step (greedy, the test split, which chooses nothing),
whether it collapsed (its last quarter's mean train reward under 0.01), and means over its
rollout batches sampled k versions old (all of them at k = 0; from batch k on otherwise) of the
routing mismatch per layer (the sampler's routes vs the trainer's recompute of the same tokens:
the fraction of routers whose top-k set differs), the log-prob mismatch (|behaviour - proximal|,
live routing; under R3 also with the sampler's routes replayed, and the share of the former
that replaying removes), the first minibatch's
|log-ratio|, the clip fractions and the TIS weights. Arms are compared paired by seed (the same
seed draws the same prompts), with 95% t intervals.
"""

from __future__ import annotations

import argparse
import os
import re

from experiments.positive_control.common import load_json, measured, write_json, write_measured
from experiments.positive_control.report import COLLAPSED, _mean, _pm
from experiments.replay_dose_response.report import ci
from megatron_gspo.run.metrics import read_jsonl
from tools.result_table import write_into

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RUNS = "runs/staleness"
COLD_START = "runs/positive_control/sft_top4"
RUN_RE = re.compile(r"^(?P<arm>[a-z0-9_]+?)_k(?P<k>\d+)_s(?P<seed>\d+)$")
LABELS = {"grpo": "GRPO", "grpo_r3": "GRPO + R3", "gspo": "GSPO"}
LAYERS = 4  # qwen3-moe-tiny's
STEADY = {"route_mm": "rollout/routing_mismatch/mean", "any_diff": "rollout/routing_any_diff",
          "lp_mm": "rollout/logprob_mismatch/mean",
          "lp_mm_r3": "rollout/logprob_mismatch_r3/mean",
          **{f"layer_{i:02d}": f"rollout/routing_mismatch/layer_{i:02d}" for i in range(LAYERS)}}
"""Per rollout batch, averaged over the batches sampled k versions old."""
STEPS = {"clip": "policy/clip_frac/token", "clip_seq": "policy/clip_frac/seq",
         "tis": "policy/tis/mean", "tis_clip": "policy/tis/clip_frac"}
"""Per optimizer step, averaged over the run."""


def run_stats(path: str, k: int) -> dict | None:
    """One finished run's numbers (module docstring); None before its last test eval."""
    return run_stats_of(read_jsonl(path), k)


def run_stats_of(rows: list[dict], k: int) -> dict | None:
    """`run_stats` of a run's metrics rows."""
    accs = [r["test/accuracy"] for r in rows if "test/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    if len(accs) < 2 or not steps:
        return None
    last = steps[-max(1, len(steps) // 4):]
    steady = [r for r in steps if r.get("rollout/staleness/max") == k]
    first_mb = [r for r in steady if r.get("train/minibatch") == 0]
    out = {"start": accs[0], "final": accs[-1], "reward_last": _mean(last, "reward/mean"),
           "collapsed": _mean(last, "reward/mean") < COLLAPSED,
           "lr0": _mean(first_mb, "policy/log_ratio/abs_mean"),
           "staleness": _mean(steady, "rollout/staleness/max"),
           "batches": len({r.get("train/iteration") for r in steady})}
    out.update({name: _mean(steady, key) for name, key in STEADY.items()})
    out.update({name: _mean(steps, key) for name, key in STEPS.items()})
    out["r3_share"] = 1 - out["lp_mm_r3"] / out["lp_mm"] if out["lp_mm"] > 1e-4 \
        else float("nan")  # not float rounding
    return out


def distill(runs_root: str, results_root: str) -> int:
    """`run_stats` of every finished run under `runs_root` into `results_root/<run>.json`."""
    n = 0
    for name in sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []:
        m, path = RUN_RE.match(name), os.path.join(runs_root, name, "metrics.jsonl")
        if m and os.path.exists(path) and (stats := run_stats(path, int(m["k"]))) is not None:
            write_json(os.path.join(results_root, f"{name}.json"), stats)
            n += 1
    return n


def collect(results_root: str) -> dict:
    """{(arm, k): {seed: stats}} over the distilled runs."""
    out: dict = {}
    for name in sorted(os.listdir(results_root)) if os.path.isdir(results_root) else []:
        m = RUN_RE.match(name.removesuffix(".json"))
        if m and name.endswith(".json"):
            out.setdefault((m["arm"], int(m["k"])), {})[int(m["seed"])] = load_json(
                os.path.join(results_root, name))
    return out


def gap(runs: dict, a: tuple, b: tuple, key: str = "final") -> tuple[float, float, int]:
    """Mean and 95% half-width of run a's `key` minus run b's over their common seeds."""
    ra, rb = runs.get(a, {}), runs.get(b, {})
    seeds = sorted(set(ra) & set(rb))
    m, h = ci([ra[s][key] - rb[s][key] for s in seeds])
    return m, h, len(seeds)


def excludes_zero(m: float, h: float) -> str:
    return "yes" if h == h and abs(m) > h else "no"


def answer_table(runs: dict) -> str:
    """Per k: what R3 changes (GRPO + R3 vs GRPO), what staleness costs each arm (k vs 0), and
    whether R3's effect moves with staleness (its gap at k minus its gap at 0), paired by seed."""
    lines = ["| k | comparison | seeds | final test acc gap (paired) | interval excludes 0 |",
             "|" + " --- |" * 5]
    ks = sorted({k for _, k in runs})
    for k in ks:
        pairs = [("GRPO + R3 vs GRPO", ("grpo_r3", k), ("grpo", k)),
                 ("GSPO vs GRPO", ("gspo", k), ("grpo", k))]
        if k:
            pairs += [(f"{LABELS[a]}, k = {k} vs k = 0", (a, k), (a, 0)) for a in LABELS]
        for words, a, b in pairs:
            m, h, n = gap(runs, a, b)
            if n:
                lines.append(f"| {k} | {words} | {n} | {_pm((m, h))} | {excludes_zero(m, h)} |")
        if k:
            r3, base = runs.get(("grpo_r3", k), {}), runs.get(("grpo", k), {})
            r30, base0 = runs.get(("grpo_r3", 0), {}), runs.get(("grpo", 0), {})
            seeds = sorted(set(r3) & set(base) & set(r30) & set(base0))
            m, h = ci([(r3[s]["final"] - base[s]["final"]) - (r30[s]["final"] - base0[s]["final"])
                       for s in seeds])
            if seeds:
                lines.append(f"| {k} | R3's gap at k = {k} minus at k = 0 | {len(seeds)} | "
                             f"{_pm((m, h))} | {excludes_zero(m, h)} |")
    return "\n".join(lines)


def arms_table(runs: dict) -> str:
    head = ("| k | arm | seeds | collapsed | start acc | final acc | final - same arm at k = 0 "
            "| routing mismatch | log-prob mismatch | R3: log-prob mismatch, routes replayed "
            "| R3: share of the mismatch removed | first-minibatch abs log-ratio "
            "| clip frac (token) | clip frac (seq) | TIS weight | TIS capped |")
    lines = [head, "|" + " --- |" * 16]
    for (arm, k), seeds in sorted(runs.items(), key=lambda kv: (kv[0][1], list(LABELS).index(
            kv[0][0]))):
        vals = list(seeds.values())

        def cell(key, fmt=".3f"):
            return _pm(ci([v[key] for v in vals]), fmt)
        m, h, _ = gap(runs, (arm, k), (arm, 0))
        lines.append(
            f"| {k} | {LABELS[arm]} | {len(vals)} | {sum(v['collapsed'] for v in vals)}"
            f"/{len(vals)} | {cell('start')} | {cell('final')} | "
            f"{'-' if k == 0 else _pm((m, h))} | {cell('route_mm', '.4f')} | "
            f"{cell('lp_mm', '.4f')} | {cell('lp_mm_r3', '.4f')} | {cell('r3_share', '.2f')} | "
            f"{cell('lr0', '.5f')} | "
            f"{cell('clip', '.4f')} | {cell('clip_seq', '.4f')} | {cell('tis', '.4f')} | "
            f"{cell('tis_clip', '.5f')} |")
    return "\n".join(lines)


def layers_table(runs: dict) -> str:
    """Routing mismatch per layer against staleness, each arm (seeds pooled: mean ± 95%)."""
    cols = [f"layer_{i:02d}" for i in range(LAYERS)]
    lines = ["| k | arm | " + " | ".join(cols) + " | mean | tokens with any layer differing |",
             "|" + " --- |" * (LAYERS + 4)]
    for (arm, k), seeds in sorted(runs.items(), key=lambda kv: (kv[0][1], list(LABELS).index(
            kv[0][0]))):
        vals = list(seeds.values())
        cells = [_pm(ci([v[c] for v in vals]), ".4f") for c in [*cols, "route_mm", "any_diff"]]
        lines.append(f"| {k} | {LABELS[arm]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables only")
    ap.add_argument("--collect", action="store_true",
                    help=f"first distill {RUNS}/*/metrics.jsonl into results/")
    args = ap.parse_args(argv)
    results = os.path.join(HERE, "results")
    if args.collect:
        print(f"distilled {distill(os.path.join(ROOT, RUNS), results)} runs into {results}")
        write_measured(results, COLD_START)
    runs = collect(results)
    note = ("Accuracy: greedy on the test split (256 prompts), at the first and last step; "
            "± = 95% t interval over seeds, paired by seed where a difference is taken.")
    tables = {"answer": answer_table(runs),
              "arms": "\n".join([measured(results), note, "", arms_table(runs)]),
              "layers": layers_table(runs)}
    readme = os.path.join(HERE, "README.md")
    for marker, table in tables.items():
        print(table, "\n", flush=True)
        if not args.print:
            write_into(readme, table, marker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
