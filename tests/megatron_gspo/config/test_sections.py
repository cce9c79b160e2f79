"""megatron_gspo.config.sections: each section's defaults, every range and non-empty check at its
edge, the rules within a section, and the values derived by properties (never stored)."""

import dataclasses

import pytest

from megatron_gspo.algo.losses import clip_range
from megatron_gspo.config.schema import (LossConfig, ModelConfig, RunConfig, TaskConfig,
                                         config_from_dict, load_config)
from megatron_gspo.config.loss import ClipRange
from megatron_gspo.errors import ConfigError


def test_defaults_construct():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.model.preset == "qwen3-moe-tiny" and cfg.model.attention == "sdpa"
    # dispatcher 'auto' (saved as given) resolves by a property: all-to-all only with EP
    assert cfg.model.dispatcher == "auto" and cfg.model.resolved_dispatcher == "allgather"
    assert load_config(None, ["model.ep=2"]).model.resolved_dispatcher == "alltoall"
    assert load_config(None, ["model.ep=2", "model.dispatcher=allgather"]).model \
        .resolved_dispatcher == "allgather"
    assert cfg.rollout.group_size == 8 and cfg.train.num_minibatches == 4
    # the loss's own settings at their defaults: the paper's clip range (sec. 5.1)
    assert cfg.loss.settings is None and (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
    assert clip_range(cfg.loss) == (3e-4, 4e-4)
    assert cfg.optim.beta2 == 0.999 and cfg.sft.lr == 3e-3
    assert cfg.train.routing_replay == "off" and cfg.wandb.mode == "offline"
    assert cfg.task.kwargs == {} and cfg.resume is True


EDGES = [
    ("model.tp", "1", "0", "must be >= 1"),
    ("model.ep", "1", "0", "must be >= 1"),
    ("model.aux_loss_coeff", "0", "-0.01", "must be >= 0"),
    ("model.vocab_multiple", "1", "0", "must be >= 1"),
    ("model.max_seq_len", "2", "1", "must be >= 2"),
    ("model.num_layers", "1", "0", "must be >= 1"),
    ("task.n_train", "1", "0", "must be >= 1"),
    ("task.n_test", "0", "-1", "must be >= 0"),
    ("rollout.prompts_per_batch", "1", "0", "must be >= 1"),
    ("rollout.group_size", "2", "1", "must be >= 2"),
    ("rollout.max_new_tokens", "1", "0", "must be >= 1"),
    ("rollout.temperature", "1e-6", "0", "must be > 0"),
    ("rollout.top_p", "1", "1.001", "must be in (0, 1]"),
    ("rollout.top_p", "1e-6", "0", "must be in (0, 1]"),
    ("loss.adv_eps", "1e-12", "0", "must be > 0"),
    ("train.steps", "1", "0", "must be >= 1"),
    ("train.num_minibatches", "1", "0", "must be >= 1"),
    ("train.log_every", "1", "0", "must be >= 1"),
    ("train.flip_every", "0", "-1", "must be >= 0"),
    ("train.logprob_max_tokens", "0", "-1", "must be >= 0"),
    ("train.router_noise_std", "0", "-0.1", "must be >= 0"),
    ("train.eval_every", "0", "-1", "must be >= 0"),
    ("train.save_every", "0", "-1", "must be >= 0"),
    ("train.max_skipped_steps", "0", "-1", "must be >= 0"),
    ("train.collapse_entropy_floor", "0", "-0.01", "must be >= 0"),
    ("train.collapse_reward_drop", "1", "1.01", "must be in (0, 1]"),
    ("sft.steps", "1", "0", "must be >= 1"),
    ("sft.batch_size", "1", "0", "must be >= 1"),
    ("sft.eval_every", "0", "-1", "must be >= 0"),
    ("sft.min_lr", "0", "-1e-4", "must be >= 0"),
    ("sft.min_lr", "0.003", "0.0031", "must be <= sft.lr=0.003"),  # min_lr may equal lr
    ("seed", "0", "-1", "must be >= 0"),
    ("optim.beta1", "0", "1", "must be in [0, 1)"),  # OptimSettings.problems, wired in
    ("optim.router_lr_mult", "1e-9", "0", "must be > 0"),
    ("loss.dual_clip", "1.0001", "1", "must be > 1 or null"),
]


@pytest.mark.parametrize("key, edge, past, rule", EDGES)
def test_each_bound_admits_its_edge_and_refuses_past_it(key, edge, past, rule):
    """Guards each __post_init__ range check: its edge value loads, one step past it is a
    ConfigError `key=value: rule`."""
    section, _, name = key.rpartition(".")
    cfg = load_config(None, [f"{key}={edge}"])
    assert getattr(getattr(cfg, section) if section else cfg, name) == float(edge)
    with pytest.raises(ConfigError, match=r"^" + key.replace(".", r"\.") + "=") as e:
        load_config(None, [f"{key}={past}"])
    assert rule in str(e.value)


@pytest.mark.parametrize("key", ["model.preset", "model.hf_path", "init_checkpoint",
                                 "wandb.project", "run_dir"])
def test_an_empty_string_is_refused_where_a_path_or_name_is_expected(key):
    """Guards the non-empty checks: `key=` (an empty string, not null) would be a path or name
    that cannot exist."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}="])
    assert str(e.value) == f"{key}=: must be non-empty"


def test_a_non_str_task_kwargs_key_is_refused_as_such():
    """Guards TaskConfig's kwargs key check: YAML `kwargs: {1: 3}` has an int key, which no
    Python keyword argument can be (also for task.name=dataset, whose kwargs nobody reads)."""
    with pytest.raises(ConfigError, match=r"^task.kwargs=\{1: 3\}: keys must be str"):
        config_from_dict({"task": {"kwargs": {1: 3}}})
    with pytest.raises(ConfigError, match="keys must be str"):
        TaskConfig(name="dataset", kwargs={1: 3})


def test_num_layers_is_for_presets_only():
    with pytest.raises(ConfigError, match=r"model.num_layers=3: only with model.preset"):
        load_config(None, ["model.num_layers=3", "model.hf_path=/some/folder"])


def test_routing_replay_error_lists_valid_literals():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.routing_replay=r9"])
    assert str(e.value) == "train.routing_replay=r9: expected one of 'off', 'r2', 'r3'"


def test_sequence_parallel_ok_with_tp2():
    cfg = load_config(None, ["model.tp=2", "model.sequence_parallel=true"])
    assert cfg.model.sequence_parallel is True and cfg.model.tp == 2
    with pytest.raises(ConfigError, match="model.tp=0"):
        ModelConfig(tp=0)


def test_loss_section_is_the_policy_loss_config():
    """One definition: the loss functions take the run config's loss section as it is
    (`losses.PolicyLossConfig` is it), the selected loss's own settings (the clip range of the
    built-in ones) beside its keys: given keys over the loss's defaults."""
    from dataclasses import fields

    from megatron_gspo.algo.losses import PolicyLossConfig

    assert PolicyLossConfig is LossConfig
    assert [f.name for f in fields(LossConfig)] == \
        ["name", "kl_coef", "max_log_ratio", "tis_cap", "is_mask_token", "is_mask_seq",
         "icepop", "adv_eps", "dual_clip", "settings"]
    cfg = load_config(None, ["loss.name=grpo", "loss.eps_high=0.3"])
    assert cfg.loss.settings == ClipRange(eps_low=0.2, eps_high=0.3)
    assert clip_range(cfg.loss) == (0.2, 0.3) == (cfg.loss.eps_low, cfg.loss.eps_high)
    assert load_config(None, ["loss.name=grpo", "loss.eps_high=0.27"]).loss.settings is None


def test_derived_values_follow_a_replaced_field():
    """Derived values are computed from the fields, so a section copied with another field
    (`dataclasses.replace`) derives them anew; a value written back at load kept the old one
    (an EP=1 'allgather' under ep=2, gspo's 3e-4 clip under grpo: a loss's settings left at
    their defaults are None, the defaults of the loss named)."""
    cfg = load_config(None, [])
    assert dataclasses.replace(cfg.model, ep=2).resolved_dispatcher == "alltoall"
    assert clip_range(dataclasses.replace(cfg.loss, name="grpo")) == (0.2, 0.27)
    assert load_config(None, ["rollout.decoder=megatron"]).rollout.backend == "megatron"


def test_loss_ranges_at_their_edges():
    """Guards the loss section's checks (one style with the others): eps_low in [0, 1),
    eps_high and kl_coef >= 0, max_log_ratio, tis_cap and adv_eps > 0, each naming its key."""
    assert LossConfig(settings=ClipRange(eps_low=0.0, eps_high=0.0), kl_coef=0.0).eps_low == 0.0
    for key, value, rule in [("eps_low", -0.1, "must be in [0, 1)"),
                             ("eps_low", 1.0, "must be in [0, 1)"),
                             ("eps_high", -1e-3, "must be >= 0"),
                             ("eps_high", float("inf"), "must be finite")]:
        with pytest.raises(ConfigError) as e:
            ClipRange(**{"eps_low": 0.0, "eps_high": 0.0, key: value})
        assert str(e.value) == f"loss.{key}={value}: {rule}"
    for key, value, rule in [("kl_coef", -1e-3, "must be >= 0"),
                             ("max_log_ratio", 0.0, "must be > 0"),
                             ("tis_cap", 0.0, "must be > 0"),
                             ("name", "", "must be non-empty")]:
        with pytest.raises(ConfigError) as e:
            LossConfig(**{key: value})
        assert str(e.value) == f"loss.{key}={value}: {rule}"


def test_preset_overrides_replace_architecture_fields_and_name_bad_ones():
    """model.preset_overrides builds the preset with those fields (validated as a preset); an
    unknown or fixed field, a wrong type or an impossible architecture is one ConfigError."""
    from megatron_gspo.run.setup import resolve_preset

    cfg = load_config(None, ["model.preset_overrides={num_experts: 32, topk: 1, "
                             "moe_ffn_hidden_size: 16, norm_topk_prob: false}"])
    p = resolve_preset(cfg, 20)
    assert (p.num_experts, p.topk, p.moe_ffn_hidden_size, p.norm_topk_prob) == (32, 1, 16, False)
    assert p.hidden_size == 64 and p.vocab_size == 32  # the rest is the preset's
    for bad, msg in [("{num_expertz: 2}", "'num_expertz' is not an architecture field"),
                     ("{vocab_size: 2}", "'vocab_size' is not an architecture field"),
                     ("{topk: 17}", "topk=17 exceeds num_experts=16"),
                     ("{norm_topk_prob: 1}", "norm_topk_prob=1 must be a bool")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(None, [f"model.preset_overrides={bad}"])
    with pytest.raises(ConfigError, match="preset_overrides.*only with model.preset"):
        load_config(None, ["model.preset_overrides={topk: 1}", "model.hf_path=/m"])
