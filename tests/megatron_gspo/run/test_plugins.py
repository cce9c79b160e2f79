"""megatron_gspo.run.plugins: user code registers a loss, reward, task and sampler without an
edit of the project, and docs/extending.md's code is that plugin, run as written."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megatron_gspo import cli
from megatron_gspo.algo import losses
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout import backends, sampler  # noqa: F401 (the built-ins registered)
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.run.plugins import load_plugins
from megatron_gspo.tasks import rewards, toy

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "extending.md"
TINY = ["model.preset=tiny", "rollout.prompts_per_batch=4", "rollout.group_size=2",
        "rollout.max_new_tokens=3", "train.num_minibatches=2", "train.steps=1",
        "train.eval_every=1", "train.save_every=0", "wandb.mode=disabled"]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `language` in a markdown text, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.fixture
def registries():
    """The registries as they were before the test: a plugin's entries leave with it, and its
    module is imported afresh by the next test."""
    kept = [(d, dict(d)) for d in (losses.POLICY_LOSSES, losses._PAPER_EPS, rewards.REWARDS,
                                   rewards.FORMAT_CHECKS, toy.TASKS, sampler.SAMPLERS)]
    modules = set(sys.modules)
    yield
    for registry, before in kept:
        registry.clear()
        registry.update(before)
    for name in set(sys.modules) - modules:
        if name == "my_plugin" or name.startswith("plugin_pkg"):
            del sys.modules[name]


def test_the_plugin_of_docs_extending_md_trains_an_rl_iteration(single_process, registries,
                                                                tmp_path, monkeypatch, capsys):
    """The page's Python blocks, as one file, register a loss, a reward, a task and a sampler;
    its YAML block names them and the file as the plugin; `megatron-gspo train` on it runs one
    RL iteration with all four (the IS mask on, so the loss is called with keep_BT). A plugin
    the page describes wrongly (a signature without keep_BT, a stale import) fails here."""
    text = DOC.read_text()
    (tmp_path / "my_plugin.py").write_text("\n\n".join(code_blocks(text, "python")))
    yaml_block, = code_blocks(text, "yaml")
    (tmp_path / "exp.yaml").write_text(yaml_block)
    monkeypatch.chdir(tmp_path)  # the plugin path is relative to the working directory
    plugin, = load_plugins(["my_plugin.py"])  # what the run imports; the sampler spied on
    built = []
    factory = sampler.SAMPLERS["counting_lean"]
    monkeypatch.setitem(sampler.SAMPLERS, "counting_lean",
                        lambda *a: built.append(factory(*a)) or built[-1])
    calls = []
    loss = losses.POLICY_LOSSES["gspo_soft_negatives"]
    monkeypatch.setitem(losses.POLICY_LOSSES, "gspo_soft_negatives",
                        lambda *a, **kw: calls.append(sorted(kw)) or loss(*a, **kw))

    assert cli.main(["train", "--config", "exp.yaml", *TINY, "loss.is_mask_token=[0.5,2.0]",
                     "run_dir=run"]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert (record["task.name"], record["loss.name"], record["rollout.backend"]) == \
        ("double", "gspo_soft_negatives", "counting_lean")
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r.get("train/minibatch") for r in rows] == [None, 0, 1]
    assert isinstance(built[0], plugin.CountingSampler) and built[0].response_tokens > 0
    assert calls and all("keep_BT" in kw for kw in calls)
    assert "eval/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plugin.near("25", "24") == 0.5 and rewards.get_reward("near") is plugin.near


def test_the_cli_option_adds_a_plugin_that_the_saved_config_keeps(registries, tmp_path,
                                                                  monkeypatch):
    """`--plugin` adds to the config's list (a module name here, a package folder there) before
    the names are checked; the run's config holds both, so a resume imports them again."""
    package = tmp_path / "plugin_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from megatron_gspo.algo.losses import register_policy_loss\n"
        "from plugin_pkg.helper import plain_gspo\n"
        "register_policy_loss('plain_gspo', eps=(0.1, 0.2))(plain_gspo)\n")
    (package / "helper.py").write_text("from megatron_gspo.algo.losses import gspo_loss as "
                                       "plain_gspo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    monkeypatch.setattr(cli, "run", lambda command, cfg: seen.append(cfg) or {})
    assert cli.main(["train", f"plugins=[{package}]", "--plugin", "plugin_pkg.helper",
                     "loss.name=plain_gspo"]) == 0
    assert seen[0].plugins == [str(package), "plugin_pkg.helper"]
    assert losses.get_policy_loss("plain_gspo") is losses.gspo_loss


@pytest.mark.parametrize("entry, says", [
    ("no_such_plugin_module", "'no_such_plugin_module': no such module (a module name "),
    ("plugins/missing.py", "'plugins/missing.py': no such file or folder"),
    ("json.py", "'json.py': its module name 'json' is already taken by "),
])
def test_a_bad_plugin_is_one_line_and_exit_2(registries, tmp_path, monkeypatch, capsys, entry,
                                             says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "json.py").write_text("")
    monkeypatch.setattr(cli, "run", lambda command, cfg: pytest.fail("ran"))
    assert cli.main(["train", "--plugin", entry, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-gspo: error: plugins: {says}") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_a_plugin_missing_its_own_dependency_names_it(registries, tmp_path, monkeypatch):
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_here\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="^plugins: 'needs_more.py' imports "
                                          "'no_such_dependency_here', which is not installed$"):
        load_plugins(["needs_more.py"])
    assert "needs_more" not in sys.modules
