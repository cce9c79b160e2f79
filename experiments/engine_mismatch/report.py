"""The engine-mismatch experiment's report from results/ alone: the README's tables (between its
`<!-- table:NAME:begin/end -->` markers), the answers and the figures (`run.py` writes results/;
`python -m experiments.engine_mismatch.run --plot-only` calls `report`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import TYPE_CHECKING

from experiments.engine_mismatch.grid import ARMS, DTYPES, INITS, SHAPES
from experiments.replay_dose_response.report import ci as t_ci
from megatron_gspo.rollout.vllm.sampler import CHECK_TOL
from moe.model.presets import get_preset
from tools import result_table
from tools.plot_run import pyplot

if TYPE_CHECKING:  # run.py imports this module
    from experiments.engine_mismatch.run import Layout

HERE = os.path.dirname(os.path.abspath(__file__))
LABELS = {"gspo": "GSPO", "grpo": "GRPO", "grpo_r2": "GRPO + R2", "grpo_r3": "GRPO + R3",
          "grpo_fp32": "GRPO, fp32 engine", "grpo_lean": "GRPO, our decoder"}
R3_PAPER = {"routers": 0.10, "any_layer": 0.94}
"""The R3 paper's (arXiv 2510.11370) engine-vs-trainer figures on Qwen3-30B-A3B (48 MoE layers,
SGLang vs Megatron, bf16): ~10% of routers, 94% of tokens in at least one layer."""


def load_results(lay: Layout, part: str) -> list[dict]:
    folder = os.path.join(lay.results, part)
    if not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    return out


def fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def pct(x, digits: int = 2) -> str:
    return "-" if x is None or x != x else f"{100 * x:.{digits}f}%"


def ci(xs: list) -> tuple[float, float]:
    """(mean, 95% t half-width) over seeds (`experiments.replay_dose_response.report.ci`); NaN
    where a value is missing."""
    return t_ci([float("nan") if x is None else x for x in xs])


def pm(v: tuple[float, float], spec: str = ".4f") -> str:
    """`mean ± half-width`; a nonzero mean that `spec` would print as 0 in scientific form."""
    m, h = v
    if m != m:
        return "-"
    if m and format(abs(m), spec).strip("0.") == "":
        spec = ".1e"
    return format(m, spec) + ("" if h != h else f" ± {format(h, spec)}")


def sft_line(sfts: dict, shape: str) -> str:
    s = sfts.get(shape)
    if not s or s.get("start_accuracy") is None:
        return f"{shape}: no cold start recorded"
    run = f" [run {s['fingerprint'][:12]}, checkpoint step {s['step']}]" \
        if s.get("fingerprint") else ""  # results/ from before the cold start was recorded
    test = "" if s.get("test_accuracy") is None else f"; test accuracy {s['test_accuracy']:.4f}"
    return (f"{shape}{run}: held-out accuracy {s['start_accuracy']:.4f} (our float32 decoder), "
            f"entered the band at SFT step {s['band_step']:.0f}{test}")


def measure_table(meas: list[dict], sfts: dict) -> str:
    rows = {(r["shape"], r["init"], r["engine_dtype"]): r for r in meas}
    lines = ["| shape | init | engine | start acc. (engine, greedy) | routers differing, "
             "mean over layers | per layer (layer 0 first) | tokens differing in any layer | "
             "expert activations differing | abs log-prob diff, mean | max | probe sequence "
             "after a push, max | rollout batches |",
             "|" + "---|" * 12]
    for shape in SHAPES:
        p = get_preset(shape)
        desc = f"`{shape}` ({p.num_layers} x {p.num_experts} experts, top-{p.topk})"
        for init in INITS:
            for dtype in DTYPES:
                r = rows.get((shape, init, dtype))
                if r is None:
                    continue
                per_layer = " ".join(pct(x, 1) for x in r["routers_per_layer"])
                lines.append(
                    f"| {desc} | {init} | {dtype} | {fmt(r['start_accuracy'], '.3f')} | "
                    f"{pct(r['routers'])} | {per_layer} | {pct(r['any_layer'])} | "
                    f"{pct(r['experts'])} | {fmt(r['logprob_mean'], '.2e')} | "
                    f"{fmt(r['logprob_max'], '.2e')} | {fmt(r['probe_max'], '.2e')} | "
                    f"{r['batches']} |")
    notes = [sft_line(sfts, s) for s in SHAPES if any(k[0] == s and k[1] == "sft" for k in rows)]
    return "\n".join(lines) + ("\n\nCold starts: " + "; ".join(notes) + "." if notes else "")


def ablation_rows(abl: list[dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in abl:
        out.setdefault(r["arm"], {})[r["seed"]] = r
    return out


ABL_STATS = [("log_ratio_first", "first-minibatch abs log-ratio (trainer vs engine)", ".4f"),
             ("log_ratio_later", "abs log-ratio, minibatches 2-4", ".4f"),
             ("clip_token_first", "clipped tokens, first minibatch", ".4f"),
             ("clip_token", "clipped tokens, all minibatches", ".4f"),
             ("clip_seq", "clipped sequences, all minibatches", ".4f"),
             ("acc_start", "held-out accuracy, start (engine, greedy)", ".3f"),
             ("acc_final", "held-out accuracy, final", ".3f"),
             ("acc_best", "held-out accuracy, best eval", ".3f"),
             ("reward_first", "train reward, first 10% of batches", ".3f"),
             ("reward_last", "train reward, last 10% of batches", ".3f"),
             ("routers", "routers differing, engine vs trainer recompute", ".4f"),
             ("any_layer", "tokens differing in any layer", ".4f"),
             ("logprob_mean", "abs log-prob diff, engine vs trainer recompute", ".4f"),
             ("logprob_r3_mean", "abs log-prob diff, engine vs trainer under R3's replay",
              ".4f"),
             ("flip_rate", "expert flip rate per optimizer step", ".4f")]


def ablation_table(abl: list[dict]) -> str:
    arms = ablation_rows(abl)
    present = [a for a in ARMS if a in arms]
    seeds = sorted({len(arms[a]) for a in present})
    lines = ["| | " + " | ".join(f"{LABELS[a]} ({len(arms[a])} seeds)" for a in present) + " |",
             "|---|" + "---|" * len(present)]
    for key, label, spec in ABL_STATS:
        cells = [pm(ci([s.get(key) for s in arms[a].values()]), spec) for a in present]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Mean ± 95% t interval over seeds (seeds per arm: "
                 f"{', '.join(map(str, seeds))}); each seed's value is the mean over its "
                 "rollout batches (optimizer steps for the clip fractions and later ratios).")
    return "\n".join(lines)


def paired(arms: dict, a: str, b: str, key: str) -> tuple[float, float]:
    """Mean and 95% t half-width of a - b over the seeds both arms ran."""
    if a not in arms or b not in arms:
        return float("nan"), float("nan")
    common = sorted(set(arms[a]) & set(arms[b]))
    return ci([None if arms[a][s].get(key) is None or arms[b][s].get(key) is None
               else arms[a][s][key] - arms[b][s][key] for s in common])


def verdict(d: tuple[float, float]) -> str:
    m, h = d
    if m != m:
        return "not measured"
    if h != h:
        return "one seed: no interval"
    return "interval excludes 0" if abs(m) > h else "interval contains 0"


PAIRS = [("grpo_r3", "grpo", "GRPO + R3 − GRPO (what replaying the engine's routing changes)"),
         ("grpo_r2", "grpo", "GRPO + R2 − GRPO"),
         ("gspo", "grpo", "GSPO − GRPO"),
         ("grpo", "grpo_fp32", "GRPO − GRPO with an fp32 engine (what the bf16 mismatch changes)"),
         ("grpo_lean", "grpo_fp32", "GRPO with our decoder − with an fp32 engine")]
PAIR_STATS = [("log_ratio_first", "first-minibatch abs log-ratio", ".4f"),
              ("clip_token_first", "clipped tokens, first minibatch", ".4f"),
              ("clip_token", "clipped tokens, all minibatches", ".4f"),
              ("acc_final", "final held-out accuracy", ".3f")]


def paired_table(arms: dict) -> str:
    """Differences paired by seed, mean ± 95% t interval; `*` where the interval excludes 0."""
    rows = [(a, b, label) for a, b, label in PAIRS if a in arms and b in arms]
    if not rows:
        return ""
    lines = ["| paired by seed | " + " | ".join(lab for _, lab, _ in PAIR_STATS) + " |",
             "|---|" + "---|" * len(PAIR_STATS)]
    for a, b, label in rows:
        cells = []
        for key, _, spec in PAIR_STATS:
            d = paired(arms, a, b, key)
            cells.append(pm(d, spec) + (" *" if verdict(d) == "interval excludes 0" else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nMean ± 95% t interval of the per-seed differences; * the "
                               "interval excludes 0.")


def answers(meas: list[dict], abl: list[dict]) -> str:
    """The README's answers, every number from the results."""
    out = []
    arms = ablation_rows(abl)
    table = paired_table(arms)
    if table:
        out += [table, ""]
    if "grpo_r3" in arms:
        rr = [s.get("logprob_r3_mean") for s in arms["grpo_r3"].values()]
        lp = [s.get("logprob_mean") for s in arms["grpo_r3"].values()]
        r, l_ = ci(rr)[0], ci(lp)[0]
        if r == r and l_ == l_ and l_ > 0:
            out.append(f"- in the R3 arm, the trainer's log-probs under the engine's routing "
                       f"differ from the engine's by {r:.4f} nats per token against {l_:.4f} "
                       f"under its own routing: replay removes {100 * (1 - r / l_):.0f}% of the "
                       "mismatch, the rest is bfloat16 vs float32 arithmetic")
    if "gspo" in arms:
        g = ci([s.get("clip_token_first") for s in arms["gspo"].values()])
        out.append(f"- GSPO clips {pm(g, '.3f')} of its tokens on the first minibatch, where "
                   "the weights are pi_old's: there the sequence ratio is the engine mismatch "
                   "alone, against a clip range of [1-3e-4, 1+4e-4]")
    accs = {a: ci([s.get("acc_final") for s in arms[a].values()])[0] for a in arms}
    starts = [s.get("acc_start") for a in arms for s in arms[a].values()
              if s.get("acc_start") is not None]
    if accs and starts:
        lo, hi = min(accs, key=accs.get), max(accs, key=accs.get)
        best = max(s.get("acc_best") or 0 for a in arms for s in arms[a].values())
        out.append(f"- final held-out accuracy, mean over seeds: from {accs[lo]:.3f} "
                   f"({LABELS[lo]}) to {accs[hi]:.3f} ({LABELS[hi]}), against a start of "
                   f"{min(starts):.3f} to {max(starts):.3f}; the best eval of any run is "
                   f"{best:.3f}")
    if out:
        out.append("")
    engine = [r for r in abl if r["arm"] != "grpo_lean" and r.get("logprob_mean_max") is not None]
    if engine:
        worst = max(engine, key=lambda r: r["logprob_mean_max"])
        probe = max((r["probe_max"] for r in engine
                     if r.get("probe_max") is not None and r["arm"] != "grpo_fp32"),
                    default=float("nan"))  # the bfloat16 arms' (median) guard numbers
        out.append(f"- no stale push in any RL run: the largest per-batch mean |engine - "
                   f"trainer| log-prob of the sampled tokens is {worst['logprob_mean_max']:.4f} "
                   f"nats ({LABELS[worst['arm']]}, seed {worst['seed']}; stale or mis-packed "
                   f"weights are off by nats, docs/vllm.md); the stale-weight guard's number "
                   f"(the bfloat16 median over the engine's greedy continuation of a fixed prompt) "
                   f"reached {probe:.2f} nats, "
                   f"{'under' if probe <= CHECK_TOL['bfloat16'] else 'over'} the bfloat16 "
                   f"default {CHECK_TOL['bfloat16']:g}")
        out.append("")
    bf16 = [r for r in meas if r["engine_dtype"] == "bf16"]
    for r in sorted(bf16, key=lambda r: (SHAPES.index(r["shape"]), INITS.index(r["init"]))):
        per_layer = [x for x in r["routers_per_layer"] if x is not None]
        if not per_layer or r["routers"] is None:
            continue
        third = max(1, len(per_layer) // 3)
        out.append(f"- bfloat16 engine, `{r['shape']}`, {r['init']} init: "
                   f"{pct(r['routers'])} of routers differ (layers {pct(min(per_layer))} to "
                   f"{pct(max(per_layer))}; shallowest third of the layers "
                   f"{pct(statistics.fmean(per_layer[:third]))}, deepest third "
                   f"{pct(statistics.fmean(per_layer[-third:]))}), "
                   f"{R3_PAPER['routers'] / r['routers']:.1f}x fewer "
                   f"than the R3 paper's ~{R3_PAPER['routers']:.0%}; {pct(r['any_layer'])} of "
                   f"tokens differ in at least one layer (paper: {R3_PAPER['any_layer']:.0%})")
    fp32 = [r for r in meas if r["engine_dtype"] == "fp32" and r["routers"] is not None]
    if fp32:
        worst = max(fp32, key=lambda r: r["routers"])
        where = "no router differs in any of its measurements" if not worst["routers"] else \
            f"at most {pct(worst['routers'], 3)} of routers differ (`{worst['shape']}`, " \
            f"{worst['init']} init)"
        out.append(f"- float32 engine: {where}, and the sampled tokens' log-probs agree within "
                   f"{fmt(max(r['logprob_max'] for r in fp32), '.1e')} nats")
    return "\n".join(out)


def runtime_line(lay: Layout, sfts: dict, meas: list, abl: list) -> str:
    walls = {"SFT (first to last metrics record)": [s.get("span_s") for s in sfts.values()],
             "measurements": [r.get("wall_s") for r in meas],
             "RL arms": [r.get("wall_s") for r in abl]}
    parts = [f"{k}: {len([w for w in v if w])} runs, {sum(w for w in v if w) / 60:.0f} min"
             for k, v in walls.items() if any(v)]
    batches = sorted({r["batches"] for r in abl})
    mb = sorted({r["batches"] for r in meas})
    return ("Run time per run summed (" + "; ".join(parts) + "); each run on 1 torch thread, "
            "several at a time, on 2 CPU cores shared with other jobs (times inflated by their "
            "load and by each other). "
            f"Measurements: {', '.join(map(str, mb)) or '-'} rollout batches each; RL arms: "
            f"{', '.join(map(str, batches)) or '-'} rollout batches each.")


def figures(lay: Layout, meas: list[dict], abl: list[dict]) -> list[str]:
    plt = pyplot()
    os.makedirs(lay.figures, exist_ok=True)
    paths = []
    if meas:
        fig, axes = plt.subplots(1, len(SHAPES), figsize=(10, 3.6), squeeze=False)
        styles = {("random", "fp32"): ("tab:blue", "o:"), ("random", "bf16"): ("tab:blue", "o-"),
                  ("sft", "fp32"): ("tab:red", "s:"), ("sft", "bf16"): ("tab:red", "s-")}
        for ax, shape in zip(axes[0], SHAPES):
            for r in meas:
                if r["shape"] != shape:
                    continue
                color, style = styles[(r["init"], r["engine_dtype"])]
                ys = [100 * (y or 0) for y in r["routers_per_layer"]]
                ax.plot(range(len(ys)), ys, style, color=color, ms=4,
                        label=f"{r['init']}, {r['engine_dtype']} engine")
            ax.axhline(100 * R3_PAPER["routers"], color="grey", lw=0.8, ls="--")
            ax.text(0, 100 * R3_PAPER["routers"], " R3 paper ~10%", va="bottom", fontsize=7,
                    color="grey")
            ax.set_yscale("symlog", linthresh=0.1)
            ax.set_xticks(range(get_preset(shape).num_layers))
            ax.set_xlabel("MoE layer")
            ax.set_title(shape, fontsize=9)
        axes[0][0].set_ylabel("routers differing, vLLM vs trainer (%)")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(lay.figures, "mismatch_per_layer.png"))
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    arms = ablation_rows(abl)
    if arms:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
        colors = {"gspo": "tab:orange", "grpo": "tab:red", "grpo_r2": "tab:blue",
                  "grpo_r3": "tab:green", "grpo_fp32": "tab:grey", "grpo_lean": "black"}
        for arm in ARMS:
            if arm not in arms:
                continue
            seeds = list(arms[arm].values())
            for ax, key in zip(axes[:2], ("log_ratio_first", "clip_token_first")):
                n = min(len(s["series"][key]) for s in seeds)
                if n:
                    ys = [statistics.fmean(s["series"][key][i] for s in seeds) for i in range(n)]
                    ax.plot(range(n), ys, color=colors[arm], label=LABELS[arm], lw=1.2)
            evals = [dict((int(st), a) for st, a in s["series"]["eval"]) for s in seeds]
            steps = sorted(set.intersection(*(set(e) for e in evals)))
            if steps:
                axes[2].plot(steps, [statistics.fmean(e[st] for e in evals) for st in steps],
                             "o-", color=colors[arm], label=LABELS[arm], ms=4)
        axes[0].set_title("first-minibatch abs log-ratio (trainer / engine)", fontsize=9)
        axes[1].set_title("clipped tokens, first minibatch", fontsize=9)
        axes[2].set_title("held-out accuracy (mean over seeds)", fontsize=9)
        axes[0].set_yscale("log")
        axes[1].set_yscale("symlog", linthresh=1e-3)
        for ax in axes[:2]:
            ax.set_xlabel("rollout batch")
        axes[2].set_xlabel("optimizer step (4 per rollout batch)")
        axes[2].legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(lay.figures, "ablation.png"))
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    return paths


def report(lay: Layout, readme: str | None = None) -> int:
    """Tables and figures from results/ into the README's markers (printed where absent)."""
    sfts = {r["shape"]: r for r in load_results(lay, "sft")}
    meas, abl = load_results(lay, "measure"), load_results(lay, "ablation")
    if not meas and not abl:
        print(f"no results in {os.path.relpath(lay.results, lay.root)}: run "
              "`python -m experiments.engine_mismatch.run` first", file=sys.stderr)
        return 2
    figures(lay, meas, abl)
    machine = " ".join(sorted({r["machine"] for r in [*sfts.values(), *meas, *abl]
                               if r.get("machine")}))
    blocks = {"mismatch": measure_table(meas, sfts) if meas else "(not run)",
              "ablation": (ablation_table(abl) + "\n\n" + sft_line(sfts, SHAPES[0]) + ".")
              if abl else "(not run)",
              "answers": answers(meas, abl),
              "runtime": machine + " " + runtime_line(lay, sfts, meas, abl)}
    readme = readme or os.path.join(HERE, "README.md")
    for name, text in blocks.items():
        marker = f"{name}_{lay.marker}" if lay.marker else name
        try:
            result_table.write_into(readme, text, marker)
        except (ValueError, OSError) as e:
            print(f"note: {e}; the {name} block:")
        print(text, end="\n\n")
    return 0
