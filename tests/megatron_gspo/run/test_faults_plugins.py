"""Plugins abused as an operator would: a plugin whose code changes between a run and its
resume, a resume without `--plugin`, a plugin that takes a built-in name, `plan` and `export`
of a run made with a plugin (megatron_gspo.run.plugins; docs/reliability.md)."""

from __future__ import annotations

import json
import re

import pytest

from megatron_gspo import cli
from megatron_gspo.run.plugins import load_plugins
from moe.platform.checks import DuplicateName
from tests.megatron_gspo.run.test_faults import TINY
from tests.megatron_gspo.run.test_plugins import registries  # noqa: F401 (a fixture)

HEADER = {
    "policy loss": "from megatron_gspo.algo.losses import register_policy_loss as register\n",
    "reward": "from megatron_gspo.tasks.rewards import register_reward\n",
    "task": "from megatron_gspo.tasks.toy import register_task\n",
    "sampler backend": "from megatron_gspo.rollout.sampler import register_sampler\n",
    "Hugging Face family": "from moe.hf.families import HFFamily, register_hf_family\n",
}
TAKEN = {  # a second definition of a built-in name, its line in the plugin
    "policy loss": ("grpo", r"megatron_gspo\.algo\.losses\.grpo_loss \(.*losses\.py:\d+\)",
                    "@register('grpo')\ndef mine(*args, **kwargs):\n    pass\n"),
    "reward": ("exact", r"megatron_gspo\.tasks\.rewards\.exact_reward \(.*rewards\.py:\d+\)",
               "@register_reward('exact', format_check=bool)\ndef mine(completion, truth):\n"
               "    return 1.0\n"),
    "task": ("addition", r"megatron_gspo\.tasks\.toy\.Addition \(.*toy\.py:\d+\)",
             "@register_task\nclass mine:\n    name = 'addition'\n"),
    "sampler backend": ("lean", r"megatron_gspo\.rollout\.decoders:lean_sampler",
                        "@register_sampler('lean')\ndef mine(policy, tokenizer, cfg):\n"
                        "    pass\n"),
    "Hugging Face family": ("qwen3_moe", r"moe\.hf\.families\.\S+ \(.*families\.py:\d+\)",
                            "def mine(cfg, where):\n    return {}\n\n\nregister_hf_family("
                            "HFFamily('qwen3_moe', 'X', read=mine, write=dict))\n"),
}


@pytest.mark.parametrize("kind", sorted(TAKEN))
def test_every_registry_refuses_a_taken_name_naming_both_definitions(registries, tmp_path,
                                                                     monkeypatch, kind):
    """`register_sampler("lean")` in a plugin made every run sample with it (exit 0), and a
    second Hugging Face family replaced the first; losses, rewards and tasks refused without
    saying where either definition is. Each registry names both now."""
    name, first, code = TAKEN[kind]
    (tmp_path / "taker.py").write_text(HEADER[kind] + "\n\n" + code)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DuplicateName) as refused:
        load_plugins(["taker.py"])
    assert re.fullmatch(rf"{kind} '{name}' is already registered by {first}; taker\.mine "
                        rf"\(taker\.py:4\) registers it again: give it another name",
                        str(refused.value)), str(refused.value)


def test_a_plugin_replacing_a_built_in_backend_is_one_line(registries, tmp_path, monkeypatch,
                                                          capsys):
    (tmp_path / "taker.py").write_text(HEADER["sampler backend"] + "\n\n"
                                       + TAKEN["sampler backend"][2])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "run", lambda command, cfg: pytest.fail("ran"))
    assert cli.main(["train", "--plugin", "taker.py", "run_dir=run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-gspo: error: sampler backend 'lean' is already registered "
                          "by megatron_gspo.rollout.decoders:lean_sampler; taker.mine "
                          "(taker.py:4) registers it again") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
