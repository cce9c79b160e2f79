"""The screen: how much does a routing change move the sampled tokens' log-probs, per lever?

Usage:
    python -m experiments.positive_control.screen                  # every candidate, table
    python -m experiments.positive_control.screen --only top4 top1 # some candidates
    python -m experiments.positive_control.screen --table-only     # table from saved JSON

Shape legend: B sequences, T tokens.

GRPO's token ratio is clipped at [0.8, 1.27] (|log-ratio| about 0.22-0.24) and GSPO's
sequence ratio at [1 - 3e-4, 1 + 4e-4]. Routing Replay can only matter where a routing change
moves a token's log-prob by an amount of that order. For each candidate (an architecture,
`model.preset_overrides`, on the task of `sft.yaml`) the screen makes its own cold start (SFT
to the validation band), samples one rollout batch, and re-scores it with Gaussian noise of
several stds on the router logits that pick the top-k (`moe.routing.noise`; gate weights from
the clean logits): the same perturbation an engine whose routers disagree with the trainer's
(`rollout.decoders.router_noise_std`) or a policy whose routing moved (`train.router_noise_std`)
makes.
Per std, over DRAWS noise draws: the flip rate of the (token, expert) activations on the loss
positions, the mean |log pi_noisy - log pi_clean| over response tokens, the fraction of response
tokens beyond GRPO's clip (|log-ratio| > 0.2), the mean |per-sequence mean log-ratio| and the
fraction of sequences beyond GSPO's clip (> 3e-4). The table interpolates each at 10% flips
(the GSPO paper's volatility on Qwen3-30B-A3B, the R3 paper's router disagreement). Beside it,
per layer, `moe/route_sensitivity` (`megatron_gspo.algo.sensitivity`): the mean |log-prob
change| when a random 10% of the loss positions take their (K+1)-th expert instead of their
K-th at that layer only: the cost of one near-tie flip, layer by layer.

Results: results/screen/<candidate>.json (committed; its cold start under
runs/positive_control/); the table goes between README.md's `<!-- table:screen:... -->` markers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess

import torch

from experiments.positive_control.common import (CANDIDATES, HERE, ROOT, RUNS, cold_start,
                                                 load_json, write_json)
from experiments.replay_dose_response.calibrate import noisy_draws, one_rollout_batch
from megatron_gspo.algo.sensitivity import route_sensitivity
from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs import evaluate
from megatron_gspo.run.setup import setup_runtime
from tools.result_table import machine_line, write_into

GRID = (0.01, 0.03, 0.1, 0.3, 1.0)
DRAWS = 3
GRPO_CLIP = 0.2
GSPO_CLIP = 3e-4
TARGET_FLIPS = 0.1
SWAP_FRACTION = 0.1


def perturbation_stats(clean_BT: torch.Tensor, noisy_BT: torch.Tensor,
                       response_BT: torch.Tensor) -> dict[str, float]:
    """Token and sequence statistics of the log-ratio noisy - clean over response tokens."""
    resp_BT = response_BT.float()
    d_BT = (noisy_BT.double() - clean_BT.double()) * resp_BT
    n_B = resp_BT.sum(1).clamp_min(1)
    seq_B = d_BT.sum(1) / n_B
    keep_B = resp_BT.sum(1) > 0
    tokens = resp_BT.sum()
    return {"abs_log_ratio": float(d_BT.abs().sum() / tokens),
            "tokens_past_grpo_clip": float(((d_BT.abs() > GRPO_CLIP) & resp_BT.bool()).sum()
                                           / tokens),
            "seq_abs_log_ratio": float(seq_B[keep_B].abs().mean()),
            "seqs_past_gspo_clip": float((seq_B[keep_B].abs() > GSPO_CLIP).double().mean())}


def measure(policy, batch, std: float, temperature: float) -> dict:
    """Means over DRAWS noise draws at `std` (see the module docstring)."""
    clean_BT, draws = noisy_draws(policy, batch, std, temperature, DRAWS)
    stats = [{"flip_rate": flip,
              **perturbation_stats(clean_BT.cpu(), noisy_BT.cpu(), batch.response_BT)}
             for flip, noisy_BT in draws]
    return {"std": std, **{k: sum(d[k] for d in stats) / DRAWS for k in stats[0]}}


def at_flip_rate(grid: list[dict], key: str, target: float = TARGET_FLIPS) -> float:
    """`key` at flip rate `target`, log-log between the bracketing grid points (NaN outside)."""
    pts = sorted((g["flip_rate"], g[key]) for g in grid if g["flip_rate"] > 0)
    for (f0, v0), (f1, v1) in zip(pts, pts[1:]):
        if f0 <= target <= f1:
            if v0 <= 0 or v1 <= 0:
                return v0 + (v1 - v0) * (target - f0) / (f1 - f0)
            w = (math.log(target) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp(math.log(v0) + w * (math.log(v1) - math.log(v0)))
    return float("nan")


def screen_one(name: str) -> dict:
    """The candidate's cold start (made if absent), one rollout batch, the noise grid."""
    sft_dir, start = cold_start(name)
    cfg = load_config(os.path.join(ROOT, "experiments/positive_control/rl.yaml"), [
        *CANDIDATES[name], f"init_checkpoint={sft_dir}",
        f"run_dir={RUNS}/screen/{name}_eval", "train.start_accuracy=null"])
    rt = setup_runtime(cfg, evaluate.SPEC)
    try:
        batch = one_rollout_batch(rt, cfg)
        sens = route_sensitivity(rt.policy, batch.tokens_BT, batch.valid_BT, batch.response_BT,
                                 SWAP_FRACTION, torch.Generator().manual_seed(cfg.seed),
                                 cfg.rollout.temperature)
        grid = []
        for std in GRID:
            grid.append(measure(rt.policy, batch, std, cfg.rollout.temperature))
            print(name, json.dumps(grid[-1]), flush=True)
    finally:
        rt.close()
    return {"candidate": name, "overrides": CANDIDATES[name], "cold_start": start,
            "route_sensitivity": sens, "grid": grid, "measured": machine_line()}


KEYS = ("abs_log_ratio", "tokens_past_grpo_clip", "seq_abs_log_ratio", "seqs_past_gspo_clip")


def table(results: list[dict]) -> str:
    head = ("| candidate | overrides | cold start (val acc, SFT step) | flips at std 1 | "
            "abs log-ratio | tokens past GRPO's clip | abs seq log-ratio | seqs past GSPO's "
            "clip | route sensitivity per layer (10% swapped) | its mean, x top4's |")
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    base = next((r for r in results if r["candidate"] == "top4"), None)
    base_mean = sum(base["route_sensitivity"]) / len(base["route_sensitivity"]) if base \
        else float("nan")
    for r in results:
        sens = r["route_sensitivity"]
        g = {k: at_flip_rate(r["grid"], k) for k in KEYS}
        top = max(r["grid"], key=lambda x: x["std"])
        cs = r["cold_start"]  # the band's accuracy (validation) and the step it entered
        lines.append(
            f"| {r['candidate']} | {' '.join(r['overrides']) or 'qwen3-moe-tiny'} | "
            f"{cs['accuracy']:.3f}, {cs['step']} | {top['flip_rate']:.3f} | "
            f"{g['abs_log_ratio']:.4f} | {g['tokens_past_grpo_clip']:.4f} | "
            f"{g['seq_abs_log_ratio']:.4f} | {g['seqs_past_gspo_clip']:.3f} | "
            f"{' '.join(f'{v:.4f}' for v in sens)} | {sum(sens) / len(sens) / base_mean:.1f} |")
    return "\n".join(lines)


def measured_line(results: list[dict]) -> str:
    """The machine and date the screen ran on (kept in its results), else this one's."""
    lines = {r["measured"] for r in results if "measured" in r}
    return lines.pop() if len(lines) == 1 else machine_line()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CANDIDATES))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only or list(CANDIDATES)
    results, skipped = [], []
    for name in names:
        path = os.path.join(HERE, "results", "screen", f"{name}.json")
        if not args.table_only and load_json(path) is None:
            try:
                write_json(path, screen_one(name))
            except subprocess.CalledProcessError:  # its SFT missed the band: the log says how
                print(f"{name}: no cold start in the band (runs/positive_control/logs/"
                      f"sft_{name}.log); skipped", flush=True)
        if load_json(path) is not None:
            results.append(load_json(path))
        else:
            skipped.append(name)
    text = "\n".join([measured_line(results), "Cold start: validation accuracy where SFT entered the "
                      "band, and its step. Fresh noise draws on the routers that pick the "
                      "top-k; columns 5-8 at 10% of expert activations changed.", "",
                      table(results)]
                     + ([f"\nNo cold start in the band (SFT jumped over it or ran out of steps): "
                         f"{', '.join(skipped)}."] if skipped else []))
    print(text)
    if not args.table_only or results:
        write_into(os.path.join(HERE, "README.md"), text, "screen")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
