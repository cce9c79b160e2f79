"""What the routing-volatility (R2) experiment's scripts share: candidates, levers, paths.

A candidate is a cold start (an architecture and a task, SFT'd into the validation band with
the positive control's recipe, experiments/positive_control/sft.yaml); a lever is what an RL
run adds to make routing move between pi_old and the policy being updated.
"""

from __future__ import annotations

import os

from experiments.positive_control import common as pc

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = "runs/routing_volatility_r2"
RL_YAML = os.path.join(pc.HERE, "rl.yaml")  # GRPO, 8 x 8, 4 minibatches, lr 1e-4, 40 batches

HARD_TOP1 = "model.preset_overrides={topk: 1, moe_ffn_hidden_size: 256, norm_topk_prob: true}"
CANDIDATES: dict[str, list[str]] = {
    "top4": [],  # qwen3-moe-tiny on running_sum: every earlier experiment's model
    # a hard top-1 gate (weight 1: a flip swaps the whole expert output, and the router gets no
    # loss gradient, so routes move only as updates move the hidden states), the same active
    # expert width per token (1 x 256 = 4 x 64)
    "top1_hard": [HARD_TOP1],
    # ... on a task whose operation, named by the first token, rewards experts by operation
    "ops_top1_hard": ["task.name=running_ops", HARD_TOP1],
}
SFT_EXTRA: dict[str, list[str]] = {  # at 3e-3 top-1 accuracy jumps over the band between evals
    "top1_hard": ["sft.lr=1.5e-3"], "ops_top1_hard": ["sft.lr=1.5e-3"]}

LEVERS: dict[str, list[str]] = {
    "none": [],
    "router_lr_x10": ["optim.router_lr_mult=10"],
    "router_lr_x30": ["optim.router_lr_mult=30"],
    "router_lr_x50": ["optim.router_lr_mult=50"],
    "router_lr_x100": ["optim.router_lr_mult=100"],
    "router_lr_x1000": ["optim.router_lr_mult=1000"],
    "noise_0.3": ["train.router_noise_std=0.3"],
    "noise_1": ["train.router_noise_std=1.0"],
}
SCREENED: dict[str, list[str]] = {  # the levers screened on each candidate
    "top4": ["none", "router_lr_x10", "router_lr_x30", "router_lr_x50", "router_lr_x100",
             "router_lr_x1000", "noise_0.3", "noise_1"],
    # no loss gradient reaches a hard gate's router: router_lr_mult would change nothing
    "top1_hard": ["none", "noise_0.3"],
    "ops_top1_hard": ["none", "noise_0.3"],
}


def cold_start(name: str) -> tuple[str, dict]:
    """The candidate's SFT run dir (made if absent) and where it entered the band."""
    return pc.cold_start(name, overrides=[*CANDIDATES[name], *SFT_EXTRA.get(name, [])],
                         runs=RUNS)
