"""megatron_gspo.run.plugins: user code registers a loss, reward, task, sampler and instrument
without an edit of the project, and docs/extending.md's code is that plugin, run as written."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo import cli
from megatron_gspo.algo import losses
from megatron_gspo.config import parts
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs import instruments
from megatron_gspo.rollout import backends, sampler  # noqa: F401 (the built-ins registered)
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.run.plugins import load_plugins
from megatron_gspo.tasks import rewards, toy
from moe.hf.families import HF_FAMILIES

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "extending.md"
TINY = ["model.preset=tiny", "rollout.prompts_per_batch=4", "rollout.group_size=2",
        "rollout.max_new_tokens=3", "train.num_minibatches=2", "train.steps=1",
        "train.eval_every=1", "train.save_every=0", "wandb.mode=disabled"]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `language` in a markdown text, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


@pytest.fixture
def registries(tmp_path_factory):
    """The registries as they were before the test: a plugin's entries leave with it, and its
    modules (those imported from a test's folder) are imported afresh by the next test. Yields
    the function that puts the registries back (a test's "new process")."""
    kept = [(d, dict(d)) for d in (losses.POLICY_LOSSES, *parts.SETTINGS.values(),
                                   parts.SETTINGS, rewards.REWARDS, rewards.FORMAT_CHECKS,
                                   rewards.GROUND_TRUTHS, toy.TASKS, sampler.SAMPLERS,
                                   sampler.BACKENDS, HF_FAMILIES, instruments.INSTRUMENTS)]
    modules, tests = set(sys.modules), str(tmp_path_factory.getbasetemp())

    def restore():
        for registry, before in kept:
            registry.clear()
            registry.update(before)

    yield restore
    restore()
    for name in set(sys.modules) - modules:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(tests):
            del sys.modules[name]


def test_the_plugin_of_docs_extending_md_trains_an_rl_iteration(single_process, registries,
                                                                tmp_path, monkeypatch, capsys):
    """The page's Python blocks, as one file, register a loss, a reward, a task, a sampler and
    an instrument; its YAML block names them and the file as the plugin; `megatron-gspo train`
    on it runs one RL iteration with all five (the IS mask on, so the loss is called with
    keep_BT), the loss and the backend with their own settings as the YAML gives them, and
    only the instruments it lists. A plugin the page describes wrongly (a signature without
    keep_BT, a stale import) fails here."""
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
                        lambda *a, **kw: calls.append((sorted(kw), a[4])) or loss(*a, **kw))

    assert cli.main(["train", "--config", "exp.yaml", *TINY, "loss.is_mask_token=[0.5,2.0]",
                     "run_dir=run"]) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert (record["task.name"], record["loss.name"], record["rollout.backend"]) == \
        ("double", "gspo_soft_negatives", "counting_lean")
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r.get("train/minibatch") for r in rows] == [None, 0, 1]
    assert 0 <= rows[2]["signal/zero_adv_frac"] <= 1 and "signal/zero_adv_frac" not in rows[1]
    assert [r["eval/best_accuracy"] for r in rows if "eval/accuracy" in r] == \
        [max(r["eval/accuracy"] for r in rows[:i + 1] if "eval/accuracy" in r)
         for i, r in enumerate(rows) if "eval/accuracy" in r]
    assert "moe/flip_rate/mean" in rows[1] and "moe/expert_load/layer_00/cv" in rows[2]
    assert not any(k.startswith(("perf/", "alert/", "policy/routing_log_ratio"))
                   for r in rows for k in r)
    assert isinstance(built[0], plugin.CountingSampler) and built[0].tokens > 0
    assert built[0].count_prompts is True  # rollout.counting_lean.count_prompts, as given
    assert calls and all("keep_BT" in kw for kw, _ in calls)
    assert {cfg.negative_scale for _, cfg in calls} == {0.25}  # loss.negative_scale
    saved = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert (saved["loss.negative_scale"], saved["loss.eps_low"]) == (0.25, 3e-4)
    assert "eval/accuracy" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plugin.near("25", "24") == 0.5 and rewards.get_reward("near") is plugin.near


def _docs_plugin(tmp_path, monkeypatch):
    """The page's plugin and experiment written into `tmp_path`, the working directory."""
    text = DOC.read_text()
    (tmp_path / "my_plugin.py").write_text("\n\n".join(code_blocks(text, "python")))
    (tmp_path / "exp.yaml").write_text(code_blocks(text, "yaml")[0])
    monkeypatch.chdir(tmp_path)


def test_config_lists_the_settings_of_a_plugins_loss_and_backend(registries, tmp_path,
                                                               monkeypatch, capsys):
    """`megatron-gspo config --plugin my_plugin.py` lists the page's loss's own setting and its
    backend's section, with defaults, docstrings and what a resume may change."""
    _docs_plugin(tmp_path, monkeypatch)
    assert cli.main(["config", "--plugin", "my_plugin.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    loss = lines.index("loss.negative_scale: float = 0.5")
    assert lines[loss + 1].strip().startswith("Factor of the negative advantages")
    assert "loss.eps_low: float = 0.0003" in lines[loss - 8:loss]  # its clip range, first
    assert "rollout.counting_lean.count_prompts: bool = False  (a resume may change it)" in lines
    assert any(ln.startswith("[loss, loss.name=gspo_soft_negatives] the loss's own settings: "
                             "gspo_soft_negatives' own settings") for ln in lines)


def test_a_plugins_settings_are_read_strictly_and_compared_on_resume(single_process, registries,
                                                                     tmp_path, monkeypatch,
                                                                     capsys):
    """The page's plugin trains; a resume may change the backend's setting marked may_change
    (count_prompts) and not the loss's own (negative_scale: refused naming it, one line, exit
    2); a key neither part declares is one line and exit 2 before anything is written."""
    _docs_plugin(tmp_path, monkeypatch)
    run = ["train", "--config", "exp.yaml", *TINY, "run_dir=run"]
    assert cli.main(run) == 0
    assert cli.main([*run, "train.steps=2", "rollout.counting_lean.count_prompts=false"]) == 0
    assert [r.get("train/minibatch") for r in read_jsonl("run/metrics.jsonl")] == \
        [None, 0, 1, 0, 1]  # the second iteration, resumed
    capsys.readouterr()
    assert cli.main([*run, "train.steps=3", "loss.negative_scale=0.75"]) == 2
    err = capsys.readouterr().err
    assert "(loss.negative_scale: 0.25 -> 0.75)" in err and err.count("\n") == 1
    for key, says in (("loss.negative_scal=0.3", "unknown config key 'loss.negative_scal'; "),
                      ("rollout.counting_lean.count=1", "unknown config key "
                                                        "'rollout.counting_lean.count'; "),
                      ("loss.negative_scale=2", "loss.negative_scale=2.0: must be in [0, 1]")):
        assert cli.main([*run, "run_dir=other", key]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"megatron-gspo: error: {says}") and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


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


def tiny_mixtral(tmp_path) -> str:
    """A tiny random Mixtral saved by transformers (wide weights: decisive routing); its
    folder."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.moe.hf.test_hf import REAL_VOCAB

    config = MixtralConfig(vocab_size=REAL_VOCAB, hidden_size=48, intermediate_size=40,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=6, num_experts_per_tok=2, rope_theta=1e4,
                           max_position_embeddings=64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    model.save_pretrained(str(tmp_path / "mixtral"))
    return str(tmp_path / "mixtral")


def test_the_hf_family_of_docs_extending_md_reads_and_exports_mixtral(single_process,
                                                                     registries, tmp_path,
                                                                     monkeypatch):
    """The page's plugin registers a Mixtral family: a tiny random Mixtral saved by transformers
    loads into the policy with its logits (float32, to 1e-4), and exports back to exactly its
    tensors and a config.json that reads as the same preset. Without the family the folder is
    refused naming its model_type."""
    from moe.hf.config import hf_config_dict, preset_from_hf, read_hf_config
    from tests.moe import hf_worker as hw
    from tests.moe.hf.test_hf import REAL_VOCAB, batch, hf_logits

    folder = tiny_mixtral(tmp_path)
    with pytest.raises(ValueError, match="model_type='mixtral' is not supported"):
        preset_from_hf(folder)

    (tmp_path / "my_plugin.py").write_text("\n\n".join(code_blocks(DOC.read_text(), "python")))
    monkeypatch.chdir(tmp_path)
    load_plugins(["my_plugin.py"])
    tokens_BT, valid_BT = batch()
    policy, _ = hw.build_from_hf(folder, REAL_VOCAB)
    assert (policy.preset.num_experts, policy.preset.moe_ffn_hidden_size) == (6, 40)
    with torch.no_grad():
        ours = policy.logits(tokens_BT, valid_BT)
    assert hw.logit_diff(ours, hf_logits(folder, tokens_BT, valid_BT), valid_BT,
                         REAL_VOCAB) <= hw.TOL
    hw.export_matches_source(policy, folder)
    written = hf_config_dict(policy.preset, REAL_VOCAB, base=read_hf_config(folder))
    assert written["architectures"] == ["MixtralForCausalLM"]
    assert (written["num_local_experts"], written["intermediate_size"]) == (6, 40)
    assert "mixtral" in HF_FAMILIES  # the fixture takes it out again
