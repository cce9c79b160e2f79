"""megatron_gspo.config.fields: reading a value into its field's type (what a YAML file, a dict or
an override may hold) and the checks every section runs, which never change a value."""

import dataclasses
import os
import textwrap

import pytest

from megatron_gspo.config.loader import build
from megatron_gspo.config.schema import (DataConfig, LossConfig, ModelConfig, RunConfig,
                                         TrainConfig, config_from_dict, load_config)
from megatron_gspo.errors import ConfigError


DATASET = ["task.name=dataset", "data.train_files=a.jsonl"]


def _load(tmp_path, text: str):
    path = os.path.join(tmp_path, "exp.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return load_config(path)


def test_an_int_field_takes_a_quoted_integer_but_not_a_quoted_fraction(tmp_path):
    """Guards `fields._to_int` on strings: "7" is 7, "2.5" is refused (not truncated to 2)."""
    assert _load(tmp_path, 'train: {steps: "7"}\n').train.steps == 7
    with pytest.raises(ConfigError, match=r"^train.steps=2.5: expected int$"):
        _load(tmp_path, 'train: {steps: "2.5"}\n')
    with pytest.raises(ConfigError, match=r"^train.steps=1e3: expected int$"):
        _load(tmp_path, 'train: {steps: "1e3"}\n')


def test_one_and_zero_are_booleans_only_as_text():
    """Guards the "1" / "0" words of `fields._to_bool`: `resume=1` (text: resume also takes the word
    'force') is true, `resume=0` false; a bool-only field refuses the number 1 (no
    truthiness)."""
    assert load_config(None, ["resume=1"]).resume is True
    assert load_config(None, ["resume=0"]).resume is False
    assert load_config(None, ["resume=on"]).resume is True
    assert config_from_dict({"rollout": {"decoders": {"kv_cache": "0"}}}).rollout.decoders \
        .kv_cache is False
    with pytest.raises(ConfigError, match=r"^rollout.decoders.kv_cache=1: expected bool$"):
        load_config(None, ["rollout.decoders.kv_cache=1"])


@pytest.mark.parametrize("text, flag", [("true", True), ("false", False), ("True", True),
                                        ("yes", True), ("off", False)])
def test_bool_parsing(text, flag):
    assert load_config(None, [f"resume={text}"]).resume is flag
    assert load_config(None, [f"rollout.use_sampler_logprobs={text}"]) \
        .rollout.use_sampler_logprobs is flag


def test_a_list_field_refuses_a_mapping():
    """Guards `fields._to_list`: a mapping is no list (its keys would silently become the files)."""
    with pytest.raises(ConfigError, match=r"^data.train_files=\{'a.jsonl': 1\}: expected list$"):
        config_from_dict({"task": {"name": "dataset"}, "data": {"train_files": {"a.jsonl": 1}}})


def test_wrong_type_in_a_file_names_the_key(tmp_path):
    """A str field given a YAML number or list in a file is refused, not stored as is (an
    override's text stays a string; a file's value keeps its YAML type)."""
    for text, fragment in [("wandb: {project: 5}\n", "wandb.project=5: expected str"),
                           ("run_dir: [a, b]\n", "run_dir=['a', 'b']: expected str")]:
        with pytest.raises(ConfigError) as e:
            _load(tmp_path, text)
        assert str(e.value) == fragment


def test_float_coercion_from_yaml11_string():
    # plain yaml.safe_load reads 3e-4 as the string '3e-4'; the config still takes it
    assert config_from_dict({"loss": {"eps_low": "3e-4"}}).loss.eps_low == 3e-4
    assert build(LossConfig, {"kl_coef": 1}).kl_coef == 1.0
    assert type(build(LossConfig, {"kl_coef": 1}).kl_coef) is float  # read as the field's type
    assert LossConfig(kl_coef=1).kl_coef == 1  # in Python an int is a float value, kept as given


def test_an_unsupported_annotation_is_a_schema_error():
    """A field typed as a union of two value types (no Literal words) has no defined coercion:
    a TypeError for the schema's author, not a silent pick of the first type."""
    from typing import Literal, Union

    from megatron_gspo.config.fields import coerce

    with pytest.raises(TypeError, match="k: unsupported annotation"):
        coerce(1, Union[int, str], "k")
    assert coerce("force", Union[bool, Literal["force"]], "k") == "force"  # words + one type
    assert coerce("off", Union[bool, Literal["force"]], "k") is False


@pytest.mark.parametrize("key", ["model.aux_loss_coeff", "train.router_noise_std",
                                 "rollout.temperature"])
def test_nan_fails_every_range_check(key):
    """Guards `validate`'s comparisons (>= and >): NaN compares false, so it is refused, not
    let through by a negated comparison."""
    with pytest.raises(ConfigError, match=rf"^{key}=nan: must be >"):
        load_config(None, [f"{key}=.nan"])


@pytest.mark.parametrize("override", ["optim.lr=.inf", "optim.grad_clip=.inf", "sft.lr=.inf",
                                      "reward.timeout_s=.inf", "rollout.temperature=.inf",
                                      "optim.lr=-.inf"])
def test_an_infinite_float_is_refused_naming_it(override):
    """`optim.lr=.inf` loaded, ran, and recorded run.json before the NaN weights stopped it."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key}=-?inf: must be finite$"):
        load_config(None, [override])


def test_a_tilde_in_a_path_is_the_home_directory():
    """The shell leaves `model.hf_path=~/m` alone (and `~/m` in YAML is that string): it was
    'model folder ~/m does not exist'."""
    home = os.path.expanduser("~")
    cfg = load_config(None, ["model.hf_path=~/m", "run_dir=~/r", "init_checkpoint=~/c",
                             *DATASET, "data.tokenizer_path=~/t", "data.test_files=[~/e.jsonl]"])
    assert (cfg.model.hf_path, cfg.run_dir, cfg.init_checkpoint, cfg.data.tokenizer_path,
            cfg.data.test_files) == (f"{home}/m", f"{home}/r", f"{home}/c", f"{home}/t",
                                     [f"{home}/e.jsonl"])


def test_a_section_built_in_python_holds_what_it_was_given_or_refuses_it():
    """`__post_init__` only checks: nothing is resolved, expanded or converted into a field
    (the saved config is the one given); a value of the wrong type is a ConfigError naming the
    key, as the loader's reading of it would be."""
    assert ModelConfig(ep=2).dispatcher == "auto"
    assert LossConfig(name="grpo").settings is None  # the loss's defaults, derived at use
    assert RunConfig(run_dir="~/r").run_dir == "~/r"  # the loader expands `~`, not the section
    for make, message in [
            (lambda: TrainConfig(steps="5"), "train.steps=5: expected int"),
            (lambda: TrainConfig(steps=True), "train.steps=True: expected int"),
            (lambda: TrainConfig(routing_replay="r9"),
             "train.routing_replay=r9: expected one of 'off', 'r2', 'r3'"),
            (lambda: TrainConfig(start_accuracy=(0.2, 0.4)),
             "train.start_accuracy=(0.2, 0.4): expected list | null"),
            (lambda: DataConfig(train_files="a.jsonl"), "data.train_files=a.jsonl: expected list"),
            (lambda: RunConfig(model={"tp": 2}), "model={'tp': 2}: expected ModelConfig")]:
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == message


def test_no_section_writes_into_its_frozen_fields():
    """The config room never sets a frozen field after construction (`object.__setattr__`):
    derived values are properties, reading and normalising happens before construction."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "megatron_gspo", "config")
    for name in os.listdir(root):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                assert "__setattr__" not in f.read(), name


def test_a_band_is_read_as_two_floats_and_checked_as_two_numbers():
    """Guards `fields.band_values` (the loader's reading: numbers and numeric text become
    floats, anything else stays for the check to name) and `fields.check_band`."""
    assert build(TrainConfig, {"start_accuracy": [0, "0.5"]}).start_accuracy == [0.0, 0.5]
    assert TrainConfig(start_accuracy=[0, 1]).start_accuracy == [0, 1]  # ints are accuracies
    with pytest.raises(ConfigError, match=r"^train.start_accuracy=\[False, 0.4\]: expected"):
        build(TrainConfig, {"start_accuracy": [False, 0.4]})
