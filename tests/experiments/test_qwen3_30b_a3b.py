"""The real-scale ablation profile (experiments/ablation/qwen3_30b_a3b*.yaml), a dry run on the
CPU: every arm loads strictly with registered names and a layout the model splits into, the arms
differ only in the loss and Routing Replay, the paper's values are the paper's, every value is
commented with its source, and `megatron-gspo plan` says each arm fits 16 and 32 H100s with the
layouts the profile names (its pick)."""

import os

import pytest

from megatron_gspo.config.schema import load_config
from megatron_gspo.jobs import plan
from megatron_gspo.run.names import check_names
from tests.experiments.test_configs import config_diff

ABL = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "ablation")
ARMS = {"gspo": "qwen3_30b_a3b.yaml", "grpo": "qwen3_30b_a3b_grpo.yaml",
        "grpo_r2": "qwen3_30b_a3b_grpo_r2.yaml", "grpo_r3": "qwen3_30b_a3b_grpo_r3.yaml"}
LAYOUTS = {16: [], 32: ["model.ep=8"]}
"""The layout the profile names for N H100s (its header comment): overrides of the 16-GPU file."""


def arms(overrides=()) -> dict:
    return {arm: load_config(os.path.join(ABL, f), list(overrides)) for arm, f in ARMS.items()}


def test_the_arms_load_validate_and_differ_only_in_the_loss_and_replay():
    cfgs = arms()
    for cfg in cfgs.values():
        check_names(cfg)  # task, loss, reward, sampler: registered
        p, note = plan.model_preset(cfg)
        assert "does not exist here" in note  # hf_path is the placeholder the user sets
        plan.check_layout(p, cfg, 16)
    assert config_diff(cfgs["gspo"], cfgs["grpo"]) == {"run_dir", "loss.name", "loss.eps_low",
                                                       "loss.eps_high"}
    for replay in ("r2", "r3"):
        assert config_diff(cfgs["grpo"], cfgs[f"grpo_{replay}"]) == {"run_dir",
                                                                     "train.routing_replay"}
        assert cfgs[f"grpo_{replay}"].train.routing_replay == replay
    gspo, grpo = cfgs["gspo"], cfgs["grpo"]
    assert (gspo.loss.eps_low, gspo.loss.eps_high, grpo.loss.eps_low, grpo.loss.eps_high) == \
        (3e-4, 4e-4, 0.2, 0.27)  # paper sec. 5.1
    assert gspo.train.num_minibatches == 4 and gspo.model.preset == "qwen3-30b-a3b"
    assert gspo.model.hf_path == "/path/to/Qwen3-30B-A3B"
    assert len({c.run_dir for c in cfgs.values()}) == 4


@pytest.mark.parametrize("gpus", sorted(LAYOUTS))
def test_the_plan_fits_every_arm_with_the_layout_it_picks(gpus):
    """On N H100s of 80 GiB every arm fits the layout the profile names for N, which is the
    plan's pick (the fitting layout with the fewest TP, then EP ranks) for the arm that needs
    the most: one layout for all four arms."""
    limit = plan.HEADROOM * 80 * plan.GIB
    picks = []
    for arm, cfg in arms(LAYOUTS[gpus]).items():
        text, fits = plan.report(ARMS[arm], cfg, gpus, 80)
        assert fits, text
        p, _ = plan.model_preset(cfg)
        picks.append(plan.pick(plan.layouts(p, cfg, gpus, limit)))
    assert max(picks) == (cfg.model.tp, cfg.model.ep)
    with open(os.path.join(ABL, ARMS["gspo"])) as f:
        header = f.read()
    assert f"32 H100s: model.tp=1 model.ep=8 (add `{LAYOUTS[32][0]}`" in header
    assert "16 H100s: model.tp=1 model.ep=16 (this file" in header


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_value_says_where_it_comes_from(arm):
    """Each key: value line carries a comment, or sits under a comment block (a placeholder's
    note); the paper's values cite it by section."""
    with open(os.path.join(ABL, ARMS[arm])) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        body = line.split("#")[0].strip()
        if not body or body.endswith(":") or body.startswith(("base:", "name:")):
            continue  # a comment, a section, the base file, a registry name
        assert "#" in line or lines[i - 1].strip().startswith("#"), line
    cited = {"num_minibatches", "eps_low", "eps_high"}
    for line in lines:
        key = line.split(":")[0].strip()
        if key in cited:
            assert "paper sec. 5.1" in line, line
