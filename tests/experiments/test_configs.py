"""Every experiment config loads strictly, and the ablation arms compare like with like."""

import glob
import importlib.util
import os

import pytest

from megatron_gspo.config import ConfigError, load_config
from moe.presets import get_preset

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ABL = os.path.join(ROOT, "experiments", "ablation")
ARMS = ("gspo", "grpo", "grpo_r2")

_spec = importlib.util.spec_from_file_location("ablation_run", os.path.join(ABL, "run.py"))
ablation_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ablation_run)


YAMLS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*", "*.yaml")))


@pytest.mark.parametrize("path", YAMLS)
def test_experiment_yaml_loads(path):
    if path.endswith("gpu_small.yaml"):  # an override overlay, checked below
        return
    cfg = load_config(path)
    get_preset(cfg.model.preset)


@pytest.mark.parametrize("profile", sorted(ablation_run.PROFILES))
def test_ablation_arms_are_comparable(profile):
    """Same rollout compute, same optimizer, N > 1 minibatches (PITFALLS 4) in every arm."""
    base = ablation_run.profile_overrides(profile)
    cfgs = {arm: load_config(os.path.join(ABL, f"{arm}.yaml"), base) for arm in ARMS}
    sft = load_config(os.path.join(ABL, "sft.yaml"), base)
    shared = lambda c: (c.model, c.task, c.rollout, c.optim, c.train.steps,  # noqa: E731
                        c.train.num_minibatches, c.train.flip_every)
    assert shared(cfgs["gspo"]) == shared(cfgs["grpo"]) == shared(cfgs["grpo_r2"])
    assert (sft.model, sft.task) == (cfgs["gspo"].model, cfgs["gspo"].task)
    assert all(c.train.num_minibatches > 1 for c in cfgs.values())
    assert cfgs["gspo"].loss.name == "gspo" and cfgs["grpo"].loss.name == "grpo"
    assert (cfgs["gspo"].loss.eps_low, cfgs["gspo"].loss.eps_high) == (3e-4, 4e-4)
    assert (cfgs["grpo"].loss.eps_low, cfgs["grpo"].loss.eps_high) == (0.2, 0.27)
    assert [c.train.routing_replay for c in cfgs.values()] == ["off", "off", "r2"]


def test_gpu_profile_changes_the_preset():
    base = ablation_run.profile_overrides("gpu-small")
    assert load_config(os.path.join(ABL, "gspo.yaml"), base).model.preset == "small"
    with pytest.raises(ConfigError, match="nmodel"):
        load_config(os.path.join(ABL, "gspo.yaml"), [*base, "nmodel.preset=small"])


def test_demo_is_the_ablation_gspo_arm():
    """The demo's README/YAML comments say so (a shorter run of that arm); keep it true."""
    demo = load_config(os.path.join(ROOT, "experiments", "demo", "gspo.yaml"))
    arm = load_config(os.path.join(ABL, "gspo.yaml"))
    assert (demo.model, demo.task, demo.rollout, demo.loss, demo.optim, demo.seed) == \
        (arm.model, arm.task, arm.rollout, arm.loss, arm.optim, arm.seed)
    assert demo.train.num_minibatches == arm.train.num_minibatches  # the demo runs fewer steps
    demo_sft = load_config(os.path.join(ROOT, "experiments", "demo", "sft.yaml"))
    arm_sft = load_config(os.path.join(ABL, "sft.yaml"))
    assert (demo_sft.model, demo_sft.task, demo_sft.sft, demo_sft.seed) == \
        (arm_sft.model, arm_sft.task, arm_sft.sft, arm_sft.seed)


def test_profile_overlay_reads_yaml_like_the_config_loader(tmp_path, monkeypatch):
    """`off` in an overlay stays the string "off" (YAML 1.1 would make it False)."""
    (tmp_path / "overlay.yaml").write_text("train.routing_replay: off\noptim.lr: 3e-4\n")
    monkeypatch.setattr(ablation_run, "HERE", str(tmp_path))
    monkeypatch.setitem(ablation_run.PROFILES, "test", "overlay.yaml")
    overrides = ablation_run.profile_overrides("test")
    assert overrides == ["train.routing_replay=off", "optim.lr=0.0003"]
    cfg = load_config(os.path.join(ABL, "grpo_r2.yaml"), overrides)
    assert cfg.train.routing_replay == "off" and cfg.optim.lr == 3e-4
