"""tools.profile_ours.step_breakdown: the parts of a train step, timed without leaving a trace."""

from tests.megatron_gspo.test_trainer import make_trainer
from tools.profile_ours import STEP_PARTS, step_breakdown


def test_step_breakdown_times_each_part_and_restores_the_methods(tmp_path):
    trainer = make_trainer(tmp_path, "train.num_minibatches=2")
    calls = []
    step = trainer.policy.step
    trainer.policy.step = lambda: calls.append(1) or step()  # an instance attribute already there
    steps_before = trainer.state.opt_step
    table = step_breakdown(trainer, 1)
    assert trainer.state.opt_step - steps_before == 2 and len(calls) == 2  # the run's own hook ran
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert list(rows) == [name for name, _, _ in STEP_PARTS] + [
        "rest (metrics, flips, replay set-up)", "train_step"]
    ms = {name: float(line.split(" | ")[1]) for name, line in rows.items()}
    assert ms["forward"] > 0 and ms["backward"] > 0 and ms["optimizer"] > 0
    assert sum(ms[name] for name, _, _ in STEP_PARTS) <= ms["train_step"] + 0.1
    assert "train_step" not in trainer.__dict__ and "loss_fn" in trainer.__dict__
    assert "token_logprobs" not in trainer.policy.__dict__ and "backward" not in trainer.policy.__dict__
