"""The config's names that a registry outside the config room holds: the task and its keyword
arguments (`megatron_gspo.tasks.toy`), the reward (`tasks.rewards`), the policy loss and its clip
range (`algo.losses`), the sampler (`rollout.backends`).

The config room may not import these rooms, so a loaded config holds any name; `check_names`
checks them all, once, at the start of set-up (`megatron_gspo.run.setup.setup_runtime`) and in
the CLI before anything is written. It first imports the config's `plugins`
(`megatron_gspo.run.plugins`): a name registered by user code before the check (a plugin, a
test, a notebook) is valid like a built-in one, as the registries are read when it runs.
"""

from __future__ import annotations

from megatron_gspo.algo import losses
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.backends import check_backend
from megatron_gspo.run.plugins import load_plugins
from megatron_gspo.tasks import rewards
from megatron_gspo.tasks.toy import TASKS, task_kwarg_names


def check_names(cfg) -> None:
    """ConfigError naming the key (one line) unless task.name, task.kwargs, loss.name (with a
    clip range: given, or the loss's paper default), reward.name and the sampler
    (rollout.backend / rollout.decoder, and whether it can run here) are registered, once the
    config's plugins are imported."""
    load_plugins(cfg.plugins)
    task = cfg.task
    if task.name not in TASKS and task.name != "dataset":
        raise ConfigError(f"task.name={task.name}: unknown task; valid: "
                          f"{sorted(TASKS) + ['dataset']}")
    if task.name != "dataset":
        valid = task_kwarg_names(task.name)
        bad = [k for k in task.kwargs if k not in valid]
        if bad:
            raise ConfigError(f"task.kwargs.{bad[0]}: unknown argument of task {task.name!r}; "
                              f"valid: {valid}")
    if cfg.loss.name not in losses.POLICY_LOSSES:
        raise ConfigError(f"loss.name={cfg.loss.name}: unknown policy loss; valid: "
                          f"{sorted(losses.POLICY_LOSSES)}")
    losses.clip_range(cfg.loss)  # a loss registered without paper defaults needs eps_low / eps_high
    if cfg.reward.name is not None and cfg.reward.name not in rewards.REWARDS:
        raise ConfigError(f"reward.name={cfg.reward.name}: valid names: {sorted(rewards.REWARDS)}")
    check_backend(cfg)
