"""The R2 arms' tables, from the runs' metrics.jsonl: one table per (candidate, lever) and the
answer (paired gaps).

Usage:
    python -m experiments.routing_volatility_r2.report --collect  # runs/ -> results/, tables
    python -m experiments.routing_volatility_r2.report            # tables from results/
    python -m experiments.routing_volatility_r2.report --print    # print only

`--collect` distills every finished run under runs/routing_volatility_r2/<candidate>/<lever>/
into results/arms/<candidate>__<lever>/<arm>_s<seed>.json (committed; the positive control's
`run_stats`: test accuracy at the first and last step, collapse counted two ways, means over
the run's steps of the routing log-ratio, clip fraction, flips) and records the machine and
the cold starts; the tables come from results/ alone. Arms are compared paired by seed (95% t
interval of the difference).
"""

from __future__ import annotations

import argparse
import os
import re

from experiments.positive_control.common import ROOT, load_json, write_json
from experiments.positive_control.report import run_stats
from experiments.positive_control.rescore import excludes_zero, pm
from experiments.routing_volatility_r2.common import CANDIDATES, HERE, RUNS
from megatron_gspo.jobs.band import cold_start_line
from tools.result_table import machine_line, write_into

RUN_RE = re.compile(r"^(?P<arm>[a-z0-9_]+?)_s(?P<seed>\d+)$")
LABELS = {"grpo": "GRPO", "grpo_r2": "GRPO + R2", "gspo": "GSPO", "gspo_r2": "GSPO + R2"}
PAIRS = (("grpo_r2", "grpo"), ("gspo", "grpo"), ("gspo_r2", "gspo"))
"""(with, without): what R2 does to GRPO and to GSPO, and GSPO against GRPO."""
RESULTS = os.path.join(HERE, "results", "arms")


def distill(runs_root: str, results_root: str) -> tuple[int, dict]:
    """`run_stats` of every finished run under `runs_root/<candidate>/<lever>/` into
    `results_root/<candidate>__<lever>/<run>.json`; (how many, {candidate: its cold start
    line})."""
    n, starts = 0, {}
    for candidate in CANDIDATES:
        cdir = os.path.join(runs_root, candidate)
        for lever in sorted(os.listdir(cdir)) if os.path.isdir(cdir) else []:
            ldir = os.path.join(cdir, lever)
            for name in sorted(os.listdir(ldir)) if os.path.isdir(ldir) else []:
                path = os.path.join(ldir, name, "metrics.jsonl")
                if RUN_RE.match(name) and os.path.exists(path) \
                        and (stats := run_stats(path)) is not None:
                    write_json(os.path.join(results_root, f"{candidate}__{lever}",
                                            f"{name}.json"), stats)
                    n += 1
                    starts[candidate] = cold_start_line(os.path.join(
                        runs_root, f"sft_{candidate}")).replace(ROOT + os.sep, "")
    return n, starts


def collect(results_root: str) -> dict:
    """{(candidate, lever): {arm: {seed: stats}}} from the distilled runs."""
    out: dict = {}
    for setting in sorted(os.listdir(results_root)) if os.path.isdir(results_root) else []:
        sdir = os.path.join(results_root, setting)
        if "__" not in setting or not os.path.isdir(sdir):
            continue
        for name in sorted(os.listdir(sdir)):
            m = RUN_RE.match(name.removesuffix(".json"))
            if m and (stats := load_json(os.path.join(sdir, name))) is not None:
                out.setdefault(tuple(setting.split("__")), {}).setdefault(
                    m["arm"], {})[int(m["seed"])] = stats
    return out


def arms_table(arms: dict) -> str:
    """One row per arm of one (candidate, lever)."""
    lines = ["| arm | seeds | collapsed: reward < 0.01 / final below start | start acc | "
             "final acc | routing log-ratio | tokens past 0.2 (routing) | clip frac | "
             "flips per step |", "|" + " --- |" * 9]
    for arm in [a for a in LABELS if a in arms]:
        v = list(arms[arm].values())
        lines.append(
            f"| {LABELS[arm]} | {len(v)} | {sum(x['collapsed'] for x in v)} / "
            f"{sum(x['below_start'] for x in v)} | {pm([x['start'] for x in v])} | "
            f"{pm([x['final'] for x in v])} | {pm([x['routing_lr'] for x in v], '.4f')} | "
            f"{pm([x['routing_past'] for x in v], '.4f')} | "
            f"{pm([x['clip'] for x in v], '.4f')} | {pm([x['flips'] for x in v], '.4f')} |")
    return "\n".join(lines)


def answer_table(runs: dict) -> str:
    """Per (candidate, lever) and pair: the paired gap in final test accuracy."""
    lines = ["| candidate | lever | comparison | seeds | final acc gap (paired) | interval "
             "excludes 0 | collapsed, with / without |", "|" + " --- |" * 7]
    for (candidate, lever), arms in sorted(runs.items()):
        for a, b in PAIRS:
            ra, rb = arms.get(a, {}), arms.get(b, {})
            seeds = sorted(set(ra) & set(rb))
            if not seeds:
                continue
            gaps = [ra[s]["final"] - rb[s]["final"] for s in seeds]
            lines.append(f"| {candidate} | {lever} | {LABELS[a]} vs {LABELS[b]} | "
                         f"{len(seeds)} | {pm(gaps)} | {excludes_zero(gaps)} | "
                         f"{sum(ra[s]['collapsed'] for s in seeds)} / "
                         f"{sum(rb[s]['collapsed'] for s in seeds)} |")
    return "\n".join(lines)


def tables(runs: dict, record: dict) -> str:
    """The arms tables of every (candidate, lever), each under its cold start."""
    parts = [record.get("line") or machine_line(), "Accuracy: greedy on the test split (256 "
             "prompts) at the first and last step; ± = 95% t interval over seeds; routing "
             "log-ratio, its tokens past 0.2, clip fraction and flips: means over each run's "
             "steps (the routing log-ratio over minibatches 2-4)."]
    for (candidate, lever), arms in sorted(runs.items()):
        parts += ["", f"**{candidate}, lever {lever}** ("
                  f"{record.get('cold_starts', {}).get(candidate, 'cold start not recorded')})",
                  "", arms_table(arms)]
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the tables only")
    ap.add_argument("--collect", action="store_true",
                    help=f"first distill {RUNS}/<candidate>/<lever>/*/metrics.jsonl")
    args = ap.parse_args(argv)
    measured = os.path.join(RESULTS, "measured.json")
    if args.collect:
        n, starts = distill(os.path.join(ROOT, RUNS), RESULTS)
        print(f"distilled {n} runs into {RESULTS}")
        if n:
            write_json(measured, {"line": machine_line(), "cold_starts": starts})
    runs = collect(RESULTS)
    if not runs:
        return 0
    out = {"arms": tables(runs, load_json(measured) or {}), "answer": answer_table(runs)}
    for marker, text in out.items():
        print(text, "\n", flush=True)
        if not args.print:
            write_into(os.path.join(HERE, "README.md"), text, marker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
