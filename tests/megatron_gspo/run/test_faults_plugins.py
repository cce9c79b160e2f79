"""Plugins abused as an operator would: a plugin whose code changes between a run and its
resume, a resume without `--plugin`, a plugin that takes a built-in name, `plan` and `export`
of a run made with a plugin (megatron_gspo.run.plugins; docs/reliability.md)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from megatron_gspo import cli
from megatron_gspo.cli import main
from megatron_gspo.run.inputs import changed_inputs
from megatron_gspo.run.plugins import load_plugins, plugin_files
from moe.platform.checks import DuplicateName
from tests.megatron_gspo.run.test_faults import TINY, one_line_error
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


# ----------------------------------------------------------------------------- resumes

LOSS = ("from megatron_gspo.algo.losses import grpo_loss, register_policy_loss\n\n"
        "register_policy_loss('myloss', eps=(0.2, 0.27))(grpo_loss)\n")
RUN = [*TINY, "loss.name=myloss", "run_dir=run"]


def _forget(registries, module: str) -> None:
    """As in a new process: `module` not imported, the registries as before the test (the
    `registries` fixture's function)."""
    sys.modules.pop(module, None)
    registries()


def test_plugin_code_changed_since_the_run_started_is_refused_naming_the_file(
        registries, tmp_path, monkeypatch, capsys):
    """The loss edited between the run and its resume (here: it returns -loss): the same
    command exited 0 without a word. The run records its plugin files' contents, as it does
    its data files': a change is refused naming the file; resume=force continues, saying so."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p_loss.py").write_text(LOSS)
    assert main(["train", *RUN, "--plugin", "p_loss.py", "train.steps=1"]) == 0
    assert "plugin p_loss.py" in json.loads((tmp_path / "run" / "run.json").read_text())["inputs"]
    (tmp_path / "p_loss.py").write_text(LOSS.replace("(grpo_loss)", "(lambda *a, **k: (\n"
                                                     "    -grpo_loss(*a, **k)[0], {}))"))
    _forget(registries, "p_loss")
    capsys.readouterr()
    err = one_line_error(capsys, "train", *RUN, "--plugin", "p_loss.py", "train.steps=2")
    assert re.search(r"was started with other inputs: plugin p_loss.py \(sha256 \w+ -> \w+\) "
                     r"changed since; .*resume=force", err), err
    _forget(registries, "p_loss")
    assert main(["train", *RUN, "--plugin", "p_loss.py", "train.steps=2", "resume=force"]) == 0
    assert "continues with inputs other than it started with: plugin p_loss.py (sha256" \
        in capsys.readouterr().out


def test_a_package_plugin_is_fingerprinted_file_by_file_under_names_that_survive_a_move(
        registries, tmp_path, monkeypatch):
    """Every .py file of a package folder counts, named from the folder its module is found
    in, whichever way the entry names it; a record from before plugins were fingerprinted
    resumes without them."""
    package = tmp_path / "a" / "plugin_pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "helper.py", "sub/__init__.py", "sub/deep.py"):
        (package / name).write_text(f"# {name}\n")
    (package / "notes.txt").write_text("not code")
    names = ["plugin_pkg/__init__.py", "plugin_pkg/helper.py", "plugin_pkg/sub/__init__.py",
             "plugin_pkg/sub/deep.py"]
    assert sorted(plugin_files([str(package)])) == names
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    sys.modules.pop("plugin_pkg", None)
    assert list(plugin_files(["plugin_pkg.sub.deep"])) == ["plugin_pkg/sub/deep.py"]
    before = plugin_fingerprints([str(package)])
    (package / "sub" / "deep.py").write_text("# changed\n")
    after = plugin_fingerprints([str(package)])
    assert [c.split(" (")[0] for c in changed_inputs(before, after)] == \
        ["plugin plugin_pkg/sub/deep.py"]
    old = {k: v for k, v in before.items() if not k.startswith("plugin")}
    assert changed_inputs(old, after) == []  # recorded before plugin code was fingerprinted


def plugin_fingerprints(entries) -> dict:
    """The plugin part of `input_fingerprints` (the rest needs a tokenizer and splits)."""
    from types import SimpleNamespace

    from megatron_gspo.run.inputs import input_fingerprints

    cfg = SimpleNamespace(task=SimpleNamespace(name="toy"), plugins=entries)
    return {k: v for k, v in input_fingerprints(cfg, object(), [], []).items()
            if k.startswith("plugin")}


def test_a_resume_without_plugin_imports_the_ones_its_run_recorded(registries, tmp_path,
                                                                   monkeypatch, capsys):
    """The docs say a resume imports the run's plugins again: it failed with `unknown policy
    loss` instead. A recorded plugin that is gone is one line naming the record."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p_loss.py").write_text(LOSS)
    assert main(["train", *RUN, "--plugin", "p_loss.py", "train.steps=1"]) == 0
    _forget(registries, "p_loss")
    capsys.readouterr()
    assert main(["train", *RUN, "train.steps=2"]) == 0
    assert "resuming run_dir=run: importing the plugins it recorded: ['p_loss.py']" \
        in capsys.readouterr().out
    _forget(registries, "p_loss")
    os.rename(tmp_path / "p_loss.py", tmp_path / "moved.py")
    err = one_line_error(capsys, "train", *RUN, "train.steps=3")
    assert "plugins: 'p_loss.py': no such file or folder" in err
    assert "run_dir=run recorded it in train_config.yaml: pass --plugin with its place" in err


# ----------------------------------------------------------------------------- plan, export

BACKEND = ("from megatron_gspo.rollout.backends import sampler_factory\n"
           "from megatron_gspo.rollout.sampler import BACKENDS, register_sampler\n\n"
           "register_sampler('counting', caps=BACKENDS['lean'])(sampler_factory('lean'))\n")


def test_plan_imports_the_plugins_of_its_config_and_command_line(registries, tmp_path,
                                                                 monkeypatch, capsys):
    """A config naming a plugin backend could not be planned (`no such backend`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p_backend.py").write_text(BACKEND)
    (tmp_path / "exp.yaml").write_text("plugins: [p_backend.py]\nrollout: {backend: counting}\n")
    plan = ["plan", "--gpus", "1", "--gpu-mem-gib", "80"]
    assert main([*plan, "--config", "exp.yaml"]) == 0, capsys.readouterr().err
    assert "counting" in capsys.readouterr().out
    _forget(registries, "p_backend")
    assert main([*plan, "--plugin", "p_backend.py", "rollout.backend=counting"]) == 0


def test_export_imports_the_plugins_of_the_run(single_process, registries, tmp_path,
                                               monkeypatch, capsys):
    """A run made with docs/extending.md's Mixtral family could not be exported ("model_type=
    'mixtral' is not supported"), where the page says export needs nothing more."""
    from tests.megatron_gspo.hf_runs import run_config, save_run
    from tests.megatron_gspo.run.test_plugins import DOC, code_blocks, tiny_mixtral
    from tests.moe import hf_worker as hw
    from tests.moe.hf.test_hf import REAL_VOCAB

    folder = tiny_mixtral(tmp_path)
    (tmp_path / "my_plugin.py").write_text("\n\n".join(code_blocks(DOC.read_text(), "python")))
    monkeypatch.chdir(tmp_path)
    load_plugins(["my_plugin.py"])
    policy, _ = hw.build_from_hf(folder, REAL_VOCAB)
    save_run(policy, run_config(folder, "run", "plugins=[my_plugin.py]"), "run")
    _forget(registries, "my_plugin")  # a new process: only the run's config names the plugin
    assert main(["export", "--run-dir", "run", "--to-hf", "out"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"
