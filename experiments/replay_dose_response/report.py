"""Table and figure of the dose-response runs (called by run.py; no training here).

Usage:
    python -m experiments.replay_dose_response.report RUNS_DIR [--readme README.md] [--figure F]

Per run (RUNS_DIR/<arm>_<level>_s<seed>/metrics.jsonl): `final_acc` = the last eval/accuracy;
`flip` = mean over optimizer steps of `moe/flip_rate/mean` (loss positions: the routing the
loss's forward used vs the clean routing just after the step, noise included); `clip` = mean
`policy/clip_frac/token`; `lr0` = mean `policy/log_ratio/abs_mean` over each rollout batch's
first minibatch (pi == pi_old there, so the log-ratio is routing-induced). Gaps are paired by
seed (same cold start, same rollout seed): gap_s = acc(arm, s) - acc(GRPO, s); the interval is
mean +- t(0.975, n-1) * sd / sqrt(n) over seeds. GRPO + R2 is run at n0 only (noise has no
effect under replay) and compared with GRPO at every level.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

RUN_RE = re.compile(r"^(grpo_r2|grpo|gspo)_(n0|f\d\d)_s(\d+)$")
MM_RE = re.compile(r"^(grpo_bf16|grpo_r3_bf16|grpo_tis_bf16)_s(\d+)$")
MM_LABELS = {"grpo_bf16": "GRPO, bf16 sampler", "grpo_r3_bf16": "GRPO + R3, bf16 sampler",
             "grpo_tis_bf16": "GRPO + TIS (cap 2), bf16 sampler"}
# t(0.975, df) for df 1..30; beyond, the normal 1.96 (t(0.975, 30) = 2.042).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131,
        16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074,
        23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}
LABELS = {"grpo": "GRPO", "grpo_r2": "GRPO + R2", "gspo": "GSPO"}
MARKER = "dose"


def run_stats(path: str) -> dict | None:
    """The per-run numbers above, or None for a run without a final eval."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "moe/flip_rate/mean" in r]
    if len(evals) < 2 or not steps:
        return None

    def mean(key, rs):
        vals = [r[key] for r in rs if key in r and r[key] == r[key]]
        return sum(vals) / len(vals) if vals else float("nan")
    first = [r for r in steps if r.get("train/minibatch") == 0]
    return {"start_acc": evals[0], "final_acc": evals[-1],
            "flip": mean("moe/flip_rate/mean", steps),
            "flip_all": mean("moe/flip_rate_all/mean", steps),
            "clip": mean("policy/clip_frac/token", steps),
            "lr0": mean("policy/log_ratio/abs_mean", first),
            "reward": mean("reward/mean", steps[-len(steps) // 4:]),
            "lp_mm": mean("rollout/logprob_mismatch/mean", steps),
            "route_mm": mean("rollout/routing_mismatch/mean", steps),
            "route_mm_all": mean("rollout/routing_mismatch_all/mean", steps)}


def collect(root: str) -> dict:
    """{(arm, level): {seed: stats}} over the finished runs in `root`."""
    out: dict = {}
    for name in sorted(os.listdir(root)):
        m, mm = RUN_RE.match(name), MM_RE.match(name)
        path = os.path.join(root, name, "metrics.jsonl")
        if not (m or mm) or not os.path.exists(path):
            continue
        stats = run_stats(path)
        key = (m.group(1), m.group(2)) if m else (mm.group(1), "mm")
        if stats is not None:
            out.setdefault(key, {})[int((m or mm).groups()[-1])] = stats
    return out


def ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval); half-width NaN for one value, both NaN for no
    value (an arm with no finished seed) or when a value is NaN (a metric some run did not log)."""
    if not xs or any(x != x for x in xs):
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def rows(runs: dict, calib: dict) -> list[dict]:
    """One row per noise level: std, measured flips, per-arm accuracy and paired gaps."""
    stds = {"n0": 0.0, **{f"f{round(float(t) * 100):02d}": s
                          for t, s in calib["targets"].items()}}
    r2 = runs.get(("grpo_r2", "n0"), {})
    out = []
    for level in sorted({lv for _, lv in runs if lv != "mm"}, key=lambda lv: stds.get(lv, 0.0)):
        grpo = runs.get(("grpo", level), {})
        row = {"level": level, "std": stds.get(level, float("nan")), "n": len(grpo)}
        for key in ("flip", "flip_all", "clip", "lr0"):
            row[key] = ci([s[key] for s in grpo.values()])
        row["gspo_clip"] = ci([s["clip"] for s in runs.get(("gspo", level), {}).values()])
        for arm, seeds in (("grpo", grpo), ("grpo_r2", r2),
                           ("gspo", runs.get(("gspo", level), {}))):
            row[f"acc_{arm}"] = ci([s["final_acc"] for s in seeds.values()])
        for arm, seeds in (("grpo_r2", r2), ("gspo", runs.get(("gspo", level), {}))):
            paired = [seeds[s]["final_acc"] - grpo[s]["final_acc"] for s in grpo if s in seeds]
            row[f"gap_{arm}"] = ci(paired)
        out.append(row)
    return out


def _pm(v: tuple[float, float], fmt: str = ".3f") -> str:
    m, h = v
    return f"{m:{fmt}}" if h != h else f"{m:{fmt}} ± {h:{fmt}}"


def table(rs: list[dict], start_acc: float) -> str:
    """Markdown table; ± is the 95% t interval over seeds."""
    head = ("| noise level | std | seeds | GRPO flip rate / step (loss positions) | all tokens "
            "| GRPO routing-induced abs log-ratio | GRPO clip frac | GSPO clip frac "
            "| GRPO acc | GRPO + R2 acc | GSPO acc | R2 - GRPO | GSPO - GRPO |")
    lines = [f"Cold start held-out accuracy {start_acc:.3f}; accuracy = last eval (greedy, "
             "held-out); ± = 95% t interval over seeds (gaps paired by seed).", "", head,
             "|" + " --- |" * 13]
    for r in rs:
        lines.append(
            f"| {r['level']} | {r['std']:.4g} | {r['n']} | {_pm(r['flip'], '.4f')} "
            f"| {_pm(r['flip_all'], '.4f')} | {_pm(r['lr0'], '.4f')} | {_pm(r['clip'], '.4f')} "
            f"| {_pm(r['gspo_clip'], '.3f')} | {_pm(r['acc_grpo'])} | {_pm(r['acc_grpo_r2'])} "
            f"| {_pm(r['acc_gspo'])} | {_pm(r['gap_grpo_r2'])} | {_pm(r['gap_gspo'])} |")
    return "\n".join(lines)


def mismatch_table(runs: dict) -> str:
    """The bf16-sampler arms vs GRPO with an fp32 sampler (n0), paired by seed."""
    base = runs.get(("grpo", "n0"), {})
    head = ("| arm | seeds | sampler vs trainer abs log-prob diff | routing mismatch (loss "
            "positions) | all tokens | first-minibatch abs log-ratio | clip frac | acc "
            "| acc - GRPO (fp32 sampler) |")
    lines = [head, "|" + " --- |" * 9]
    for arm, label in MM_LABELS.items():
        seeds = runs.get((arm, "mm"), {})
        if not seeds:
            continue
        col = {k: ci([s[k] for s in seeds.values()]) for k in
               ("lp_mm", "route_mm", "route_mm_all", "lr0", "clip", "final_acc")}
        gap = ci([seeds[s]["final_acc"] - base[s]["final_acc"] for s in seeds if s in base])
        lines.append(f"| {label} | {len(seeds)} | {_pm(col['lp_mm'], '.4f')} "
                     f"| {_pm(col['route_mm'], '.4f')} | {_pm(col['route_mm_all'], '.4f')} "
                     f"| {_pm(col['lr0'], '.4f')} | {_pm(col['clip'], '.4f')} "
                     f"| {_pm(col['final_acc'])} | {_pm(gap)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def calibration_table(calib: dict) -> str:
    """The calibration grid (one rollout batch of the cold start, clean vs noisy forward)."""
    lines = ["| noise std | flip rate (loss positions) | abs log-prob change, response tokens |",
             "| --- | --- | --- |"]
    lines += [f"| {g['std']:.4g} | {g['flip_rate']:.4f} | {g['abs_log_ratio']:.4f} |"
              for g in calib["grid"]]
    picked = ", ".join(f"{float(t):.0%} -> {v:.4g}" for t, v in calib["targets"].items())
    return "\n".join(lines) + f"\n\nInterpolated stds (target flip rate -> std): {picked}."


def figure(rs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["flip"][0] for r in rs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label, c, shift in (("gap_grpo_r2", "GRPO + R2 − GRPO", "tab:blue", 0.96),
                                 ("gap_gspo", "GSPO − GRPO", "tab:orange", 1.04)):
        y = [r[key][0] for r in rs]
        err = [0 if r[key][1] != r[key][1] else r[key][1] for r in rs]
        a.errorbar([v * shift for v in x], y, yerr=err, marker="o", capsize=3, label=label,
                   color=c)
    a.axhline(0, color="grey", lw=0.8)
    a.set_xscale("log")
    a.set_xlabel("measured per-step expert flip rate, loss positions (GRPO)")
    a.set_ylabel("final held-out accuracy gap")
    a.set_title("accuracy gap vs routing volatility (95% CI, seeds)")
    a.legend(fontsize=8)
    floor = 1e-4
    lr0 = [r["lr0"][0] for r in rs]
    b.plot(x, [r["clip"][0] for r in rs], "o-", color="tab:red", label="GRPO token clip frac")
    b.plot(x, [r["gspo_clip"][0] for r in rs], "^:", color="tab:orange",
           label="GSPO token clip frac")
    b.plot(x, [max(v, floor) for v in lr0], "s--", color="tab:green",
           label="GRPO routing-induced |log-ratio| (first minibatch)")
    for xi, v in zip(x, lr0):
        if v < floor:
            b.annotate(f"{v:.0e} (rounding)", (xi, floor), textcoords="offset points",
                       xytext=(4, 6), fontsize=7, color="tab:green")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_ylim(floor / 2, 300)
    b.set_xlabel("measured per-step expert flip rate, loss positions (GRPO)")
    b.set_title("what the ratios see")
    b.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_readme(readme: str, text: str, marker: str = MARKER) -> None:
    begin, end = f"<!-- table:{marker}:begin -->", f"<!-- table:{marker}:end -->"
    with open(readme) as f:
        doc = f.read()
    if begin not in doc or end not in doc:
        raise ValueError(f"{readme} lacks the {begin} ... {end} markers")
    head, rest = doc.split(begin, 1)
    with open(readme, "w") as f:
        f.write(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


PER_ARM_STATS = ("eval/accuracy:final", "eval/accuracy:best", "reward/mean:last25%",
                 "policy/entropy:last25%", "policy/clip_frac/token:mean",
                 "moe/flip_rate/mean:mean", "moe/drift_vs_old/mean:mean",
                 "rollout/logprob_mismatch/mean:mean")


def per_arm_table(root: str, readme: str | None, marker: str = MARKER) -> None:
    """tools/plot_run.py --table over every run (one column per arm and level, seeds grouped),
    into the README's `<!-- table:MARKER_runs:... -->` markers when `readme` is given."""
    from tools import plot_run

    dirs = [os.path.join(root, n) for n in sorted(os.listdir(root))
            if (RUN_RE.match(n) or MM_RE.match(n)) and os.path.isdir(os.path.join(root, n))]
    argv = [*dirs, "--group-by-prefix", "--table"]
    for stat in PER_ARM_STATS:
        argv += ["--stat", stat]
    if readme:
        argv += ["--readme", readme, "--marker", f"{marker}_runs"]
    if plot_run.main(argv) != 0:
        raise SystemExit("tools.plot_run --table failed")


def main(root: str, calib_path: str, readme: str | None = None,
         figure_path: str | None = None, marker: str = MARKER,
         cold_start: str | None = None) -> str:
    """Tables (into `readme`'s `table:MARKER` and `table:MARKER_runs` markers) and figure;
    `cold_start` (`megatron_gspo.jobs.band.cold_start_line`) heads them."""
    if not os.path.isfile(calib_path):
        raise SystemExit(f"no calibration {calib_path}: run the experiment first")
    with open(calib_path) as f:
        calib = json.load(f)
    runs = collect(root)
    if not runs:
        raise SystemExit(f"no finished runs in {root}")
    starts = [s["start_acc"] for seeds in runs.values() for s in seeds.values()]
    text = table(rows(runs, calib), statistics.fmean(starts))
    if cold_start:
        text = f"{cold_start[0].upper()}{cold_start[1:]}.\n" + text
    text += "\n\nNoise calibration on the cold start:\n\n" + calibration_table(calib)
    mm = mismatch_table(runs)
    if mm:
        text += "\n\nTrain-inference mismatch (noise 0, sampler under bf16 autocast, trainer " \
                "fp32):\n\n" + mm
    print(text, flush=True)
    with open(os.path.join(root, "table.md"), "w") as f:
        f.write(text + "\n")
    if readme:
        write_readme(readme, text, marker)
    per_arm_table(root, readme, marker)
    if figure_path:
        figure(rows(runs, calib), figure_path)
        print(f"figure: {figure_path} ({os.path.getsize(figure_path) // 1024} KB)", flush=True)
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--readme", default=None)
    ap.add_argument("--figure", default=None)
    a = ap.parse_args()
    main(a.root, a.calibration or os.path.join(a.root, "calibration.json"), a.readme, a.figure)
