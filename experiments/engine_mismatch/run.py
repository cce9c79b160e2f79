"""vLLM vs the trainer on the same weights: per-layer router disagreement and log-prob mismatch,
then GSPO / GRPO / GRPO + R2 / GRPO + R3 with vLLM sampling.

Usage:
    python -m experiments.engine_mismatch.run                   # everything missing, then report
    python -m experiments.engine_mismatch.run --part measure    # only the mismatch measurements
    python -m experiments.engine_mismatch.run --part ablation --seeds 0 --steps 3 --tag smoke
    python -m experiments.engine_mismatch.run --plot-only       # README + figures from results/

Part 1, `measure` (measure.yaml): on two head_dim-32 shapes (vLLM's CPU attention needs head_dim
in {32, 64, ...}; `moe/presets.py`), from a random init and from an in-band SFT cold start
(sft.yaml: the ablation's recipe and band), with a float32 and a bfloat16 engine
(`rollout.engine_dtype`), the trainer in float32: GRPO with `rollout.backend=vllm` for a few
rollout batches. Before every rollout batch the trainer pushes its weights to the engine (and
checks a probe sequence), so engine and trainer hold the same weights; the trainer then
recomputes the batch and logs, per rollout batch, `rollout/routing_mismatch/layer_XX` (the
fraction of routers, (token, layer) pairs on the loss positions, whose top-k set differs between
the engine and the trainer's recompute), `rollout/routing_any_diff` (tokens differing in at
least one layer), `rollout/routing_mismatch_experts/mean` (expert activations that differ) and
`rollout/logprob_mismatch/{mean,max}` (|engine - trainer| log-prob of the sampled tokens).

Part 2, `ablation` (gspo.yaml, grpo.yaml, grpo_r2.yaml, grpo_r3.yaml): the four arms with vLLM
sampling in bfloat16 (the trainer in float32) from the first shape's cold start, 3 seeds. pi_old
is the engine's own log-probs (`rollout.use_sampler_logprobs`), so the importance ratio is
trainer / engine: on a rollout batch's first minibatch (pi == pi_old's weights) its log is the
engine-vs-trainer mismatch the loss sees; R3 replays the engine's routing in the loss forwards.

Every run is a `megatron_gspo.cli` subprocess (one torch thread each, `--workers` at a time)
under runs/engine_mismatch[_TAG]/; when one finishes, its numbers are distilled into a small JSON
under results[_TAG]/ (committed; runs/ is not), and a run with a result is not run again. An RL
arm a signal stopped resumes from its checkpoint; an interrupted measurement starts again.
The report (tables between the README's `<!-- table:NAME:begin/end -->` markers, figures under
figures[_TAG]/) is generated from results/ alone: `--plot-only` redraws it without runs/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

SHAPES = ("qwen3-moe-tiny-hd32", "qwen3-moe-tiny-hd32-wide")
INITS = ("random", "sft")
DTYPES = ("fp32", "bf16")
ARMS = ("gspo", "grpo", "grpo_r2", "grpo_r3", "grpo_fp32", "grpo_lean")
"""The four arms with a bfloat16 engine, then two controls without its mismatch."""
LABELS = {"gspo": "GSPO", "grpo": "GRPO", "grpo_r2": "GRPO + R2", "grpo_r3": "GRPO + R3",
          "grpo_fp32": "GRPO, fp32 engine", "grpo_lean": "GRPO, our decoder"}
R3_PAPER = {"routers": 0.10, "any_layer": 0.94}
"""The R3 paper's (arXiv 2510.11370) engine-vs-trainer figures on Qwen3-30B-A3B (48 MoE layers,
SGLang vs Megatron, bf16): ~10% of routers, 94% of tokens in at least one layer."""


# ----------------------------------------------------------------------------- runs


def py(args: list[str], log: str) -> float:
    """`python -m ARGS` from the repo root, one torch thread, output to `log`; wall seconds.
    A failure raises naming the log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", *args]
    print("$", " ".join(cmd[1:]), f"> {os.path.relpath(log, ROOT)}", flush=True)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"exit {rc}: {' '.join(args[:2])} (see {os.path.relpath(log, ROOT)})")
    return time.time() - t0


class Layout:
    """Where a variant's runs, results and figures live (`tag` "" is the default)."""

    def __init__(self, tag: str = "", root: str | None = None, here: str | None = None):
        root, here = root or ROOT, here or HERE
        suffix = f"_{tag}" if tag else ""
        self.tag, self.root = tag, root
        self.runs = os.path.join(root, f"runs/engine_mismatch{suffix}")
        self.results = os.path.join(here, f"results{suffix}")
        self.figures = os.path.join(here, f"figures{suffix}")
        self.marker = suffix.lstrip("_")  # README markers: table:NAME or table:NAME_TAG

    def sft_dir(self, shape: str) -> str:  # one cold start per shape, shared by every variant
        return os.path.join(self.root, "runs/engine_mismatch", shape, "sft")

    def result(self, part: str, name: str) -> str:
        return os.path.join(self.results, part, f"{name}.json")


def measure_name(shape: str, init: str, dtype: str) -> str:
    return f"{shape}_{init}_{dtype}"


def sft_job(lay: Layout, shape: str) -> None:
    """SFT `shape` into the band unless it has a checkpoint; its band record into results/."""
    d, out = lay.sft_dir(shape), os.path.join(lay.results, "sft", f"{shape}.json")
    wall = None
    if not os.path.exists(os.path.join(d, "checkpoints", "latest")):
        shutil.rmtree(d, ignore_errors=True)
        wall = py(["megatron_gspo.cli", "sft", "--config", os.path.join(HERE, "sft.yaml"),
                   f"model.preset={shape}", f"run_dir={os.path.relpath(d, ROOT)}"],
                  os.path.join(lay.runs, "logs", f"sft_{shape}.log"))
    elif os.path.exists(out):
        return
    from tools.plot_run import read_metrics

    m = read_metrics(os.path.join(d, "metrics.jsonl"))
    times = m.get("time", {}).values()
    _write(out, {"shape": shape, "start_accuracy": _last(m, "sft/start_accuracy"),
                 "band_step": _last(m, "sft/band_step"), "wall_s": wall,
                 "span_s": max(times) - min(times) if times else None})


def measure_job(lay: Layout, shape: str, init: str, dtype: str, steps: int | None,
                extra: list[str]) -> None:
    name = measure_name(shape, init, dtype)
    out = lay.result("measure", name)
    if os.path.exists(out):
        return
    run_dir = os.path.join(lay.runs, "measure", name)
    shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted measurement starts again
    init_args = ["init_checkpoint=null"] if init == "random" else \
        [f"init_checkpoint={os.path.relpath(lay.sft_dir(shape), ROOT)}"]
    wall = py(["megatron_gspo.cli", "train", "--config", os.path.join(HERE, "measure.yaml"),
               f"model.preset={shape}", f"rollout.engine_dtype={dtype}",
               *init_args,
               f"run_dir={os.path.relpath(run_dir, ROOT)}", "resume=false",
               *([f"train.steps={steps}"] if steps else []), *extra],
              os.path.join(lay.runs, "logs", f"measure_{name}.log"))
    rec = summarize_measure(os.path.join(run_dir, "metrics.jsonl"))
    _write(out, {"shape": shape, "init": init, "engine_dtype": dtype, "wall_s": wall, **rec})


def ablation_job(lay: Layout, arm: str, seed: int, steps: int | None,
                 extra: list[str]) -> None:
    name = f"{arm}_s{seed}"
    out = lay.result("ablation", name)
    if os.path.exists(out):
        return
    run_dir = os.path.join(lay.runs, "ablation", name)
    # an arm a signal stopped saved a checkpoint: the same command resumes it
    fresh = not os.path.exists(os.path.join(run_dir, "checkpoints", "latest"))
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    wall = py(["megatron_gspo.cli", "train", "--config", os.path.join(HERE, f"{arm}.yaml"),
               f"init_checkpoint={os.path.relpath(lay.sft_dir(SHAPES[0]), ROOT)}",
               f"run_dir={os.path.relpath(run_dir, ROOT)}", f"seed={seed}",
               *(["resume=false"] if fresh else []),
               *([f"train.steps={steps}"] if steps else []), *extra],
              os.path.join(lay.runs, "logs", f"ablation_{name}.log"))
    rec = summarize_ablation(os.path.join(run_dir, "metrics.jsonl"))
    _write(out, {"arm": arm, "seed": seed, "wall_s": wall, **rec})


def _write(path: str, rec: dict) -> None:
    """`rec` as JSON at `path`, with the machine line (CPU, date, versions) of when it ran."""
    from bench import result_table

    rec.setdefault("machine", result_table.machine_line())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- distilling


def _last(m: dict, key: str):
    vals = m.get(key, {})
    return vals[max(vals)] if vals else None


def per_batch(m: dict, key: str) -> list[float]:
    """`key`'s value on each rollout batch's first optimizer step (train/minibatch 0), in order:
    the rollout-batch metrics are logged with every minibatch, the ratio's on each."""
    firsts = [s for s, v in sorted(m.get("train/minibatch", {}).items()) if v == 0]
    return [m[key][s] for s in firsts if s in m.get(key, {})]


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return statistics.fmean(xs) if xs else None


def summarize_measure(path: str) -> dict:
    """One measurement run: per-layer router disagreement and the other mismatch statistics,
    each the mean over its rollout batches (logprob max: the max), and the start accuracy (the
    iteration-0 eval through the engine; None without one)."""
    from tools.plot_run import read_metrics

    m = read_metrics(path)
    layers = sorted(k for k in m if k.startswith("rollout/routing_mismatch/layer_"))
    return {"batches": len(per_batch(m, "rollout/routing_mismatch/mean")),
            "start_accuracy": m.get("eval/accuracy", {}).get(0),
            "routers_per_layer": [_mean(per_batch(m, k)) for k in layers],
            "routers": _mean(per_batch(m, "rollout/routing_mismatch/mean")),
            "any_layer": _mean(per_batch(m, "rollout/routing_any_diff")),
            "experts": _mean(per_batch(m, "rollout/routing_mismatch_experts/mean")),
            "experts_all_tokens": _mean(per_batch(m, "rollout/routing_mismatch_all/mean")),
            "logprob_mean": _mean(per_batch(m, "rollout/logprob_mismatch/mean")),
            "logprob_mean_max": max(per_batch(m, "rollout/logprob_mismatch/mean"), default=None),
            "logprob_max": max(per_batch(m, "rollout/logprob_mismatch/max"), default=None),
            "probe_max": max(per_batch(m, "rollout/push_probe_diff"), default=None),
            "weight_sync_s": _median(per_batch(m, "time/weight_sync")[1:])}


def _median(xs):
    return statistics.median(xs) if xs else None


def summarize_ablation(path: str) -> dict:
    """One RL arm: clip fractions, first-minibatch and later |log-ratio|, held-out accuracy,
    reward, the mismatch, and per-batch series for the figure."""
    from tools.plot_run import read_metrics

    m = read_metrics(path)
    mb = m.get("train/minibatch", {})
    later = [s for s, v in mb.items() if v > 0]
    acc = m.get("eval/accuracy", {})
    reward = per_batch(m, "reward/mean")
    tenth = max(1, math.ceil(len(reward) / 10))

    def over(key, steps):
        return _mean([m.get(key, {}).get(s) for s in steps])
    return {
        "batches": len(reward),
        "clip_token": _mean(m.get("policy/clip_frac/token", {}).values()),
        "clip_seq": _mean(m.get("policy/clip_frac/seq", {}).values()),
        "clip_token_first": _mean(per_batch(m, "policy/clip_frac/token")),
        "log_ratio_first": _mean(per_batch(m, "policy/log_ratio/abs_mean")),
        "log_ratio_later": over("policy/log_ratio/abs_mean", later),
        "acc_start": acc.get(0), "acc_final": acc[max(acc)] if acc else None,
        "acc_best": max(acc.values()) if acc else None,
        "reward_first": _mean(reward[:tenth]), "reward_last": _mean(reward[-tenth:]),
        "routers": _mean(per_batch(m, "rollout/routing_mismatch/mean")),
        "any_layer": _mean(per_batch(m, "rollout/routing_any_diff")),
        "logprob_mean": _mean(per_batch(m, "rollout/logprob_mismatch/mean")),
        "logprob_mean_max": max(per_batch(m, "rollout/logprob_mismatch/mean"), default=None),
        "probe_max": max(per_batch(m, "rollout/push_probe_diff"), default=None),
        "logprob_r3_mean": _mean(per_batch(m, "rollout/logprob_mismatch_r3/mean")),
        "flip_rate": _mean(m.get("moe/flip_rate/mean", {}).values()),
        "series": {"log_ratio_first": per_batch(m, "policy/log_ratio/abs_mean"),
                   "clip_token_first": per_batch(m, "policy/clip_frac/token"),
                   "eval": [[s, a] for s, a in sorted(acc.items())]},
    }


def collect(lay: Layout) -> int:
    """Distill every result again from its run's metrics.jsonl (a summary that changed after
    the runs), keeping what only the runner knew (wall time, machine); returns how many."""
    n = 0
    for part, summarize in (("measure", summarize_measure), ("ablation", summarize_ablation)):
        for rec in load_results(lay, part):
            name = f"{rec['arm']}_s{rec['seed']}" if part == "ablation" else \
                measure_name(rec["shape"], rec["init"], rec["engine_dtype"])
            path = os.path.join(lay.runs, part, name, "metrics.jsonl")
            if os.path.exists(path):
                keep = {k: v for k, v in rec.items() if k in (
                    "arm", "seed", "shape", "init", "engine_dtype", "wall_s", "machine")}
                _write(lay.result(part, name), {**keep, **summarize(path)})
                n += 1
    print(f"distilled {n} results again from {os.path.relpath(lay.runs, ROOT)}")
    return n


# ----------------------------------------------------------------------------- report

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
    from experiments.replay_dose_response.report import ci as t_ci

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
    return (f"{shape}: held-out accuracy {s['start_accuracy']:.4f} (our float32 decoder), "
            f"entered the band at SFT step {s['band_step']:.0f}")


def measure_table(meas: list[dict], sfts: dict) -> str:
    from moe.presets import get_preset

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
        probe = max((r["probe_max"] for r in engine if r.get("probe_max") is not None),
                    default=float("nan"))
        out.append(f"- no stale push in any RL run: the largest per-batch mean |engine - "
                   f"trainer| log-prob of the sampled tokens is {worst['logprob_mean_max']:.4f} "
                   f"nats ({LABELS[worst['arm']]}, seed {worst['seed']}; stale or mis-packed "
                   f"weights are off by nats, docs/vllm.md), while the bfloat16 engine's probe "
                   f"sequence (random tokens) reached {probe:.2f} nats")
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe.presets import get_preset

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
    from bench import result_table

    sfts = {r["shape"]: r for r in load_results(lay, "sft")}
    meas, abl = load_results(lay, "measure"), load_results(lay, "ablation")
    if not meas and not abl:
        print(f"no results in {os.path.relpath(lay.results, ROOT)}: run "
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


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "measure", "ablation"], default="all")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None,
                    help="rollout batches per run (default: the YAMLs'); use with --tag")
    ap.add_argument("--measure-steps", type=int, default=None,
                    help="rollout batches per measurement (default: measure.yaml's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for every RL run (repeatable); use with --tag")
    ap.add_argument("--tag", default="", help="variant: runs/engine_mismatch_TAG, results_TAG, "
                                              "figures_TAG, README markers NAME_TAG")
    ap.add_argument("--workers", type=int, default=2, help="runs at a time")
    ap.add_argument("--plot-only", action="store_true",
                    help="regenerate the README tables and figures from results/")
    ap.add_argument("--collect", action="store_true",
                    help="distill results/ again from the finished runs under runs/ (keeping "
                         "each result's wall time and machine), then report")
    args = ap.parse_args(argv)
    if (args.set or args.steps or args.measure_steps) and not args.tag:
        ap.error("--set / --steps change the runs: give them a --tag so that they do not "
                 "overwrite the default results")
    lay = Layout(args.tag)
    if args.plot_only:
        return report(lay)
    if args.collect:
        collect(lay)
        return report(lay)
    t0 = time.time()
    shapes = args.shapes if args.part != "ablation" else [SHAPES[0]]
    with ThreadPoolExecutor(args.workers) as pool:
        for f in [pool.submit(sft_job, lay, s) for s in shapes]:
            f.result()
        jobs = []
        if args.part in ("all", "ablation"):
            jobs += [pool.submit(ablation_job, lay, arm, seed, args.steps, args.set)
                     for seed in args.seeds for arm in args.arms]
        if args.part in ("all", "measure"):
            jobs += [pool.submit(measure_job, lay, shape, init, dtype, args.measure_steps,
                                 args.set)
                     for shape in shapes for init in INITS for dtype in DTYPES]
        failed = []
        for f in jobs:
            try:
                f.result()
            except RuntimeError as e:
                failed.append(str(e))
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    rc = report(lay)
    print(f"engine_mismatch done in {time.time() - t0:.0f}s")
    return 1 if failed else rc


if __name__ == "__main__":
    sys.exit(main())
