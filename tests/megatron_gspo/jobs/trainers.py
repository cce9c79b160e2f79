"""RL trainers for the tests: the tiny model on the addition task, with a reward an untrained
policy earns often enough for groups to have variance."""

from megatron_gspo.config.schema import load_config


BASE = ["model.preset=tiny", "task.name=addition", "task.kwargs.num_digits=1", "task.n_train=60",
        "task.n_eval=8", "rollout.prompts_per_batch=4", "rollout.group_size=4",
        "rollout.max_new_tokens=3", "train.num_minibatches=4", "train.eval_every=0",
        "train.save_every=1", "wandb.mode=disabled", "optim.lr=3e-3", "loss.name=grpo"]


def digit_first(example, completion: str) -> float:
    """A reward an untrained policy earns ~40% of the time, so groups have variance."""
    return float(completion[:1].isdigit())


def make_trainer(tmp_path, *overrides, name="run", **parts):
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [*BASE, f"run_dir={tmp_path / name}", *overrides])
    trainer = Trainer.from_config(cfg, **parts)
    object.__setattr__(trainer.rt.task, "reward", digit_first)  # frozen dataclass
    return trainer


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.model.module.named_parameters()}


def stub(**train):
    """What the trainer's unit-level methods read, without a model: the config with `train.*`
    set, a fresh state, a non-main rank."""
    from types import SimpleNamespace

    from megatron_gspo.jobs.rl import TrainerState

    cfg = load_config(None, [*BASE, *(f"train.{k}={v}" for k, v in train.items())])
    return SimpleNamespace(cfg=cfg, state=TrainerState(),
                           rt=SimpleNamespace(info=SimpleNamespace(is_main=False)))
