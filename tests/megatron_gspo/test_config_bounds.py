"""Every range and non-empty check of the config schema at its edge: the bound itself loads,
the nearest value past it is a ConfigError naming the key and the rule (a dropped or
loosened check would let a run start with a value that fails, or silently misbehaves, later)."""

import pytest

from megatron_gspo.config.schema import ConfigError, TaskConfig, config_from_dict, load_config

# (key, the edge value that loads, the nearest value past it, the rule in the message)
EDGES = [
    ("model.tp", "1", "0", "must be >= 1"),
    ("model.ep", "1", "0", "must be >= 1"),
    ("model.aux_loss_coeff", "0", "-0.01", "must be >= 0"),
    ("model.vocab_multiple", "1", "0", "must be >= 1"),
    ("model.max_seq_len", "2", "1", "must be >= 2"),
    ("model.num_layers", "1", "0", "must be >= 1"),
    ("task.n_train", "1", "0", "must be >= 1"),
    ("task.n_eval", "0", "-1", "must be >= 0"),
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


def test_tis_cap_with_the_samplers_logprobs_is_refused():
    """Guards RunConfig's tis_cap x use_sampler_logprobs rule: pi_old would be the sampler's,
    so every TIS weight would be 1."""
    with pytest.raises(ConfigError, match=r"^loss.tis_cap=2.0 weights by pi_old / pi_sampler"):
        load_config(None, ["loss.tis_cap=2", "rollout.use_sampler_logprobs=true"])
    assert load_config(None, ["loss.tis_cap=2"]).loss.tis_cap == 2.0
    assert load_config(None, ["rollout.use_sampler_logprobs=true"]).rollout.use_sampler_logprobs


def test_r3_without_the_kv_cache_is_refused():
    """Guards R3's kv_cache requirement (its sequence-parallel half is in test_config.py)."""
    with pytest.raises(ConfigError, match=r"rollout.kv_cache=true \(got False\)"):
        load_config(None, ["train.routing_replay=r3", "rollout.kv_cache=false"])
    assert load_config(None, ["train.routing_replay=r2", "rollout.kv_cache=false"]) \
        .train.routing_replay == "r2"
