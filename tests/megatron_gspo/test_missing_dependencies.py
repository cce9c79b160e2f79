"""A missing optional package fails as `MissingDependency` (an ImportError) naming the install
command, which the CLI prints as one line with exit status 2 (`test_cli.py`)."""

import sys

import pytest

import megatron_gspo.tasks.rewards as rewards_mod
from megatron_gspo.tasks.datasets import read_rows
from megatron_gspo.run.metrics import MetricsLogger
from megatron_gspo.tasks.tokenizer import HFTokenizer
from moe.platform.checks import MissingDependency


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MissingDependency, match="pip install pyarrow"):
        list(read_rows(str(path)))


def test_math_reward_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    rewards_mod._math_verify.cache_clear()
    try:
        with pytest.raises(MissingDependency, match=r"pip install -e \.\[math\]"):
            rewards_mod.check_math_available()
    finally:
        rewards_mod._math_verify.cache_clear()


def test_wandb_mode_without_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingDependency, match=r"pip install -e \.\[wandb\]"):
        MetricsLogger(str(tmp_path), wandb_mode="offline")


def test_tokenizer_folder_without_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependency, match=r"pip install -e '\.\[hf\]'"):
        HFTokenizer(str(tmp_path))
