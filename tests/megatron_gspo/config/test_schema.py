"""megatron_gspo.config.schema: the run config end to end (files, the rules across sections,
round trips through a dict and the saved file) and the config room's imports."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_gspo.config.schema import (RunConfig, config_from_dict, config_to_dict,
                                         load_config, save_config)
from megatron_gspo.errors import ConfigError


ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def _write(tmp_path, text: str) -> str:
    path = os.path.join(tmp_path, "exp.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def test_yaml_file_and_demo_experiments_load(tmp_path):
    path = _write(tmp_path, """
        run_dir: runs/x
        task: {name: addition, kwargs: {num_digits: 3}, n_train: 10}
        loss: {eps_low: 3e-4, eps_high: 4.0e-4}
        train: {routing_replay: off, num_minibatches: 2}
        wandb:
          mode: disabled
        """)
    cfg = load_config(path)
    assert cfg.run_dir == "runs/x" and cfg.task.kwargs == {"num_digits": 3}
    assert cfg.loss.eps_low == 3e-4 and isinstance(cfg.loss.eps_low, float)
    assert cfg.loss.eps_high == 4e-4
    assert cfg.train.routing_replay == "off"  # YAML 1.1 would make unquoted off a bool
    assert cfg.task.n_train == 10 and cfg.task.n_test == 128  # unset keys keep defaults
    root = os.path.join(ROOT, "experiments", "demo")
    for name in ("sft.yaml", "gspo.yaml"):  # both exist; a missing one fails here
        assert load_config(os.path.join(root, name)).wandb.mode == "disabled"


def test_num_minibatches_must_divide_batch():
    # default batch = 8 prompts * 8 = 64
    with pytest.raises(ConfigError, match="num_minibatches=3 does not divide .* = 64"):
        load_config(None, ["train.num_minibatches=3"])
    with pytest.raises(ConfigError, match="= 30"):
        load_config(None, ["rollout.prompts_per_batch=5", "rollout.group_size=6",
                           "train.num_minibatches=4"])
    cfg = load_config(None, ["rollout.prompts_per_batch=5", "rollout.group_size=6",
                             "train.num_minibatches=6"])
    assert cfg.train.num_minibatches == 6


def test_tis_cap_with_the_samplers_logprobs_is_refused():
    """Guards RunConfig's tis_cap x use_sampler_logprobs rule: pi_old would be the sampler's,
    so every TIS weight would be 1."""
    with pytest.raises(ConfigError, match=r"^loss.tis_cap=2.0 weights by pi_old / pi_sampler"):
        load_config(None, ["loss.tis_cap=2", "rollout.use_sampler_logprobs=true"])
    assert load_config(None, ["loss.tis_cap=2"]).loss.tis_cap == 2.0
    assert load_config(None, ["rollout.use_sampler_logprobs=true"]).rollout.use_sampler_logprobs


def test_a_seed_too_large_for_the_derived_generator_seeds_is_refused():
    """seed=10**15 loaded, recorded run.json, then crashed at the first rollout batch's
    minibatch order (torch.Generator().manual_seed(seed * 1_000_003 + it): overflow)."""
    assert load_config(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1
    with pytest.raises(ConfigError, match=r"^seed=1000000000000000: must be < 2\*\*32$"):
        load_config(None, ["seed=1000000000000000"])


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().seed = 1


def test_dict_round_trip_and_strictness():
    cfg = load_config(None, ["task.kwargs.num_digits=3", "loss.eps_low=0.2", "wandb.name=x"])
    d = config_to_dict(cfg)
    assert d["loss"]["eps_low"] == 0.2 and d["task"]["kwargs"] == {"num_digits": 3}
    assert config_from_dict(d) == cfg
    d["optim"]["momentum"] = 0.9
    with pytest.raises(ConfigError, match="'optim.momentum'"):
        config_from_dict(d)


def test_save_load_round_trip(tmp_path):
    cfg = load_config(None, ["loss.eps_low=3e-4", "loss.eps_high=4e-4", "optim.lr=1e-10",
                             "train.routing_replay=off", "wandb.name=2024", "wandb.mode=disabled",
                             "task.kwargs.num_digits=2", "init_checkpoint=runs/sft",
                             "rollout.temperature=0.7"])
    path = os.path.join(tmp_path, "sub", "resolved.yaml")
    save_config(cfg, path)
    assert load_config(path) == cfg
    assert os.listdir(os.path.dirname(path)) == ["resolved.yaml"]  # no tmp file left
    save_config(RunConfig(), path)  # overwrite in place
    assert load_config(path) == RunConfig()


def test_saved_config_keeps_the_schema_order(tmp_path):
    """The resolved config file lists the keys in the schema's order (run_dir first, then the
    sections as declared), not alphabetically."""
    path = os.path.join(tmp_path, "resolved.yaml")
    save_config(RunConfig(), path)
    with open(path) as f:
        lines = f.read().splitlines()
    top = [ln.split(":")[0] for ln in lines if ln and not ln.startswith(("#", " ", "- "))]
    assert top == [f.name for f in dataclasses.fields(RunConfig)]
    model = [ln.split(":")[0].strip() for ln in lines[lines.index("model:") + 1:][:3]]
    assert model == ["preset", "tp", "ep"]


def test_the_saved_config_is_the_one_given(tmp_path):
    """What a run saves is what it was given: 'auto' and null stay (their meaning is derived
    at use), the loss's own settings are spelled out (its defaults: grpo's clip range), a `~`
    path is saved expanded (the path the run used), and loading the file gives the same
    config."""
    cfg = load_config(None, ["model.dispatcher=auto", "loss.name=grpo", "run_dir=~/r"])
    path = tmp_path / "train_config.yaml"
    save_config(cfg, str(path))
    text = path.read_text()
    assert "  dispatcher: auto\n" in text and "  eps_low: 0.2\n" in text
    assert f"run_dir: {os.path.expanduser('~/r')}\n" in text
    assert load_config(str(path)) == cfg and config_to_dict(load_config(str(path))) == \
        config_to_dict(cfg)


def test_the_config_room_imports_no_higher_room():
    """config < algo < tasks < rollout < run < jobs < cli: loading a config imports only the
    config room and the top-level helpers (in a fresh interpreter)."""
    code = ("import sys; import megatron_gspo.config.schema as s; s.load_config(None); "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_gspo')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    rooms = {m.split(".")[1] for m in eval(out) if m.count(".")}
    assert rooms <= {"config", "errors", "dist", "files"}, rooms
