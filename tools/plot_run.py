"""Plot training-run metrics (metrics.jsonl) as small PNG figures and print a summary table.

Usage:
    python -m tools.plot_run RUN_DIR [RUN_DIR ...] --out OUT_DIR [--labels a b ...]
                             [--group-by-prefix] [--smooth N]
    python -m tools.plot_run RUN_DIR [RUN_DIR ...] --table [--stat KEY:REDUCER[=LABEL] ...]
                             [--readme FILE.md [--marker NAME]] [--group-by-prefix]

    python -m tools.plot_run runs/gspo runs/grpo --out figs
    python -m tools.plot_run runs/gspo_s0 runs/gspo_s1 runs/grpo_s0 runs/grpo_s1 \\
        --out figs --group-by-prefix --smooth 5

Each RUN_DIR holds `metrics.jsonl` (one JSON object per line with an integer `step`; a path to
the .jsonl file itself is accepted too). Keys may be absent from some lines, and the values
"nan"/"inf" (strings or floats) count as missing. A run's label is its directory's basename,
or the matching entry of `--labels` (one per RUN_DIR). With `--group-by-prefix`, runs whose
labels differ only by a seed suffix (`_s0`, `-s1`, `_seed2`) form one arm: lines show the
per-step mean over seeds with a min-max band, on the steps that every seed logged. A label given
twice is an error, also under `--group-by-prefix` (it would count one seed twice).

Figures (each skipped, with a note, when no run has the keys it needs):
    reward.png            reward/mean vs step (moving average over --smooth N points)
    eval_accuracy.png     eval/accuracy vs step
    clip_fraction.png     policy/clip_frac/token vs step, log y (zeros dropped); GSPO clips
                          ~2 orders of magnitude more tokens than GRPO (arXiv 2507.18071, Fig. 2)
    flip_rate_layers.png  heatmap of moe/flip_rate/layer_XX (layer x step), one panel per run/arm
    flip_rate_mean.png    moe/flip_rate/mean vs step
    flip_vs_depth.png     mean over steps of moe/flip_rate/layer_XX vs layer index
    expert_load.png       per run with an expert_load.jsonl: the load of each expert and layer
                          over steps beside its per-layer flip heatmap (`tools.plot_load`)
moe/flip_rate counts the loss positions (`megatron_gspo.algo.flips`); runs logged before that change
counted every token, which is now moe/flip_rate_all.

`--table` prints a Markdown table (seed mean ± std per arm of each `--stat`, plus the start
accuracy, under a line naming the CPU, date, torch and megatron-core) and with `--readme`
writes it between that file's `<!-- table:NAME:begin/end -->` markers (`tools/result_table.py`).

Summary (stdout; also `summarize(load_runs(dirs))` from Python), per run/arm: final reward
(mean of the last 10% of logged steps, at least one), best eval accuracy, mean token clip
fraction, mean flip rate and per-layer mean flip rates, plus the last eval accuracy. For an arm each statistic is computed
per seed, then averaged over the seeds that have it. A step logged twice keeps its last value.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

import numpy as np

from tools import result_table
from tools.plot_load import plot_expert_load
from megatron_gspo.run.metrics import METRICS_FILE, read_metrics

LAYER_RE = re.compile(r"^moe/flip_rate/layer_(\d+)$")
SEED_RE = re.compile(r"^(.+?)[_-](?:s|seed)\d+$")
FIG_KW = dict(figsize=(6, 4), dpi=90)


# ----------------------------------------------------------------------------- loading

def _metrics_path(d: str) -> str:
    path = d if os.path.isfile(d) else os.path.join(d, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} for run {d!r}: {path!r} does not exist")
    return path


def _default_label(d: str) -> str:
    d = os.path.normpath(d)
    if os.path.isfile(d):
        d = os.path.dirname(d) or "."
    return os.path.basename(os.path.abspath(d))


def seed_prefix(label: str) -> str:
    """`gspo_s0` -> `gspo`; labels without a seed suffix are their own arm."""
    m = SEED_RE.match(label)
    return m.group(1) if m else label


def load_runs(dirs, labels=None, group_by_prefix=False) -> list[dict]:
    """Load run dirs into a list of runs/arms (first-appearance order), each
    {"label": str, "dirs": [str], "seeds": [{key: {step: value}}, ...]}."""
    dirs = list(dirs)
    if not dirs:
        raise ValueError("no run directories given")
    if labels is not None and len(labels) != len(dirs):
        raise ValueError(f"--labels has {len(labels)} entries but {len(dirs)} run dirs were "
                         f"given: {list(labels)}")
    labels = list(labels) if labels is not None else [_default_label(d) for d in dirs]
    runs: dict[str, dict] = {}
    first_dir: dict[str, str] = {}  # a label given twice (even as seeds of one arm) is an error
    for d, lab in zip(dirs, labels):
        if lab in first_dir:
            raise ValueError(f"duplicate run label {lab!r} ({first_dir[lab]!r} and {d!r}); pass "
                             "--labels")
        first_dir[lab] = d
        data = read_metrics(_metrics_path(d))
        arm = seed_prefix(lab) if group_by_prefix else lab
        run = runs.setdefault(arm, {"label": arm, "dirs": [], "seeds": []})
        run["dirs"].append(d)
        run["seeds"].append(data)
    return list(runs.values())


# ----------------------------------------------------------------------------- statistics

def series(run: dict, key: str):
    """(steps, mean, lo, hi) over seeds on the steps every seed logged; None if none did."""
    per_seed = [s.get(key, {}) for s in run["seeds"]]
    steps = sorted(set.intersection(*(set(p) for p in per_seed)))
    if not steps:
        return None
    vals = np.array([[p[t] for t in steps] for p in per_seed], dtype=np.float64)
    return np.array(steps), vals.mean(0), vals.min(0), vals.max(0)


def layer_keys(runs) -> list[tuple[int, str]]:
    """Sorted (layer index, key) of every moe/flip_rate/layer_XX key in any run."""
    found = {}
    for run in runs:
        for seed in run["seeds"]:
            for k in seed:
                m = LAYER_RE.match(k)
                if m:
                    found[int(m.group(1))] = k
    return sorted(found.items())


def _seed_stats(seed: dict) -> dict:
    def vals(key):
        d = seed.get(key, {})
        return [d[t] for t in sorted(d)]

    out = {}
    r = vals("reward/mean")
    if r:
        n = max(1, math.ceil(0.1 * len(r)))
        out["final_reward"] = float(np.mean(r[-n:]))
    for name, key, fn in (("best_eval_acc", "eval/accuracy", np.max),
                          ("final_eval_acc", "eval/accuracy", lambda v: v[-1]),
                          ("clip_frac_token", "policy/clip_frac/token", np.mean),
                          ("flip_rate_mean", "moe/flip_rate/mean", np.mean)):
        v = vals(key)
        if v:
            out[name] = float(fn(v))
    out["flip_rate_layers"] = {int(LAYER_RE.match(k).group(1)): float(np.mean(vals(k)))
                               for k in seed if LAYER_RE.match(k) and seed[k]}
    return out


def _mean_or_none(xs):
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def summarize(runs) -> list[dict]:
    """Per run/arm: label, n_seeds, last_step, final_reward, best_eval_acc, final_eval_acc,
    clip_frac_token, flip_rate_mean (None when missing) and flip_rate_layers {layer: mean over
    steps}."""
    rows = []
    for run in runs:
        stats = [_seed_stats(s) for s in run["seeds"]]
        steps = [t for s in run["seeds"] for d in s.values() for t in d]
        row = {"label": run["label"], "n_seeds": len(run["seeds"]),
               "last_step": max(steps) if steps else None}
        for name in ("final_reward", "best_eval_acc", "final_eval_acc", "clip_frac_token",
                     "flip_rate_mean"):
            row[name] = _mean_or_none([s.get(name) for s in stats])
        layers = sorted({i for s in stats for i in s["flip_rate_layers"]})
        row["flip_rate_layers"] = {
            i: _mean_or_none([s["flip_rate_layers"].get(i) for s in stats]) for i in layers}
        rows.append(row)
    return rows


def format_summary(rows) -> str:
    cols = ("label", "n_seeds", "last_step", "final_reward", "best_eval_acc", "final_eval_acc",
            "clip_frac_token", "flip_rate_mean")

    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    table = [list(cols)] + [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[j]) for line in table) for j in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table]
    if any(r["flip_rate_layers"] for r in rows):
        lines.append("per-layer mean flip rate:")
        for r in rows:
            if r["flip_rate_layers"]:
                cells = " ".join(f"L{i:02d}={v:.3g}" for i, v in r["flip_rate_layers"].items())
                lines.append(f"  {r['label']}: {cells}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plotting

def pyplot():
    """matplotlib's pyplot, drawing into files (the Agg backend): the figures here, in bench/
    and in experiments/."""
    # optional dependency (the [plot] extra): only a figure needs it; the backend before pyplot
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen
    return plt


def smooth(y, n: int):
    """Trailing moving average over n points (shorter window at the start)."""
    y = np.asarray(y, dtype=np.float64)
    if n <= 1 or y.size == 0:
        return y
    c = np.cumsum(np.concatenate([[0.0], y]))
    idx = np.arange(1, y.size + 1)
    lo = np.maximum(idx - n, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _int_ticks(ax, x=True, y=False):
    if x:
        ax.xaxis.set_major_locator(pyplot().MaxNLocator(integer=True))
    if y:
        ax.yaxis.set_major_locator(pyplot().MaxNLocator(integer=True))


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=FIG_KW["dpi"])
    pyplot().close(fig)
    print(f"wrote {path}")


def plot_lines(runs, key, path, ylabel, smooth_n=1, logy=False) -> bool:
    """One line (mean, min-max band for arms) per run that has `key`; False if none has it."""
    curves = [(r["label"], s) for r in runs if (s := series(r, key)) is not None]
    if not curves:
        print(f"note: skipping {os.path.basename(path)}: no run has {key!r}")
        return False
    plt = pyplot()
    fig, ax = plt.subplots(**FIG_KW)
    for label, (x, m, lo, hi) in curves:
        m, lo, hi = (smooth(a, smooth_n) for a in (m, lo, hi))
        keep = m > 0 if logy else np.ones_like(m, dtype=bool)
        line, = ax.plot(x[keep], m[keep], label=label, lw=1.4)
        if (lo != hi).any():
            band = keep & (lo > 0) if logy else keep
            ax.fill_between(x[band], lo[band], hi[band], color=line.get_color(), alpha=0.2, lw=0)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    _int_ticks(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(key + (f" (smoothed, {smooth_n})" if smooth_n > 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def flip_grid(run, keys):
    """(steps, layer x step flip rates) of `run` for `layer_keys`' `keys`; None if it has
    none."""
    rows = [(i, series(run, k)) for i, k in keys]
    rows = [(i, s) for i, s in rows if s is not None]
    if not rows:
        return None
    steps = sorted({int(t) for _, s in rows for t in s[0]})
    col = {t: j for j, t in enumerate(steps)}
    grid_LS = np.full((len(keys), len(steps)), np.nan)
    pos = {i: n for n, (i, _) in enumerate(keys)}
    for i, (x, m, _, _) in rows:
        grid_LS[pos[i], [col[int(t)] for t in x]] = m
    return np.array(steps), grid_LS


def plot_flip_heatmap(runs, path) -> bool:
    """Layers (y) x steps (x) heatmap of the per-layer flip rate, one panel per run/arm."""
    keys = layer_keys(runs)
    panels = [(r["label"], *grid) for r in runs if (grid := flip_grid(r, keys)) is not None]
    if not panels:
        print(f"note: skipping {os.path.basename(path)}: no run has moe/flip_rate/layer_XX")
        return False
    plt = pyplot()
    vmax = max(float(np.nanmax(g)) for _, _, g in panels) or 1.0
    fig, axes = plt.subplots(1, len(panels), figsize=(min(3.2 * len(panels) + 1, 12), 4),
                             dpi=FIG_KW["dpi"], sharey=True, squeeze=False, layout="constrained")
    layers = np.array([i for i, _ in keys])
    for ax, (label, steps, grid_LS) in zip(axes[0], panels):
        mesh = ax.pcolormesh(steps, layers, np.ma.masked_invalid(grid_LS), shading="nearest",
                             vmin=0.0, vmax=vmax, cmap="viridis")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        _int_ticks(ax, y=True)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(mesh, ax=list(axes[0]), label="moe/flip_rate")
    fig.savefig(path, dpi=FIG_KW["dpi"])
    plt.close(fig)
    print(f"wrote {path}")
    return True


def plot_flip_vs_depth(runs, path) -> bool:
    """Mean over steps of each layer's flip rate vs layer index (min-max band over seeds)."""
    curves = []
    for r in runs:
        per_seed = [_seed_stats(s)["flip_rate_layers"] for s in r["seeds"]]
        layers = sorted(set.intersection(*(set(p) for p in per_seed)))
        if layers:
            v = np.array([[p[i] for i in layers] for p in per_seed])
            curves.append((r["label"], np.array(layers), v.mean(0), v.min(0), v.max(0)))
    if not curves:
        print(f"note: skipping {os.path.basename(path)}: no run has moe/flip_rate/layer_XX")
        return False
    plt = pyplot()
    fig, ax = plt.subplots(**FIG_KW)
    for label, x, m, lo, hi in curves:
        line, = ax.plot(x, m, marker="o", ms=3, label=label)
        if (lo != hi).any():
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel("layer index")
    _int_ticks(ax)
    ax.set_ylabel("mean moe/flip_rate over steps")
    ax.set_title("expert flip rate vs depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def make_figures(runs, out_dir, smooth_n=1) -> list[str]:
    """Write every figure whose keys some run has; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    p = lambda name: os.path.join(out_dir, name)  # noqa: E731
    jobs = [
        (p("reward.png"), lambda f: plot_lines(runs, "reward/mean", f, "reward", smooth_n)),
        (p("eval_accuracy.png"), lambda f: plot_lines(runs, "eval/accuracy", f, "accuracy")),
        (p("clip_fraction.png"), lambda f: plot_lines(
            runs, "policy/clip_frac/token", f, "clipped token fraction", smooth_n, logy=True)),
        (p("flip_rate_layers.png"), lambda f: plot_flip_heatmap(runs, f)),
        (p("flip_rate_mean.png"), lambda f: plot_lines(
            runs, "moe/flip_rate/mean", f, "flip rate", smooth_n)),
        (p("flip_vs_depth.png"), lambda f: plot_flip_vs_depth(runs, f)),
        (p("expert_load.png"), lambda f: plot_expert_load(runs, f, pyplot, flip_grid,
                                                          layer_keys(runs))),
    ]
    return [f for f, job in jobs if job(f)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--out", default=None, metavar="OUT_DIR", help="figures folder")
    ap.add_argument("--table", action="store_true", help="print a Markdown result table")
    ap.add_argument("--stat", action="append", default=[], metavar="KEY:REDUCER[=LABEL]",
                    help="a table row (repeatable; see tools/result_table.py)")
    ap.add_argument("--readme", default=None, help="write the table between this file's markers")
    ap.add_argument("--marker", default="", help="the markers' NAME: <!-- table:NAME:begin -->")
    ap.add_argument("--labels", nargs="+", default=None)
    ap.add_argument("--group-by-prefix", action="store_true")
    ap.add_argument("--smooth", type=int, default=1, metavar="N")
    args = ap.parse_args(argv)
    if args.smooth < 1:
        print(f"error: --smooth must be >= 1, got {args.smooth}", file=sys.stderr)
        return 2
    if not (args.out or args.table) or (args.readme and not args.table):
        print("error: give --out OUT_DIR (figures) and/or --table (--readme needs --table)",
              file=sys.stderr)
        return 2
    try:
        runs = load_runs(args.run_dirs, args.labels, args.group_by_prefix)
        table = result_table.format_table(runs, args.stat) if args.table else None
        if args.readme:
            result_table.write_into(args.readme, table, args.marker)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        make_figures(runs, args.out, args.smooth)
        print(format_summary(summarize(runs)))
    if table is not None:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
