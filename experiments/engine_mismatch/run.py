"""vLLM vs the trainer on the same weights: per-layer router disagreement and log-prob mismatch,
then GSPO / GRPO / GRPO + R2 / GRPO + R3 with vLLM sampling.

Usage:
    python -m experiments.engine_mismatch.run                   # everything missing, then report
    python -m experiments.engine_mismatch.run --part measure    # only the mismatch measurements
    python -m experiments.engine_mismatch.run --part ablation --seeds 0 --steps 3 --tag smoke
    python -m experiments.engine_mismatch.run --plot-only       # README + figures from results/

Part 1, `measure` (measure.yaml): on two head_dim-32 shapes (vLLM's CPU attention needs head_dim
in {32, 64, ...}; `moe/model/presets.py`), from a random init and from an in-band SFT cold start
(sft.yaml: the ablation's recipe and band), with a float32 and a bfloat16 engine
(`rollout.vllm.dtype`), the trainer in float32: GRPO with `rollout.backend=vllm` for a few
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
The report (`report.py`: tables between the README's `<!-- table:NAME:begin/end -->` markers,
figures under figures[_TAG]/) is generated from results/ alone: `--plot-only` redraws it without
runs/.
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

from experiments.engine_mismatch.grid import ARMS, DTYPES, INITS, SHAPES
from experiments.engine_mismatch.report import load_results, report
from megatron_gspo.jobs.band import cold_start
from tools import result_table
from tools.plot_run import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))



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


    m = read_metrics(os.path.join(d, "metrics.jsonl"))
    times = m.get("time", {}).values()
    cold = cold_start(d)
    _write(out, {"shape": shape, "start_accuracy": _last(m, "sft/start_accuracy"),
                 "band_step": _last(m, "sft/band_step"), "wall_s": wall,
                 "span_s": max(times) - min(times) if times else None,
                 "fingerprint": cold["fingerprint"], "step": cold["step"],
                 "test_accuracy": cold["test_accuracy"]})


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
               f"model.preset={shape}", f"rollout.vllm.dtype={dtype}",
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
