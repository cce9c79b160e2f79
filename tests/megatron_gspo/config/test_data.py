"""megatron_gspo.config.data: the data / reward / filter sections' defaults and range checks
(cross-section rules and their messages: tests/megatron_gspo/tasks/test_data.py::test_config_rules)."""

import pytest

from megatron_gspo.config.loader import build
from megatron_gspo.config.schema import DataConfig, FilterConfig, RewardConfig, load_config
from megatron_gspo.errors import ConfigError


DATASET = ["task.name=dataset", "data.train_files=a.jsonl"]


def test_defaults():
    data, reward, filt = DataConfig(), RewardConfig(), FilterConfig()
    assert (data.format, data.eval_fraction, data.shuffle, data.seed, data.max_eval) == \
        ("verl", 0.1, True, 1234, None)
    assert (reward.name, reward.timeout_s, reward.format_weight) == (None, 5.0, 0.0)
    assert (filt.overlong, filt.dynamic_sampling, filt.max_rounds) == (False, False, 4)


def test_one_file_is_a_list_of_one():
    data = build(DataConfig, {"train_files": "a.jsonl", "eval_files": "b.jsonl"})
    assert (data.train_files, data.eval_files) == (["a.jsonl"], ["b.jsonl"])


@pytest.mark.parametrize("override, fragment", [
    ("data.eval_fraction=1", "data.eval_fraction=1.0: must be in (0, 1)"),
    ("data.max_eval=0", "data.max_eval=0: must be >= 1"),
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
    cfg = load_config(None, [*DATASET, "data.eval_fraction=0.99", "data.max_eval=1",
                             "reward.format_weight=0", "reward.timeout_s=0",
                             "filter.max_rounds=1"])
    assert (cfg.data.eval_fraction, cfg.reward.format_weight, cfg.filter.max_rounds) == \
        (0.99, 0.0, 1)
    # dynamic sampling is refused only together with r3 replay
    assert load_config(None, ["filter.dynamic_sampling=true", "train.routing_replay=r2"])
    assert load_config(None, ["train.routing_replay=r3"])
