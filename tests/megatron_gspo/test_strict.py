"""megatron_gspo.config.loader: value coercion at its edges (what a YAML file or a dict may hold that an
override cannot), and that a built config shares nothing mutable with its input (the schema's
loading end to end is in test_config.py)."""

import os
import textwrap

import pytest

from megatron_gspo.config.schema import ConfigError, config_from_dict, load_config


def _load(tmp_path, text: str):
    path = os.path.join(tmp_path, "exp.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return load_config(path)


def test_an_int_field_takes_a_quoted_integer_but_not_a_quoted_fraction(tmp_path):
    """Guards `_to_int` on strings: "7" is 7, "2.5" is refused (not truncated to 2)."""
    assert _load(tmp_path, 'train: {steps: "7"}\n').train.steps == 7
    with pytest.raises(ConfigError, match=r"^train.steps=2.5: expected int$"):
        _load(tmp_path, 'train: {steps: "2.5"}\n')
    with pytest.raises(ConfigError, match=r"^train.steps=1e3: expected int$"):
        _load(tmp_path, 'train: {steps: "1e3"}\n')


def test_one_and_zero_are_booleans_only_as_text():
    """Guards the "1" / "0" words of `_to_bool`: `resume=1` (text: resume also takes the word
    'force') is true, `resume=0` false; a bool-only field refuses the number 1 (no
    truthiness)."""
    assert load_config(None, ["resume=1"]).resume is True
    assert load_config(None, ["resume=0"]).resume is False
    assert load_config(None, ["resume=on"]).resume is True
    assert config_from_dict({"rollout": {"kv_cache": "0"}}).rollout.kv_cache is False
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache=1: expected bool$"):
        load_config(None, ["rollout.kv_cache=1"])


def test_a_list_field_refuses_a_mapping():
    """Guards `_to_list`: a mapping is no list (its keys would silently become the files)."""
    with pytest.raises(ConfigError, match=r"^data.train_files=\{'a.jsonl': 1\}: expected list$"):
        config_from_dict({"task": {"name": "dataset"}, "data": {"train_files": {"a.jsonl": 1}}})


def test_a_built_config_does_not_alias_its_input_dicts():
    """Guards the copy of dict fields: editing the dict a config was built from (or a dict
    override's default) leaves the frozen config as it was."""
    raw = {"task": {"kwargs": {"num_digits": 2}}}
    cfg = config_from_dict(raw)
    raw["task"]["kwargs"]["num_digits"] = 5
    assert cfg.task.kwargs == {"num_digits": 2}
    a = load_config(None, ["task.kwargs.num_digits=3"])
    assert load_config(None, []).task.kwargs == {} and a.task.kwargs == {"num_digits": 3}


def test_a_literal_error_echoes_the_override_text():
    """An override's value for a word field (Literal) is kept as its text, so the error shows
    what was typed, not YAML's reading of it."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.routing_replay=true"])
    assert str(e.value) == "train.routing_replay=true: expected one of 'off', 'r2', 'r3'"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dtype=1e3"])
    assert str(e.value).startswith("model.dtype=1e3: expected one of")


@pytest.mark.parametrize("key", ["model.aux_loss_coeff", "train.router_noise_std",
                                 "rollout.temperature"])
def test_nan_fails_every_range_check(key):
    """Guards `validate`'s comparisons (>= and >): NaN compares false, so it is refused, not
    let through by a negated comparison."""
    with pytest.raises(ConfigError, match=rf"^{key}=nan: must be >"):
        load_config(None, [f"{key}=.nan"])


def test_an_unsupported_annotation_is_a_schema_error():
    """A field typed as a union of two value types (no Literal words) has no defined coercion:
    a TypeError for the schema's author, not a silent pick of the first type."""
    from typing import Literal, Union

    from megatron_gspo.config.loader import _coerce

    with pytest.raises(TypeError, match="k: unsupported annotation"):
        _coerce(1, Union[int, str], "k")
    assert _coerce("force", Union[bool, Literal["force"]], "k") == "force"  # words + one type
    assert _coerce("off", Union[bool, Literal["force"]], "k") is False


def test_yaml_errors_point_at_the_problem(tmp_path):
    """Guards `load_yaml`'s location: 1-based line:column of the problem (not of its context,
    e.g. the bracket a list opened at), and a duplicate key names the line of its first use."""
    from megatron_gspo.config.loader import load_yaml

    path = os.path.join(tmp_path, "c.yaml")
    with open(path, "w") as f:
        f.write("seed: 1\nmodel:\n  preset: tiny\n  tp: 1\n  preset: small\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert str(e.value) == (f"{path}:5:3: invalid YAML: duplicate "
                            "key 'preset' (first at line 3)")
    with open(path, "w") as f:
        f.write("model:\n  preset: [tiny\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3:1: invalid YAML"):
        load_yaml(path)


def test_an_override_that_is_not_yaml_is_one_line():
    """An unquoted string holding ': ' (a template) is not a YAML value: one line (the CLI's
    rule) with the quoting that works."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=dataset", "data.train_files=a.jsonl",
                           "data.template=Question: {prompt}\\nAnswer:"])
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("data.template=Question: {prompt}\\nAnswer:: not a YAML value")
    assert str(e.value).endswith("""quote a string in double quotes, e.g. data.template='"..."'""")


def test_a_mapping_on_top_replaces_a_scalar_or_null_in_the_base():
    """Guards `deep_merge`: only mapping-on-mapping merges; a file section over a base's empty
    (null) or scalar value replaces it."""
    from megatron_gspo.config.loader import deep_merge

    base = {"wandb": None, "seed": 3, "task": {"name": "addition", "n_train": 10}}
    top = {"wandb": {"mode": "disabled"}, "seed": {"x": 1}, "task": {"n_train": 5}}
    assert deep_merge(base, top) == {"wandb": {"mode": "disabled"}, "seed": {"x": 1},
                                     "task": {"name": "addition", "n_train": 5}}


def test_an_empty_mapping_in_an_overlay_is_an_override_of_its_own():
    """Guards `mapping_to_overrides`: `kwargs: {}` sets the key to an empty mapping (it clears
    the base's kwargs) instead of vanishing; nested keys become dotted ones, strings stay
    text and other values JSON."""
    from megatron_gspo.config.loader import mapping_to_overrides

    overlay = {"task": {"kwargs": {}, "n_train": 5}, "loss": {"eps_high": None},
               "wandb.name": "2024", "data": {"train_files": ["a.jsonl"]}}
    out = mapping_to_overrides(overlay)
    assert out == ["task.kwargs={}", "task.n_train=5", "loss.eps_high=null", "wandb.name=2024",
                   'data.train_files=["a.jsonl"]']
    cfg = load_config(None, ["task.kwargs.num_digits=3", *out[:2]])
    assert cfg.task.kwargs == {} and cfg.task.n_train == 5


def test_an_empty_section_is_that_sections_defaults(tmp_path):
    """Guards `build` on null: `wandb:` with nothing under it (YAML null) is the section's
    defaults, not a 'expected a mapping' error."""
    from megatron_gspo.config.schema import RunConfig

    assert _load(tmp_path, "wandb:\ntrain:\nseed: 2\n") == RunConfig(seed=2)
    assert config_from_dict(None) == RunConfig()


def test_override_spaces_around_key_and_value_are_dropped():
    """Guards `_parse_override` / `_override_value` stripping: `train.steps = 5` and
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
    from megatron_gspo.config.schema import RunConfig
    from megatron_gspo.config.loader import apply_override

    raw = {}
    for item in ["task.kwargs.a.b=1", "task.kwargs.a.c=2", "task.kwargs.lr=3e-4",
                 "task.kwargs.mode=off"]:
        apply_override(RunConfig, raw, item)
    assert raw == {"task": {"kwargs": {"a": {"b": 1, "c": 2}, "lr": 3e-4, "mode": "off"}}}


def test_field_docs_and_defaults_as_declared():
    """Guards `field_docs` (a subclass's docstring of a re-declared field wins over its base's)
    and `describe_fields` (a default_factory's value is shown, not MISSING)."""
    import dataclasses

    from megatron_gspo.config.loader import describe_fields, field_docs

    @dataclasses.dataclass(frozen=True)
    class Base:
        x: int = 1
        """base doc"""
        y: list = dataclasses.field(default_factory=lambda: [1, 2])
        """a list"""

    @dataclasses.dataclass(frozen=True)
    class Sub(Base):
        x: int = 2
        """sub doc"""

    assert field_docs(Sub) == {"x": "sub doc", "y": "a list"}
    lines = []
    describe_fields(Sub, "s.", lines)
    assert lines == ["s.x: int = 2", "    sub doc", "s.y: list = [1, 2]", "    a list"]


@pytest.mark.parametrize("override", ["optim.lr=.inf", "optim.grad_clip=.inf", "sft.lr=.inf",
                                      "reward.timeout_s=.inf", "rollout.temperature=.inf",
                                      "optim.lr=-.inf"])
def test_an_infinite_float_is_refused_naming_it(override):
    """`optim.lr=.inf` loaded, ran, and recorded run.json before the NaN weights stopped it."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=-?inf: must be finite$"):
        load_config(None, [override])


def test_a_seed_too_large_for_the_derived_generator_seeds_is_refused():
    """seed=10**15 loaded, recorded run.json, then crashed at the first rollout batch's
    minibatch order (torch.Generator().manual_seed(seed * 1_000_003 + it): overflow)."""
    assert load_config(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^seed=1000000000000000: must be < 2\*\*32$"):
        load_config(None, ["seed=1000000000000000"])
