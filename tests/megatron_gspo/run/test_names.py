"""megatron_gspo.run.names: the names a config gives that a registry outside the config room
holds (task and its arguments, loss, reward, sampler) are checked at set-up, one line naming the
key; a config loads with any name, and a name registered before the check is valid."""

import pytest

from megatron_gspo.algo import losses
from megatron_gspo.config import parts
from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.names import check_names
from megatron_gspo.tasks import rewards

DATASET = ["task.name=dataset", "data.train_files=a.jsonl"]


@pytest.mark.parametrize("overrides, message", [
    (["loss.name=ppo"],
     "loss.name=ppo: unknown policy loss; valid: ['grpo', 'gspo', 'gspo_token']"),
    (["task.name=nope"], "task.name=nope: unknown task; valid: ['addition'"),
    (["task.kwargs.bogus=1"], "task.kwargs.bogus: unknown argument of task 'addition'; "
                              "valid: ['num_digits']"),
    ([*DATASET, "reward.name=mth"], "reward.name=mth: valid names: ['countdown', 'exact'"),
    (["rollout.backend=vlm"], "rollout.backend='vlm': no such backend; registered: ["),
])
def test_an_unregistered_name_is_one_config_error_naming_the_key(overrides, message):
    cfg = load_config(None, overrides)  # the config room cannot know the registries
    with pytest.raises(ConfigError) as e:
        check_names(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_registered_names_pass():
    check_names(load_config(None, []))
    check_names(load_config(None, ["task.name=countdown", "task.kwargs.num_numbers=3",
                                   "loss.name=grpo", "rollout.decoder=megatron"]))
    check_names(load_config(None, [*DATASET, "reward.name=exact"]))


def test_a_name_registered_before_the_check_is_valid(monkeypatch):
    """Registries are read when the check runs: a loss and a reward registered by user code
    (here a test) after the config room was imported are valid names."""
    monkeypatch.setattr(losses, "POLICY_LOSSES", dict(losses.POLICY_LOSSES))
    monkeypatch.setitem(parts.SETTINGS, "loss", dict(parts.SETTINGS["loss"]))
    monkeypatch.setattr(rewards, "REWARDS", dict(rewards.REWARDS))
    monkeypatch.setattr(rewards, "FORMAT_CHECKS", dict(rewards.FORMAT_CHECKS))
    cfg = load_config(None, [*DATASET, "loss.name=mine", "reward.name=mine"])
    with pytest.raises(ConfigError, match=r"^loss.name=mine: unknown policy loss"):
        check_names(cfg)
    losses.register_policy_loss("mine", eps=(0.1, 0.2))(losses.POLICY_LOSSES["gspo"])
    with pytest.raises(ConfigError, match=r"^reward.name=mine: valid names"):
        check_names(cfg)
    rewards.register_reward("mine", format_check=lambda text: True)(lambda text, truth: 1.0)
    check_names(cfg)
    assert losses.clip_range(cfg.loss) == (0.1, 0.2)


def test_a_loss_without_paper_defaults_needs_its_clip_range(monkeypatch):
    monkeypatch.setattr(losses, "POLICY_LOSSES", dict(losses.POLICY_LOSSES))
    monkeypatch.setitem(parts.SETTINGS, "loss", dict(parts.SETTINGS["loss"]))
    losses.register_policy_loss("bare")(losses.POLICY_LOSSES["gspo"])
    with pytest.raises(ConfigError) as e:
        check_names(load_config(None, ["loss.name=bare", "loss.eps_low=0.1"]))
    assert str(e.value) == "loss.eps_high: loss 'bare' has no default for it: set it"
    check_names(load_config(None, ["loss.name=bare", "loss.eps_low=0.1", "loss.eps_high=0.2"]))


def test_set_up_checks_the_names_before_anything_is_written(tmp_path):
    """`setup_runtime` runs the check first: a bad name leaves no run dir."""
    from megatron_gspo.jobs import rl
    from megatron_gspo.run.setup import setup_runtime

    cfg = load_config(None, [f"run_dir={tmp_path}/r", "loss.name=ppo"])
    with pytest.raises(ConfigError, match=r"^loss.name=ppo: unknown policy loss"):
        setup_runtime(cfg, rl.SPEC)
    assert not (tmp_path / "r").exists()
