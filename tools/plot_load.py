"""The expert-load figure of `tools.plot_run`: where each MoE layer sends its tokens, step by
step, beside how often its routing flips.

Shape legend: S logged steps, L MoE layers, E experts.

`expert_load.png`, one row of two panels per run (a run whose dir has `expert_load.jsonl`, the
`expert_load` instrument's file; an arm of several seeds shows its first seed's):
    left   the load of every expert of every layer (y: layer-major, layer 0's experts at the
           bottom, a line between layers) over the steps (x), as a share of its layer's mean
           load (1 = balanced), on a log colour scale from 1/8 to 8;
    right  the per-layer flip rate `moe/flip_rate/layer_XX` (layer x step), where the run
           measured it.
"""

from __future__ import annotations

import os

import numpy as np

from megatron_gspo.run.metrics import EXPERT_LOAD_FILE, read_jsonl

SHARE_RANGE = (1 / 8, 8.0)
"""The colour scale's ends, as a share of the layer's mean load."""
SHARE_TICKS = [1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8]


def read_load(run_dir: str):
    """(steps [S], load [S, L, E]) of a run dir's expert_load.jsonl (a step logged twice keeps
    its last row); None without the file or a row."""
    folder = os.path.dirname(run_dir) if os.path.isfile(run_dir) else run_dir
    path = os.path.join(folder, EXPERT_LOAD_FILE)
    if not os.path.isfile(path):
        return None
    rows = {int(r["step"]): r["load"] for r in read_jsonl(path) if "load" in r}
    if not rows:
        return None
    steps = sorted(rows)
    return np.array(steps), np.array([rows[s] for s in steps], dtype=np.float64)


def load_share(load_SLE: np.ndarray) -> np.ndarray:
    """Each expert's load over its layer's mean at that step (NaN for a layer without a
    token)."""
    mean_SL1 = load_SLE.mean(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean_SL1 > 0, load_SLE / mean_SL1, np.nan)


def plot_expert_load(runs, path, pyplot, flip_grid, keys) -> bool:
    """The figure for every run/arm of `tools.plot_run.load_runs` whose (first) dir has an
    expert_load.jsonl, with its flip rates where it has them (`flip_grid(run, keys)`: (steps,
    layer x step grid) or None, over `keys`, plot_run's `layer_keys`); `pyplot()` gives
    matplotlib's pyplot. False (and a note) without such a run."""
    panels, layers = [], np.array([i for i, _ in keys])
    for r in runs:
        load = read_load(r["dirs"][0])
        if load is not None:
            grid = flip_grid(r, keys)
            flips = None if grid is None else (grid[0], layers, grid[1])
            panels.append((r["label"], *load, flips))
    return plot_load_and_flips(panels, path, pyplot() if panels else None)


def plot_load_and_flips(panels, path, plt) -> bool:
    """`panels`: [(label, steps [S], load [S, L, E], flips or None)], `flips` = (steps, layers,
    flip rate [layers, steps]); `plt` is matplotlib's pyplot. False (and a note) without a
    panel."""
    if not panels:
        print(f"note: skipping {os.path.basename(path)}: no run has {EXPERT_LOAD_FILE}")
        return False
    from matplotlib.colors import LogNorm  # noqa: PLC0415 (optional dependency, as plt)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (likewise)

    fig, axes = plt.subplots(len(panels), 2, figsize=(9, 3.2 * len(panels)), dpi=90,
                             squeeze=False, layout="constrained",
                             gridspec_kw={"width_ratios": [3, 2]})
    for (left, right), (label, steps, load_SLE, flips) in zip(axes, panels):
        _, L, E = load_SLE.shape
        share_RS = load_share(load_SLE).reshape(len(steps), L * E).T  # rows: layer-major
        share_RS = np.clip(share_RS, *SHARE_RANGE)
        mesh = left.pcolormesh(steps, np.arange(L * E), np.ma.masked_invalid(share_RS),
                               shading="nearest", cmap="RdBu_r", norm=LogNorm(*SHARE_RANGE))
        for layer in range(1, L):
            left.axhline(layer * E - 0.5, color="k", lw=0.5)
        left.set_yticks([layer * E + (E - 1) / 2 for layer in range(L)],
                        [f"L{layer}" for layer in range(L)], fontsize=7)
        left.set_title(f"{label}: expert load / layer mean", fontsize=9)
        left.set_xlabel("step")
        left.xaxis.set_major_locator(MaxNLocator(integer=True))
        bar = fig.colorbar(mesh, ax=left, label="share of mean load")
        bar.set_ticks(SHARE_TICKS, labels=["1/8", "1/4", "1/2", "1", "2", "4", "8"])
        bar.minorticks_off()
        if flips is None:
            right.set_axis_off()
            right.text(0.5, 0.5, "no moe/flip_rate/layer_XX", ha="center", va="center")
            continue
        f_steps, layers, rate_LS = flips
        flip_mesh = right.pcolormesh(f_steps, layers, np.ma.masked_invalid(rate_LS),
                                     shading="nearest", vmin=0.0, cmap="viridis")
        right.set_title(f"{label}: flip rate", fontsize=9)
        right.set_xlabel("step")
        right.set_ylabel("layer")
        for axis in (right.xaxis, right.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(flip_mesh, ax=right, label="moe/flip_rate")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
    return True
