"""The positive control's tables, from the runs' metrics.jsonl: one row per arm and level.

Usage:
    python -m experiments.positive_control.report --collect  # runs/ -> results/, tables
    python -m experiments.positive_control.report            # tables from results/ into README
    python -m experiments.positive_control.report --print    # print only

The tables read `results/<lever>/<run>.json` (committed): `run_stats` of each finished run,
distilled from its metrics.jsonl by `--collect` (the runner does it after its runs).

Per run: accuracy at the start and the end (`test/accuracy`, greedy on the test split, which
chooses nothing; runs made before the split existed fall back to `eval/accuracy`), whether it
collapsed (its last quarter's mean train reward under COLLAPSED: it no longer solves any sampled
problem, from which GRPO's group advantages cannot recover), and the means over its steps of the
sampler-vs-trainer routing mismatch (fraction of routers whose top-k differs, the R3 paper's
count), the log-prob mismatch, the clip fraction and the first minibatch's |log-ratio|. Arms
are compared with GRPO at the same level, paired by seed (95% t interval of the difference).
"""

from __future__ import annotations

import argparse
import json
import os
import re

from tools.result_table import write_into
from experiments.positive_control.common import (HERE, ROOT, RUNS, load_json, measured,
                                                 write_json, write_measured)
from experiments.replay_dose_response.report import ci

RUN_RE = re.compile(r"^(?P<arm>[a-z0-9_]+?)_n(?P<level>[0-9.]+)_s(?P<seed>\d+)$")
COLLAPSED = 0.01
LABELS = {"grpo_clean": "GRPO, no disagreement", "grpo": "GRPO", "grpo_r2": "GRPO + R2",
          "grpo_r3": "GRPO + R3", "grpo_tis": "GRPO + TIS (cap 2)", "gspo": "GSPO", "gspo_r3": "GSPO + R3",
          "grpo_sl": "GRPO, pi_old = sampler's", "grpo_sl_r3": "GRPO + R3, pi_old = sampler's",
          "gspo_sl": "GSPO, pi_old = sampler's", "gspo_sl_r3": "GSPO + R3, pi_old = sampler's"}
LEVER_WORDS = {"engine": "sampler's routers, fixed noise "
                         "(`rollout.decoders.router_noise=fixed`)",
               "engine_fresh": "sampler's routers, fresh noise "
                               "(`rollout.decoders.router_noise=fresh`)",
               "trainer": "the loss's routers (`train.router_noise_std`)"}


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r and r[key] == r[key]]
    return sum(vals) / len(vals) if vals else float("nan")


def run_stats(path: str) -> dict | None:
    """One finished run's numbers (see the module docstring); None before its last eval."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    key = "test/accuracy" if any("test/accuracy" in r for r in rows) else "eval/accuracy"
    accs = [r[key] for r in rows if key in r]
    steps = [r for r in rows if "reward/mean" in r]
    if len(accs) < 2 or not steps:
        return None
    last = steps[-max(1, len(steps) // 4):]
    first_mb = [r for r in steps if r.get("train/minibatch") == 0]
    return {"split": key.split("/")[0], "start": accs[0], "final": accs[-1],
            "collapsed": _mean(last, "reward/mean") < COLLAPSED,
            "reward_last": _mean(last, "reward/mean"),
            "route_mm": _mean(steps, "rollout/routing_mismatch/mean"),
            "lp_mm": _mean(steps, "rollout/logprob_mismatch/mean"),
            "clip": _mean(steps, "policy/clip_frac/token"),
            "lr0": _mean(first_mb, "policy/log_ratio/abs_mean")}


def distill(runs_root: str, results_root: str) -> int:
    """Write `run_stats` of every finished run under `runs_root/<lever>/` to
    `results_root/<lever>/<run>.json` (small files, committed); returns how many."""
    n = 0
    for lever in LEVER_WORDS:
        lever_dir = os.path.join(runs_root, lever)
        for name in sorted(os.listdir(lever_dir)) if os.path.isdir(lever_dir) else []:
            path = os.path.join(lever_dir, name, "metrics.jsonl")
            if RUN_RE.match(name) and os.path.exists(path) \
                    and (stats := run_stats(path)) is not None:
                write_json(os.path.join(results_root, lever, f"{name}.json"), stats)
                n += 1
    return n


def collect(lever_dir: str) -> dict:
    """{(arm, level): {seed: stats}} over the distilled runs (`<run>.json`) in `lever_dir`."""
    out: dict = {}
    if not os.path.isdir(lever_dir):
        return out
    for name in sorted(os.listdir(lever_dir)):
        m = RUN_RE.match(name.removesuffix(".json"))
        if m and name.endswith(".json") and (stats := load_json(
                os.path.join(lever_dir, name))) is not None:
            out.setdefault((m["arm"], float(m["level"])), {})[int(m["seed"])] = stats
    return out


def _pm(v: tuple[float, float], fmt: str = ".3f") -> str:
    m, h = v
    if m != m:
        return "-"
    return f"{m:{fmt}}" if h != h else f"{m:{fmt}} ± {h:{fmt}}"


def arms_table(runs: dict, clean: dict) -> str:
    """Rows per (level, arm); the clean GRPO runs (level 0) first, as the reference."""
    head = ("| level | arm | seeds | collapsed | start acc | final acc | final - GRPO (paired) "
            "| router mismatch | log-prob mismatch | clip frac | first-minibatch abs log-ratio |")
    lines = [head, "|" + " --- |" * 11]
    groups = [((0.0, "grpo_clean"), clean.get(("grpo_clean", 0.0), {}))]
    groups += [((lv, arm), seeds) for (arm, lv), seeds in
               sorted(runs.items(), key=lambda kv: (kv[0][1], list(LABELS).index(kv[0][0])
                                                    if kv[0][0] in LABELS else 99))
               if arm != "grpo_clean"]
    for (level, arm), seeds in groups:
        if not seeds:
            continue
        ref = clean.get(("grpo_clean", 0.0), {}) if level == 0 else runs.get(("grpo", level), {})
        paired = [seeds[s]["final"] - ref[s]["final"] for s in seeds if s in ref]
        vals = list(seeds.values())
        lines.append(
            f"| {level:g} | {LABELS.get(arm, arm)} | {len(vals)} | "
            f"{sum(v['collapsed'] for v in vals)}/{len(vals)} | "
            f"{_pm(ci([v['start'] for v in vals]))} | {_pm(ci([v['final'] for v in vals]))} | "
            f"{'-' if arm in ('grpo', 'grpo_clean') else _pm(ci(paired))} | "
            f"{_pm(ci([v['route_mm'] for v in vals]))} | {_pm(ci([v['lp_mm'] for v in vals]))} | "
            f"{_pm(ci([v['clip'] for v in vals]), '.4f')} | "
            f"{_pm(ci([v['lr0'] for v in vals]), '.4f')} |")
    return "\n".join(lines)


PAIRS = (("gspo_sl_r3", "gspo_sl"), ("grpo_sl_r3", "grpo_sl"), ("gspo_r3", "gspo"),
         ("grpo_r3", "grpo"), ("grpo_r2", "grpo"), ("gspo", "grpo"))
"""(with, without) compared in the answer: what replay (or GSPO) changes, paired by seed."""


def paired(runs: dict, a: str, b: str, level: float) -> dict | None:
    """Final accuracy of arm `a` minus arm `b` at `level` over the seeds both finished, and
    each arm's collapses over those seeds; None without a common seed."""
    ra, rb = runs.get((a, level), {}), runs.get((b, level), {})
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return None
    m, h = ci([ra[s]["final"] - rb[s]["final"] for s in seeds])
    return {"n": len(seeds), "gap": m, "half": h,
            "collapsed": (sum(ra[s]["collapsed"] for s in seeds),
                          sum(rb[s]["collapsed"] for s in seeds)),
            "route_mm": ci([rb[s]["route_mm"] for s in seeds])[0]}


def answer_table(runs: dict) -> str:
    """The answer: per level and pair, the paired gap in final test accuracy, whether its 95%
    interval excludes 0, and the collapses of each side."""
    lines = ["| level | routers differing | comparison | seeds | final acc gap (paired) | "
             "interval excludes 0 | collapsed (with / without) |", "|" + " --- |" * 7]
    for level in sorted({lv for _, lv in runs if lv > 0}):
        for a, b in PAIRS:
            p = paired(runs, a, b, level)
            if p is None:
                continue
            sure = p["half"] == p["half"] and abs(p["gap"]) > p["half"]
            lines.append(f"| {level:g} | {p['route_mm']:.0%} | {LABELS[a]} vs {LABELS[b]} | "
                         f"{p['n']} | {_pm((p['gap'], p['half']))} | "
                         f"{'yes' if sure else 'no'} | {p['collapsed'][0]} / {p['collapsed'][1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables only")
    ap.add_argument("--collect", action="store_true",
                    help=f"first distill {RUNS}/<lever>/*/metrics.jsonl into results/")
    args = ap.parse_args(argv)
    root = os.path.join(HERE, "results")
    if args.collect:
        print(f"distilled {distill(os.path.join(ROOT, RUNS), root)} runs into {root}")
        write_measured(root, f"{RUNS}/sft_top4")
    line = measured(root)
    clean = collect(os.path.join(root, "engine"))
    for lever, words in LEVER_WORDS.items():
        runs = collect(os.path.join(root, lever))
        if not runs:
            continue
        text = "\n".join([line, f"Lever: {words}. Accuracy: greedy on the test "
                          "split (256 prompts), at the first and last step; ± = 95% t interval "
                          "over seeds.", "", arms_table(runs, clean)])
        tables = {f"arms_{lever}": text}
        if lever == "engine":
            tables["answer"] = answer_table(runs)
        readme = os.path.join(HERE, "README.md")
        for marker, table in tables.items():
            print(table, "\n", flush=True)
            if not args.print and os.path.exists(readme):
                try:
                    write_into(readme, table, marker)
                except ValueError as e:
                    print(e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
