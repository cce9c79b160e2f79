"""Every experiment config loads strictly, and the ablation arms compare like with like: the arms
and the demo inherit one recipe (`base:`), and differ from each other only in the keys listed
here."""

import glob
import importlib.util
import os

import pytest

from experiments.ablation import run as ablation_run
from megatron_gspo.config.schema import config_to_dict, load_config
from megatron_gspo.config.yamlfile import load_yaml
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.names import check_names
from moe.model.presets import get_preset

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ABL = os.path.join(ROOT, "experiments", "ablation")
DEMO = os.path.join(ROOT, "experiments", "demo")
ARMS = ("gspo", "grpo", "grpo_r2")


PROFILE_FILES = {os.path.join(ABL, f) for f in ablation_run.PROFILES.values() if f}
CONFIGS = sorted(set(glob.glob(os.path.join(ROOT, "experiments", "*", "*.yaml")))
                 - PROFILE_FILES)
PUBLISHED = [p for p in CONFIGS if not os.path.basename(p).startswith("qwen3_30b_a3b")]
"""The configs a README table came from (the real-scale profile has run nowhere yet)."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_diff(a, b) -> set[str]:
    """The dotted keys whose values differ between two configs (`kwargs` compared whole)."""
    fa, fb = _flat(config_to_dict(a)), _flat(config_to_dict(b))
    return {k for k in fa if fa[k] != fb[k]}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, ROOT))
def test_experiment_yaml_loads(path):
    cfg = load_config(path)
    try:
        check_names(cfg)  # its task, loss, reward and sampler are registered ones
    except ConfigError as e:  # a vLLM experiment where vLLM is not installed (Python 3.10)
        if cfg.rollout.backend != "vllm" or importlib.util.find_spec("vllm") is not None:
            raise
        assert "rollout.backend=vllm needs vLLM" in str(e)
    get_preset(cfg.model.preset)


@pytest.mark.parametrize("path", sorted(PROFILE_FILES), ids=os.path.basename)
def test_profile_yaml_has_no_base(path):
    """A profile is laid over every config as overrides; a `base` there would be a config key."""
    assert "base" not in load_yaml(path)


@pytest.mark.parametrize("profile", sorted(ablation_run.PROFILES))
def test_ablation_arms_differ_only_in_the_intended_keys(profile):
    """Same rollout compute, same optimizer, N > 1 minibatches in every arm
    (docs/pitfalls.md#minibatches)."""
    base = ablation_run.profile_overrides(profile)
    cfgs = {arm: load_config(os.path.join(ABL, f"{arm}.yaml"), base) for arm in ARMS}
    sft = load_config(os.path.join(ABL, "sft.yaml"), base)
    assert config_diff(cfgs["gspo"], cfgs["grpo"]) == {"run_dir", "loss.name", "loss.eps_low",
                                                 "loss.eps_high"}
    assert config_diff(cfgs["grpo"], cfgs["grpo_r2"]) == {"run_dir", "train.routing_replay"}
    assert (sft.model, sft.task) == (cfgs["gspo"].model, cfgs["gspo"].task)
    assert all(c.train.num_minibatches == 4 for c in cfgs.values())
    assert cfgs["gspo"].loss.name == "gspo" and cfgs["grpo"].loss.name == "grpo"
    assert (cfgs["gspo"].loss.eps_low, cfgs["gspo"].loss.eps_high) == (3e-4, 4e-4)
    assert (cfgs["grpo"].loss.eps_low, cfgs["grpo"].loss.eps_high) == (0.2, 0.27)
    assert [c.train.routing_replay for c in cfgs.values()] == ["off", "off", "r2"]
    assert {c.init_checkpoint for c in cfgs.values()} == {"runs/ablation/sft"}


def test_gpu_profile_changes_the_preset():
    base = ablation_run.profile_overrides("gpu-small")
    assert load_config(os.path.join(ABL, "gspo.yaml"), base).model.preset == "small"
    with pytest.raises(ConfigError, match="nmodel"):
        load_config(os.path.join(ABL, "gspo.yaml"), [*base, "nmodel.preset=small"])


def test_demo_is_the_ablation_gspo_arm():
    """The demo's README/YAML comments say so (a shorter run of that arm, with a validation
    split for its band); keep it true."""
    demo, arm = (load_config(os.path.join(d, "gspo.yaml")) for d in (DEMO, ABL))
    assert config_diff(demo, arm) == {"run_dir", "init_checkpoint", "train.steps",
                                "train.eval_every", "train.save_every", "task.n_val"}
    assert (demo.train.steps, arm.train.steps) == (60, 150)
    demo_sft, arm_sft = (load_config(os.path.join(d, "sft.yaml")) for d in (DEMO, ABL))
    assert config_diff(demo_sft, arm_sft) == {"run_dir", "task.n_val"}
    assert demo.task == demo_sft.task and demo.task.n_val == 256  # the band reads validation
    # one accuracy band: SFT stops in it, every RL run (demo and arms) refuses a start outside
    assert demo.train.start_accuracy == arm_sft.sft.target_accuracy == [0.25, 0.45]


def test_profile_overlay_reads_yaml_like_the_config_loader(tmp_path, monkeypatch):
    """`off` in an overlay stays the string "off" (YAML 1.1 would make it False); nested and
    dotted keys both work."""
    (tmp_path / "overlay.yaml").write_text(
        "train.routing_replay: off\noptim: {lr: 3e-4}\ntask: {kwargs: {num_digits: 3}}\n"
        "model: {dtype: null}\n")
    monkeypatch.setattr(ablation_run, "HERE", str(tmp_path))
    monkeypatch.setitem(ablation_run.PROFILES, "test", "overlay.yaml")
    overrides = ablation_run.profile_overrides("test")
    assert overrides == ["train.routing_replay=off", "optim.lr=0.0003",
                         "task.kwargs.num_digits=3", "model.dtype=null"]
    with pytest.raises(ConfigError, match="model.dtype=None"):
        load_config(os.path.join(ABL, "grpo_r2.yaml"), overrides)
    cfg = load_config(os.path.join(ABL, "grpo_r2.yaml"), overrides[:3])
    assert cfg.train.routing_replay == "off" and cfg.optim.lr == 3e-4
    assert cfg.task.kwargs == {"num_digits": 3}


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: os.path.relpath(p, ROOT))
def test_published_experiments_pin_the_kernels_they_ran_with(path):
    """Every experiment config names the attention, Adam path, pi_old chunking and packing its
    README's tables were generated with, in its YAML (not through defaults, which change: their
    rounding can flip a sampled token). The experiments before the fast kernels became the
    defaults ran with megatron's DotProductAttention, Adam's foreach path and one pi_old
    forward per rollout batch; those after them, which say so in their README, with the fast
    ones; all of them with padded forwards (train.pack, sft.pack)."""
    from megatron_gspo.config.yamlfile import load_layered

    raw = load_layered(path)
    pinned = (raw.get("model", {}).get("attention"), raw.get("optim", {}).get("adam_kernel"),
              raw.get("train", {}).get("logprob_max_tokens"), raw.get("train", {}).get("pack"),
              raw.get("sft", {}).get("pack"))
    assert None not in pinned, pinned
    if os.path.basename(os.path.dirname(path)) in FAST_KERNELS:
        assert pinned == ("sdpa", "fused", 4096, False, False)
    else:
        assert pinned == ("megatron", "foreach", 0, False, False)


FAST_KERNELS = ("positive_control", "staleness")
"""The experiments that ran with SDPA attention, fused Adam and 4096-token pi_old chunks."""


def test_gpu_profile_uses_the_fast_kernels():
    cfg = load_config(os.path.join(ABL, "gspo.yaml"), ablation_run.profile_overrides("gpu-small"))
    assert (cfg.model.attention, cfg.optim.adam_kernel) == ("sdpa", "fused")
    assert cfg.train.logprob_max_tokens == 16384
