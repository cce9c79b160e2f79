"""megatron_gspo.config.loader: building a config from YAML data, strict keys and dotted
overrides (values read as YAML 1.2, then into the field's type)."""

import os
import textwrap

import pytest

from megatron_gspo.algo.losses import clip_range
from megatron_gspo.config.schema import RunConfig, config_from_dict, load_config
from megatron_gspo.errors import ConfigError


def _write(tmp_path, text: str) -> str:
    path = os.path.join(tmp_path, "exp.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("text, key", [
    ("bogus: 1\n", "'bogus'"),
    ("model:\n  tp: 1\n  experts: 4\n", "'model.experts'"),
    ("task:\n  nam: addition\n", "'task.nam'"),
])
def test_unknown_yaml_key_names_dotted_key_and_valid_keys(tmp_path, text, key):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    msg = str(e.value)
    assert key in msg
    if "model" in key:
        assert "preset, tp, ep, sequence_parallel, dispatcher, dtype, aux_loss_coeff" in msg
    if key == "'bogus'":
        assert "run_dir" in msg and "wandb" in msg


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        load_config(_write(tmp_path, "train: 5\n"))


def test_override_into_a_section_left_empty_in_the_file(tmp_path):
    """`wandb:` with nothing under it (YAML null) is an empty section an override can fill."""
    cfg = load_config(_write(tmp_path, "wandb:\nrun_dir: runs/x\n"), ["wandb.mode=disabled"])
    assert cfg.wandb.mode == "disabled" and cfg.run_dir == "runs/x"


def test_an_empty_section_is_that_sections_defaults(tmp_path):
    """Guards `build` on null: `wandb:` with nothing under it (YAML null) is the section's
    defaults, not a 'expected a mapping' error."""
    assert load_config(_write(tmp_path, "wandb:\ntrain:\nseed: 2\n")) == RunConfig(seed=2)
    assert config_from_dict(None) == RunConfig()


def test_overrides_coerce_types():
    cfg = load_config(None, ["loss.eps_low=3e-4", "optim.lr=1e-5", "train.steps=7",
                             "rollout.temperature=2", "loss.eps_high=null", "seed=3",
                             "wandb.name=2024", "task.name=countdown",
                             "task.kwargs.num_numbers=3", "task.kwargs.max_number=[1,2]",
                             "train.routing_replay=r3"])
    assert cfg.loss.eps_low == pytest.approx(3e-4) and type(cfg.loss.eps_low) is float
    assert cfg.optim.lr == 1e-5 and cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.rollout.temperature == 2.0 and type(cfg.rollout.temperature) is float
    assert cfg.loss.eps_high == 4e-4 and cfg.seed == 3  # null: the loss's default (as older
    assert clip_range(cfg.loss) == (3e-4, 4e-4)  # configs said it), GSPO's paper one
    assert cfg.wandb.name == "2024"  # a str field keeps the literal text
    assert cfg.task.kwargs == {"num_numbers": 3, "max_number": [1, 2]}  # YAML-typed values
    assert cfg.train.routing_replay == "r3"


@pytest.mark.parametrize("override, fragment", [
    ("train.num_minibatches=abc", "train.num_minibatches=abc: expected int"),
    ("train.steps=2.5", "train.steps=2.5: expected int"),
    ("resume=maybe", "resume=maybe: expected bool | 'force'"),
    ("loss.eps_low=abc", "loss.eps_low=abc: expected float"),
    ("train.routing_replay=r9", "expected one of 'off', 'r2', 'r3'"),
    ("model.dtype=fp8", "expected one of 'fp32', 'bf16', 'fp16'"),
    ("model.tp=", "model.tp=: expected int"),
    ("model.nope=1", "unknown config key 'model.nope'"),
    ("nope.x=1", "unknown config key 'nope'"),
    ("model.tp.x=1", "model.tp.x"),
    ("model=1", "model is a section"),
    ("train.steps", "not of the form"),
    ("rollout.group_size=1", "rollout.group_size=1: must be >= 2"),
    ("rollout.top_p=0", "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.temperature=nan", "rollout.temperature=nan: must be > 0"),
    ("model.sequence_parallel=true", "model.sequence_parallel=True: requires tp > 1"),
    ("model.tp=2", "model.sequence_parallel=False: must be true with tp=2"),
    ("model.dist_timeout_min=0", "model.dist_timeout_min=0.0: must be > 0"),
    ("model.dist_timeout_min=.inf", "model.dist_timeout_min=inf: must be finite"),
    ("model.num_layers=0", "model.num_layers=0: must be >= 1"),
    ("train.steps=true", "train.steps=True: expected int"),  # a bool is not a number
    ("rollout.temperature=true", "rollout.temperature=True: expected float"),
    ("rollout.decoders.kv_cache=2", "rollout.decoders.kv_cache=2: expected bool"),  # no truthiness
    ("run_dir=", "run_dir=: must be non-empty"),
    ("model.recompute_modules=moe,bogus", "model.recompute_modules=moe,bogus: expected a comma"),
    ("task.n_train=0", "task.n_train=0: must be >= 1"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5: must be in (0, 1]"),
    ("train.collapse_reward_drop=0", "train.collapse_reward_drop=0.0: must be in (0, 1]"),
    ("sft.min_lr=0.01", "sft.min_lr=0.01: must be <= sft.lr=0.003"),
])
def test_bad_overrides_raise_naming_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)


def test_a_literal_error_echoes_the_override_text():
    """An override's value for a word field (Literal) is kept as its text, so the error shows
    what was typed, not YAML's reading of it."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.routing_replay=true"])
    assert str(e.value) == "train.routing_replay=true: expected one of 'off', 'r2', 'r3'"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dtype=1e3"])
    assert str(e.value).startswith("model.dtype=1e3: expected one of")


def test_an_override_that_is_not_yaml_is_one_line():
    """An unquoted string holding ': ' (a template) is not a YAML value: one line (the CLI's
    rule) with the quoting that works."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=dataset", "data.train_files=a.jsonl",
                           "data.template=Question: {prompt}\\nAnswer:"])
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("data.template=Question: {prompt}\\nAnswer:: not a YAML value")
    assert str(e.value).endswith("""quote a string in double quotes, e.g. data.template='"..."'""")


def test_override_spaces_around_key_and_value_are_dropped():
    """Guards `loader._parse_override` / `_override_value` stripping: `train.steps = 5` and
    `wandb.name = 2024` (a str field keeps the number's text) read like their unspaced
    forms; an empty part in the dotted key is refused as malformed."""
    cfg = load_config(None, ["train.steps = 5", "wandb.name = 2024"])
    assert cfg.train.steps == 5 and cfg.wandb.name == "2024"
    for item in ["model..tp=1", ".seed=1", "seed.=1"]:
        with pytest.raises(ConfigError, match="is not of the form dotted.key=value"):
            load_config(None, [item])


def test_dict_field_overrides_nest_and_read_yaml_1_2():
    """Guards `apply_override` into a dict field: deeper dotted keys build nested mappings
    that later overrides extend (not reset), and values are read as YAML 1.2 (`3e-4` a float,
    `off` a word), as in files."""
    from megatron_gspo.config.loader import apply_override

    raw = {}
    for item in ["task.kwargs.a.b=1", "task.kwargs.a.c=2", "task.kwargs.lr=3e-4",
                 "task.kwargs.mode=off"]:
        apply_override(RunConfig, raw, item)
    assert raw == {"task": {"kwargs": {"a": {"b": 1, "c": 2}, "lr": 3e-4, "mode": "off"}}}


def test_a_built_config_does_not_alias_its_input_dicts():
    """Guards the copy of dict fields: editing the dict a config was built from (or a dict
    override's default) leaves the frozen config as it was."""
    raw = {"task": {"kwargs": {"num_digits": 2}}}
    cfg = config_from_dict(raw)
    raw["task"]["kwargs"]["num_digits"] = 5
    assert cfg.task.kwargs == {"num_digits": 2}
    a = load_config(None, ["task.kwargs.num_digits=3"])
    assert load_config(None, []).task.kwargs == {} and a.task.kwargs == {"num_digits": 3}


OLD = {"rollout.kv_cache": False, "rollout.sampler_dtype": "bf16",
       "rollout.router_noise_std": 0.5, "rollout.router_noise": "fresh",
       "rollout.cuda_graphs": False, "rollout.engine_dtype": "bf16",
       "rollout.engine_kv_cache_gb": 2.0, "rollout.push_check_tol": 0.5}
"""Backend settings that moved from `rollout` into their backend's section, at non-defaults."""


def _nested(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_keys_moved_into_a_backend_section_load_under_their_older_names(tmp_path):
    """rollout.kv_cache, .engine_dtype, ... (a config or a saved `*_config.yaml` from before
    the backend sections) load as rollout.decoders.kv_cache, rollout.vllm.dtype, ...: in YAML
    beside keys of the section they moved into, as overrides (which replace the file's value
    under the other name, either way round) and in the run records (`run/test_rundir.py`); one
    mapping giving a key under both names is refused naming both."""
    from megatron_gspo.config.rollout import RolloutConfig

    old = _write(tmp_path, "rollout:\n" + "".join(
        f"  {k.split('.')[1]}: {str(v).lower()}\n" for k, v in OLD.items())
        + "  vllm: {mode: server}\n  decoders: null\n")
    cfg = load_config(old)
    moved = {k: "rollout." + RolloutConfig._renamed[k.split(".")[1]] for k in OLD}
    assert {new: _nested(cfg, new) for new in moved.values()} == \
        {moved[k]: v for k, v in OLD.items()}
    assert moved["rollout.engine_dtype"] == "rollout.vllm.dtype"
    assert moved["rollout.cuda_graphs"] == "rollout.megatron_engine.cuda_graphs"
    assert cfg.rollout.vllm.mode == "server"
    assert load_config(old, ["rollout.vllm.dtype=fp32"]).rollout.vllm.dtype == "fp32"
    assert load_config(old, ["rollout.decoders.kv_cache=true", "rollout.kv_cache=false"]) \
        .rollout.decoders.kv_cache is False  # the later override wins, under either name
    new = _write(tmp_path, "rollout:\n  vllm:\n    dtype: bf16\n")
    assert load_config(new, ["rollout.engine_dtype=fp32"]).rollout.vllm.dtype == "fp32"
    both = _write(tmp_path, "rollout:\n  engine_dtype: fp32\n  vllm: {dtype: bf16}\n")
    with pytest.raises(ConfigError, match=r"^rollout.engine_dtype and rollout.vllm.dtype are one "
                                          r"key \(rollout.engine_dtype is its older name\): "
                                          r"give it once, as rollout.vllm.dtype$"):
        load_config(both)
    with pytest.raises(ConfigError, match=r"^rollout.vllm: expected a mapping of keys, got str"):
        load_config(_write(tmp_path, "rollout:\n  engine_dtype: fp32\n  vllm: server\n"))
    with pytest.raises(ConfigError, match=r"^rollout.vllm.dtype=fp16: expected one of"):
        load_config(None, ["rollout.engine_dtype=fp16"])


def test_a_file_overrides_its_base_under_a_keys_older_or_newer_name(tmp_path):
    """Older names are read file by file, before a file is merged over its base: a user's file
    that still says rollout.engine_dtype over a base that says rollout.vllm.dtype (or the other
    way round) overrides it, where both names met in one mapping and were refused."""
    (tmp_path / "new_base.yaml").write_text("rollout:\n  vllm: {dtype: bf16}\n")
    (tmp_path / "old_base.yaml").write_text("rollout:\n  engine_dtype: bf16\n")
    (tmp_path / "old_child.yaml").write_text("base: new_base.yaml\nrollout:\n  engine_dtype: fp32\n")
    (tmp_path / "new_child.yaml").write_text("base: old_base.yaml\nrollout:\n  vllm: {dtype: fp32}\n")
    for child in ("old_child.yaml", "new_child.yaml"):
        assert load_config(str(tmp_path / child)).rollout.vllm.dtype == "fp32", child
