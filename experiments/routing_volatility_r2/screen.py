"""The screen: which lever makes the routing share of GRPO's token log-ratio large enough for
Routing Replay (R2) to matter, before any arm runs?

Usage:
    python -m experiments.routing_volatility_r2.screen                    # every candidate
    python -m experiments.routing_volatility_r2.screen --only top4        # some candidates
    python -m experiments.routing_volatility_r2.screen --table-only       # from results/screen

Shape legend: B sequences, T tokens.

Per candidate (`common.CANDIDATES`: a cold start, SFT'd into the validation band) and lever
(`common.SCREENED`), a GRPO run of the arms' recipe (experiments/positive_control/rl.yaml) takes
STEPS rollout batches of 4 minibatch steps from the cold start, in this process, no evals.
Each minibatch from the second on logs `policy/routing_log_ratio/{abs_mean,past_clip}`
(`megatron_gspo.jobs.rl_metrics.routing_log_ratio`): |log pi_theta(y) as the loss computed it
- log pi_theta(y) under pi_old's routing| over the response tokens, the part of the token
log-ratio R2 removes, and the share of tokens beyond GRPO's clip (0.2). GO: on the last
minibatch (mean over the rollout batches) abs_mean >= GO_MEAN and past_clip >= GO_PAST.

Beside it, per candidate at its cold start (lever "none"), route sensitivity
(`megatron_gspo.algo.sensitivity`) with 10% of the loss positions swapped to their next-best
expert, one layer at a time: a random tenth, and the tenth with the smallest router margins
(the near-ties updates flip first). If flips cost little because they happen at near-ties,
the second is much smaller than the first.

Results: results/screen/<candidate>__<lever>.json (committed; cold starts and run dirs under
runs/routing_volatility_r2/); the tables go between README.md's `<!-- table:screen... -->`
markers.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

from experiments.positive_control.common import ROOT, load_json, write_json
from experiments.routing_volatility_r2.common import (CANDIDATES, HERE, LEVERS, RL_YAML, RUNS,
                                                      SCREENED, cold_start)
from megatron_gspo.algo.sensitivity import route_sensitivity
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs.rl import Trainer
from megatron_gspo.run.metrics import read_jsonl
from tools.result_table import machine_line, write_into

STEPS = 2
SWAP_FRACTION = 0.1
GO_MEAN, GO_PAST = 0.05, 0.05
KEPT = ("policy/routing_log_ratio/abs_mean", "policy/routing_log_ratio/past_clip",
        "moe/flip_rate/mean", "moe/drift_vs_old/mean", "policy/clip_frac/token",
        "policy/log_ratio/abs_mean", "moe/router_margin/mean", "train/grad_norm",
        "reward/mean")


def sensitivity(trainer) -> dict:
    """Route sensitivity per layer on rollout batch 0 at the cold start's weights: a random
    SWAP_FRACTION of the loss positions, and the lowest-margin SWAP_FRACTION."""
    batch, cfg = trainer.rollout(0), trainer.cfg
    args = (trainer.policy, batch.tokens_BT, batch.valid_BT, batch.response_BT, SWAP_FRACTION)
    return {how: route_sensitivity(*args, torch.Generator().manual_seed(cfg.seed),
                                   cfg.rollout.temperature, lowest_margin=how == "lowest_margin")
            for how in ("random", "lowest_margin")}


def screen_one(candidate: str, lever: str) -> dict:
    """The candidate's cold start (made if absent), STEPS rollout batches of GRPO with the
    lever, the kept metrics of every minibatch step."""
    sft_dir, start = cold_start(candidate)
    run_dir = f"{RUNS}/screen/{candidate}__{lever}"
    shutil.rmtree(os.path.join(ROOT, run_dir), ignore_errors=True)
    cfg = load_config(RL_YAML, [*CANDIDATES[candidate], *LEVERS[lever],
                                f"init_checkpoint={sft_dir}", f"run_dir={run_dir}",
                                f"train.steps={STEPS}", "train.eval_every=0",
                                "train.save_every=0"])
    trainer = Trainer.from_config(cfg)
    try:
        sens = sensitivity(trainer) if lever == "none" else None
        lasts = [trainer.iteration() for _ in range(STEPS)]  # the last minibatch's row is
    finally:  # returned, the others logged
        trainer.rt.close()
    rows = [r for r in read_jsonl(os.path.join(ROOT, run_dir, "metrics.jsonl"))
            if "train/minibatch" in r] + lasts
    rows.sort(key=lambda r: (r["train/iteration"], r["train/minibatch"]))
    steps = [{"iteration": r["train/iteration"], "minibatch": r["train/minibatch"],
              **{k: r[k] for k in KEPT if k in r}} for r in rows]
    return {"candidate": candidate, "lever": lever,
            "overrides": [*CANDIDATES[candidate], *LEVERS[lever]], "cold_start": start,
            "steps": steps, "sensitivity": sens, "measured": machine_line()}


def last_minibatch(result: dict, key: str) -> float:
    """`key` on the last minibatch of each rollout batch, averaged over them."""
    last = max(s["minibatch"] for s in result["steps"])
    vals = [s[key] for s in result["steps"] if s["minibatch"] == last and key in s]
    return sum(vals) / len(vals) if vals else float("nan")


def mean_of(result: dict, key: str) -> float:
    vals = [s[key] for s in result["steps"] if key in s and s[key] == s[key]]
    return sum(vals) / len(vals) if vals else float("nan")


def rewards(result: dict) -> list[float]:
    """The mean train reward of each rollout batch (NaN where not kept)."""
    its = sorted({s["iteration"] for s in result["steps"]})
    return [next((s["reward/mean"] for s in result["steps"] if s["iteration"] == it
                  and "reward/mean" in s), float("nan")) for it in its]


def goes(result: dict) -> bool:
    return last_minibatch(result, "policy/routing_log_ratio/abs_mean") >= GO_MEAN and \
        last_minibatch(result, "policy/routing_log_ratio/past_clip") >= GO_PAST


def screen_table(results: list[dict]) -> str:
    """One row per (candidate, lever): the routing log-ratio by minibatch and the verdict."""
    lines = ["| candidate | lever | cold start (val acc, SFT step) | flips per step | routing "
             "log-ratio, minibatch 2 / 3 / 4 | tokens past 0.2, last minibatch | clip frac | "
             "train reward, rollout batch 1 / 2 | GO |", "|" + " --- |" * 9]
    for r in results:
        by_mb = [sum(v) / len(v) if (v := [s["policy/routing_log_ratio/abs_mean"]
                                           for s in r["steps"] if s["minibatch"] == m]) else
                 float("nan") for m in (1, 2, 3)]
        cs = r["cold_start"]
        lines.append(
            f"| {r['candidate']} | {r['lever']} | {cs['accuracy']:.3f}, {cs['step']} | "
            f"{mean_of(r, 'moe/flip_rate/mean'):.4f} | "
            f"{' / '.join(f'{v:.4f}' for v in by_mb)} | "
            f"{last_minibatch(r, 'policy/routing_log_ratio/past_clip'):.4f} | "
            f"{mean_of(r, 'policy/clip_frac/token'):.4f} | "
            f"{' / '.join(f'{v:.3f}' for v in rewards(r))} | {'yes' if goes(r) else 'no'} |")
    return "\n".join(lines)


def sensitivity_table(results: list[dict]) -> str:
    """Per candidate: route sensitivity (10% swapped) random vs lowest-margin, mean over
    layers and per layer, and the median router margin."""
    lines = ["| candidate | random 10%: mean (per layer) | lowest-margin 10%: mean (per layer) "
             "| lowest-margin / random | median router margin |", "|" + " --- |" * 5]
    for r in results:
        s = r.get("sensitivity")
        if not s:
            continue
        rand, low = (sum(s[k]) / len(s[k]) for k in ("random", "lowest_margin"))
        lines.append(
            f"| {r['candidate']} | {rand:.4f} ({' '.join(f'{v:.4f}' for v in s['random'])}) | "
            f"{low:.4f} ({' '.join(f'{v:.4f}' for v in s['lowest_margin'])}) | "
            f"{low / rand:.2f} | {mean_of(r, 'moe/router_margin/mean'):.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CANDIDATES))
    ap.add_argument("--levers", nargs="+", choices=sorted(LEVERS))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for candidate in args.only or list(CANDIDATES):
        for lever in SCREENED[candidate]:
            path = os.path.join(HERE, "results", "screen", f"{candidate}__{lever}.json")
            wanted = not args.levers or lever in args.levers
            if wanted and not args.table_only and load_json(path) is None:
                write_json(path, screen_one(candidate, lever))
            if load_json(path) is not None:
                results.append(load_json(path))
    measured = {r["measured"] for r in results}
    head = measured.pop() if len(measured) == 1 else machine_line()
    tables = {"screen": "\n".join([head, f"GRPO from each cold start, {STEPS} rollout batches "
                                   "of 4 minibatch steps; the routing log-ratio's mean over "
                                   "the rollout batches at each minibatch; GO: the last "
                                   f"minibatch's >= {GO_MEAN} with >= {GO_PAST:.0%} of tokens "
                                   "past 0.2.", "", screen_table(results)]),
              "sensitivity": sensitivity_table(results)}
    for marker, text in tables.items():
        print(text, "\n")
        if results:
            write_into(os.path.join(HERE, "README.md"), text, marker)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
