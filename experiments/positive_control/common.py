"""What the positive control's scripts share: the candidates, paths, cold starts, JSON files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megatron_gspo.jobs.band import cold_start_line
from megatron_gspo.run.metrics import read_jsonl
from tools.result_table import machine_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = "runs/positive_control"

# name -> config overrides of the architecture (the screen's levers); the same active expert
# width per token (topk x moe_ffn_hidden_size = 256) in each top-k candidate. Top-1 keeps the
# all-expert softmax as its gate weight (norm_topk_prob false): renormalised over one expert
# the weight is always 1 and the router would get no gradient.
CANDIDATES: dict[str, list[str]] = {
    "top4": [],
    "top2": ["model.preset_overrides={topk: 2, moe_ffn_hidden_size: 128}"],
    "top1": ["model.preset_overrides={topk: 1, moe_ffn_hidden_size: 256, "
             "norm_topk_prob: false}"],
    "top1_e64": ["model.preset_overrides={num_experts: 64, topk: 1, moe_ffn_hidden_size: 256, "
                 "norm_topk_prob: false}"],
    "deep12": ["model.num_layers=12"],
}
SFT_EXTRA: dict[str, list[str]] = {  # at 3e-3 their accuracy jumps over the band between evals
    name: ["sft.lr=1.5e-3"] for name in ("top2", "top1", "deep12")}


def py(*args: str, log: str) -> None:
    """`python -m ...` from the repository root with one torch thread, output to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.makedirs(os.path.dirname(log), exist_ok=True)
    print("$", *args, flush=True)
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", *args], cwd=ROOT, check=True, env=env, stdout=f,
                       stderr=subprocess.STDOUT)


def series_root(series: str = "", runs: str = RUNS) -> str:
    """Where a series of runs lives: the runs made from one cold start, each series its own
    (`runs` for the first one, `runs/<series>` for a later one from another cold start)."""
    return f"{runs}/{series}" if series else runs


def cold_start(name: str, series: str = "", overrides: list[str] | None = None,
               runs: str = RUNS) -> tuple[str, dict]:
    """The candidate's SFT run dir in `series` (SFT'd into the band if it has not been) and
    where it stopped: {"accuracy", "step"} from its band record. `overrides`: the SFT's own
    (default: the candidate's, `CANDIDATES` and `SFT_EXTRA`); `runs`: another experiment's
    runs folder."""
    root = series_root(series, runs)
    sft_dir = f"{root}/sft_{name}"
    rows = _band_rows(sft_dir)
    if not rows:
        if overrides is None:
            overrides = [*CANDIDATES[name], *SFT_EXTRA.get(name, [])]
        py("megatron_gspo.cli", "sft", "--config", os.path.join(HERE, "sft.yaml"), *overrides,
           f"run_dir={sft_dir}", log=os.path.join(ROOT, root, "logs", f"sft_{name}.log"))
        rows = _band_rows(sft_dir)
    return sft_dir, {"accuracy": rows[-1]["sft/start_accuracy"],
                     "step": int(rows[-1]["sft/band_step"])}


def _band_rows(sft_dir: str) -> list[dict]:
    path = os.path.join(ROOT, sft_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return [r for r in read_jsonl(path) if "sft/band_step" in r]


def load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def write_measured(results: str, sft_dir: str) -> None:
    """`results/measured.json`: the machine line of this collection and the line naming the
    cold start `sft_dir` (relative to the repository) the runs began from."""
    write_json(os.path.join(results, "measured.json"), {
        "line": machine_line(),
        "cold_start": cold_start_line(os.path.join(ROOT, sft_dir)).replace(ROOT + os.sep, "")
        + "."})


def measured(results: str) -> str:
    """The tables' first line, from `results/measured.json` (this machine's line without it)."""
    record = load_json(os.path.join(results, "measured.json")) or {}
    return " ".join([record.get("line") or machine_line(), record.get("cold_start", "")])
