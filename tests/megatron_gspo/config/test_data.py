"""megatron_gspo.config.data: the data / reward / filter sections' defaults and range checks
(cross-section rules and their messages: tests/megatron_gspo/tasks/test_data.py::test_config_rules)."""

import pytest

from megatron_gspo.config.loader import build
from megatron_gspo.config.schema import DataConfig, FilterConfig, RewardConfig, load_config
from megatron_gspo.errors import ConfigError


DATASET = ["task.name=dataset", "data.train_files=a.jsonl"]


def test_defaults():
    data, reward, filt = DataConfig(), RewardConfig(), FilterConfig()
    assert (data.format, data.test_fraction, data.shuffle, data.seed, data.max_test) == \
        ("verl", 0.1, True, 1234, None)
    assert (reward.name, reward.timeout_s, reward.format_weight) == (None, 5.0, 0.0)
    assert (filt.overlong, filt.dynamic_sampling, filt.max_rounds) == (False, False, 4)


def test_one_file_is_a_list_of_one():
    data = build(DataConfig, {"train_files": "a.jsonl", "test_files": "b.jsonl"})
    assert (data.train_files, data.test_files) == (["a.jsonl"], ["b.jsonl"])


def test_the_test_splits_older_names_still_load(tmp_path):
    """task.n_eval, data.eval_files / eval_fraction / max_eval (a config or a saved
    `*_config.yaml` from before the validation split) load as n_test / test_*; an override
    under either name replaces the file's value under the other; one key given twice in one
    mapping, under both names, is refused naming both."""
    old = tmp_path / "old.yaml"
    old.write_text("task: {name: dataset, n_eval: 64}\ndata: {train_files: a.jsonl, "
                   "eval_files: b.jsonl, eval_fraction: 0.3, max_eval: 9}\n")
    cfg = load_config(str(old))
    assert (cfg.task.n_test, cfg.data.test_files, cfg.data.test_fraction, cfg.data.max_test) == \
        (64, ["b.jsonl"], 0.3, 9)
    assert load_config(str(old), ["task.n_test=8"]).task.n_test == 8
    assert load_config(str(old), ["data.max_test=3", "data.max_eval=4"]).data.max_test == 4
    new = tmp_path / "new.yaml"
    new.write_text("task: {n_test: 32}\n")
    assert load_config(str(new), ["task.n_eval=16"]).task.n_test == 16
    both = tmp_path / "both.yaml"
    both.write_text("task: {n_eval: 64, n_test: 32}\n")
    with pytest.raises(ConfigError, match=r"task.n_eval and task.n_test are one key \(task.n_eval"
                                          r" is its older name\): give it once, as task.n_test"):
        load_config(str(both))


@pytest.mark.parametrize("override, fragment", [
    ("data.val_fraction=1", "data.val_fraction=1.0: must be in [0, 1)"),
    ("data.val_fraction=0.95", "data.val_fraction=0.95: and data.test_fraction=0.1 leave no "
                               "training rows"),
    ("data.test_fraction=1", "data.test_fraction=1.0: must be in (0, 1)"),
    ("data.max_test=0", "data.max_test=0: must be >= 1"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens=0: must be >= 1"),
    ("data.prompt_key=''", "data.prompt_key=: must be non-empty"),
    ("data.tokenizer_path=''", "data.tokenizer_path=: must be non-empty"),
    ("reward.format_weight=-0.1", "reward.format_weight=-0.1: must be in [0, 1)"),
    ("reward.timeout_s=-1", "reward.timeout_s=-1.0: must be >= 0"),
])
def test_out_of_range_values_are_refused_naming_them(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DATASET, override])
    assert fragment in str(e.value)


def test_edges_that_are_allowed():
    cfg = load_config(None, [*DATASET, "data.test_fraction=0.99", "data.max_test=1",
                             "reward.format_weight=0", "reward.timeout_s=0",
                             "filter.max_rounds=1"])
    assert (cfg.data.test_fraction, cfg.reward.format_weight, cfg.filter.max_rounds) == \
        (0.99, 0.0, 1)
    # dynamic sampling is refused only together with r3 replay
    assert load_config(None, ["filter.dynamic_sampling=true", "train.routing_replay=r2"])
    assert load_config(None, ["train.routing_replay=r3"])
