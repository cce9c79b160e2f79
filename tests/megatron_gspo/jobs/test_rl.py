"""The RL job (megatron_gspo.jobs.rl) end to end on the tiny model: off-policy minibatches, what
one rollout batch logs, resume, the NaN / inf guard, flips, init_checkpoint, router noise, CLI
errors."""

import os
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.run.metrics import read_jsonl
from tests.jsonl import step_rows
from tests.megatron_gspo.jobs.trainers import BASE, make_trainer, params, stub


def test_first_minibatch_is_on_policy_later_ones_are_not(tmp_path):
    """Ratio is exactly 1 on the first minibatch (pi == pi_old) and moves after a step
    (docs/pitfalls.md#minibatches: with one minibatch GSPO would be plain on-policy PG)."""
    trainer = make_trainer(tmp_path, "train.steps=1", "loss.name=gspo")
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    assert [r["train/minibatch"] for r in rows] == [0, 1, 2, 3]
    assert abs(rows[0]["policy/ratio/mean"] - 1.0) < 1e-5
    assert rows[0]["policy/clip_frac/token"] == 0.0
    assert max(abs(r["policy/ratio/mean"] - 1.0) for r in rows[1:]) > 1e-5


def test_iteration_rows_carry_iteration_eval_alerts_and_timings_where_due(tmp_path):
    """Two iterations of two minibatches, eval_every=2: an eval row before the run, then
    `train/iteration` per row; the end-of-iteration row alone carries alerts, timings and
    throughput, and the eval only after iteration 2 (the 2nd rollout batch done)."""
    trainer = make_trainer(tmp_path, "train.steps=2", "train.num_minibatches=2",
                           "train.eval_every=2", "train.save_every=0")
    trainer.train()
    first, *rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert first["step"] == 0 and "eval/accuracy" in first and "train/iteration" not in first
    assert [(r["train/iteration"], r["train/minibatch"], r["step"]) for r in rows] == \
        [(0, 0, 1), (0, 1, 2), (1, 0, 3), (1, 1, 4)]
    ends = [r for r in rows if r["train/minibatch"] == 1]
    for r in rows:
        end = r["train/minibatch"] == 1
        for key in ("alert/reward_collapse", "alert/entropy_collapse", "time/rollout",
                    "perf/train_tokens_per_s"):
            assert (key in r) == end, (key, r["step"])
    assert ["eval/accuracy" in r for r in ends] == [False, True]


def test_resume_gives_the_same_next_step(tmp_path):
    straight = make_trainer(tmp_path, "train.steps=2", name="straight")
    straight.train()
    first = make_trainer(tmp_path, "train.steps=1", name="resumed")
    first.train()
    resumed = make_trainer(tmp_path, "train.steps=2", name="resumed")
    assert resumed.state.iteration == 1 and resumed.state.opt_step == 4
    resumed.train()
    a, b = params(straight), params(resumed)
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=1e-6, rtol=1e-6, msg=n)
    rows_a = read_jsonl(os.path.join(straight.cfg.run_dir, "metrics.jsonl"))
    rows_b = read_jsonl(os.path.join(resumed.cfg.run_dir, "metrics.jsonl"))
    assert rows_a[-1]["reward/mean"] == rows_b[-1]["reward/mean"]
    assert rows_a[-1]["policy/loss"] == pytest.approx(rows_b[-1]["policy/loss"], abs=1e-6)
    # the log keeps the rows up to the checkpoint's optimizer step, none twice
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]


def test_nan_loss_is_skipped_then_aborts_without_losing_checkpoints(tmp_path):
    make_trainer(tmp_path, "train.steps=1", "train.max_skipped_steps=2").train()  # checkpointed
    trainer = make_trainer(tmp_path, "train.steps=3", "train.max_skipped_steps=2")
    before = params(trainer)
    real = trainer.loss_fn

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    trainer.loss_fn = nan_loss
    with pytest.raises(FloatingPointError, match="max_skipped_steps=2"):
        trainer.train()  # 4 minibatches: the 3rd consecutive skip aborts
    after = params(trainer)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    assert any(r.get("train/skipped") == 1.0 for r in rows)
    ckpt = os.path.join(trainer.cfg.run_dir, "checkpoints")
    assert open(os.path.join(ckpt, "latest")).read().strip() == "1"


def test_non_finite_loss_with_finite_grads_is_skipped(tmp_path):
    """The guard reads the loss itself, not only the grad norm: loss + inf has finite grads."""
    trainer = make_trainer(tmp_path, "train.steps=1", "train.max_skipped_steps=10")
    before, real = params(trainer), trainer.loss_fn

    def inf_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss + float("inf"), metrics

    trainer.loss_fn = inf_loss
    trainer.train()
    after = params(trainer)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    rows = step_rows(trainer.cfg.run_dir)
    assert [r["train/skipped"] for r in rows] == [1.0] * 4
    assert trainer.state.skipped_in_a_row == 4


def test_a_skipped_step_logs_no_flips(tmp_path):
    """A step the guard skipped changed nothing, so it reports no flip metrics."""
    trainer = make_trainer(tmp_path, "train.steps=1", "train.num_minibatches=2",
                           "train.flip_every=1", "train.save_every=0")
    real = trainer.loss_fn
    trainer.loss_fn = lambda *a, **k: (lambda out: (out[0] + float("inf"), out[1]))(real(*a, **k))
    trainer.train()
    rows = step_rows(trainer.cfg.run_dir)
    assert [r["train/skipped"] for r in rows] == [1.0, 1.0]
    assert not any(k.startswith("moe/flip_rate") for r in rows for k in r)


def test_guard_aborts_after_more_than_max_consecutive_skips_and_a_step_resets():
    from megatron_gspo.jobs.rl import Trainer

    t = stub(max_skipped_steps=2)
    for stepped in (False, False, True, False, False):  # 2 in a row, reset, 2 in a row
        assert Trainer.guard(t, stepped) == {"train/skipped": float(not stepped)}
    assert t.state.skipped_in_a_row == 2
    with pytest.raises(FloatingPointError, match="3 consecutive"):
        Trainer.guard(t, False)


def test_no_update_means_zero_flips_and_update_means_some(tmp_path):
    frozen = make_trainer(tmp_path, "train.steps=1", "optim.lr=0.0", name="frozen")
    frozen.train()
    rows = step_rows(frozen.cfg.run_dir)
    assert all(r["moe/flip_rate/mean"] == 0.0 for r in rows)
    moving = make_trainer(tmp_path, "train.steps=1", "optim.lr=0.05", name="moving")
    moving.train()
    rows = step_rows(moving.cfg.run_dir)
    assert max(r["moe/flip_rate/mean"] for r in rows) > 0.0
    assert "moe/flip_rate/layer_01" in rows[0] and "moe/load_imbalance/layer_00" in rows[0]


def test_sft_checkpoint_initialises_rl(tmp_path):
    from megatron_gspo.jobs.sft import run_sft

    sft_cfg = load_config(None, [*BASE, f"run_dir={tmp_path / 'sft'}", "sft.steps=3",
                                 "sft.batch_size=8", "sft.eval_every=0"])
    run_sft(sft_cfg)
    trainer = make_trainer(tmp_path, "train.steps=1", f"init_checkpoint={tmp_path / 'sft'}")
    from megatron_gspo.run.setup import build_policy
    from moe.model import dist_ckpt

    fresh = build_policy(trainer.cfg, trainer.rt.tokenizer.vocab_size, optim=None)
    saved = build_policy(trainer.cfg, trainer.rt.tokenizer.vocab_size, optim=None, seed=123)
    dist_ckpt.load(saved, str(tmp_path / "sft" / "checkpoints" / "step_000003" / "dist"))
    fresh, saved = dict(fresh.model.module.named_parameters()), \
        dict(saved.model.module.named_parameters())
    for n, p in trainer.policy.model.module.named_parameters():
        torch.testing.assert_close(p.detach(), saved[n], atol=0, rtol=0, msg=n)
    assert any(not torch.equal(p, saved[n]) for n, p in fresh.items())  # SFT moved them
    # the weights only: RL starts with a fresh Adam and lr schedule, not SFT's 3 updates
    assert trainer.policy.optimizer.scheduler.num_steps == 0


def test_missing_init_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="init_checkpoint=.*nope: no such directory"):
        make_trainer(tmp_path, f"init_checkpoint={tmp_path / 'nope'}")
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_a_failed_build_releases_the_run_dir(tmp_path, monkeypatch):
    """An error while building the reference policy closes the runtime: the run dir's lock
    is free (another process could claim it; a second descriptor here can)."""
    import fcntl

    from megatron_gspo.jobs import rl as trainer_mod
    from megatron_gspo.run.lock import LOCK_FILE

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(trainer_mod, "build_policy", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        make_trainer(tmp_path, "loss.kl_coef=0.1")
    fd = os.open(tmp_path / "run" / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while still held
    finally:
        os.close(fd)


def test_local_prompts_checks_each_data_parallel_ranks_rows():
    from megatron_gspo.jobs.rl import local_prompts

    cfg = load_config(None, [*BASE, "train.num_minibatches=8", "rollout.group_size=4"])
    assert local_prompts(cfg, 1) == 4 and local_prompts(cfg, 2) == 2  # 16 / 8 rows per rank
    cfg = load_config(None, [*BASE, "train.num_minibatches=16", "rollout.group_size=4"])
    assert local_prompts(cfg, 1) == 4
    with pytest.raises(ConfigError, match="num_minibatches=16"):
        local_prompts(cfg, 2)  # 8 rows per rank do not split into 16
    with pytest.raises(ConfigError, match="not divisible"):
        local_prompts(cfg, 3)


def test_router_noise_is_a_fresh_seeded_draw_per_step_and_off_under_replay():
    """Each optimizer step gets its own noise; the same step gets the same (resumable); a
    replayed forward or std 0 gets none."""
    from megatron_gspo.jobs.rl_step import noise_inputs

    live, replayed = SimpleNamespace(replay=None), SimpleNamespace(replay=object())
    cfg = stub(router_noise_std=0.5).cfg

    def draw(step, mb=live):
        std, gen = noise_inputs(cfg, mb, step, "cpu")
        return std, (None if gen is None else torch.randn(4, generator=gen).tolist())

    assert draw(3) == draw(3) and draw(3)[0] == 0.5
    assert draw(3)[1] != draw(4)[1]
    assert draw(3, replayed) == (0.0, None)
    assert noise_inputs(stub(router_noise_std=0.0).cfg, live, 3, "cpu") == (0.0, None)


@pytest.mark.parametrize("argv, fragment", [
    (["train", "train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train", "--config", "nope.yaml"], "config file not found: nope.yaml"),
    (["train", "train.routing_replay=r3", "rollout.decoders.kv_cache=false"],
     "rollout.decoders.kv_cache=true"),
    (["train", "task.kwargs.num_digits=1", "wandb.mode=disabled", "run_dir=RUN"],
     "task.n_train / task.n_val / task.n_test: Addition(num_digits=1) has only 100 distinct prompts"),
    (["train", "task.name=dataset", "data.train_files=[BAD]", "wandb.mode=disabled",
      "run_dir=RUN"], "bad.jsonl:1: not valid JSON"),
])
def test_cli_bad_config_exits_2_naming_the_problem(capsys, tmp_path, argv, fragment):
    from megatron_gspo.cli import main

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    argv = [a.replace("RUN", str(tmp_path / "run")).replace("BAD", str(tmp_path / "bad.jsonl"))
            for a in argv]

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_tiny_run_logs_the_test_split_and_routing_sensitivity_and_trains_the_same(tmp_path):
    """`test/{accuracy,format_ok,reward}` at step 0 and at the last step only,
    `moe/router_margin/...` with every flip measurement and `moe/route_sensitivity/...` every
    `train.route_sensitivity_every` rollout batches; neither the test evals nor the
    sensitivity's forwards change what is trained (same rows as a run without them)."""
    on = ["train.steps=2", "train.num_minibatches=2", "train.save_every=0", "task.n_val=8",
          "train.route_sensitivity_every=2"]
    measured = make_trainer(tmp_path, *on, name="measured")
    measured.train()
    plain = make_trainer(tmp_path, *on[:-1], name="plain")  # the same splits ...
    plain.test = lambda: {}  # ... never evaluating the test split
    plain.train()
    rows = read_jsonl(os.path.join(measured.cfg.run_dir, "metrics.jsonl"))
    tested = [r["step"] for r in rows if "test/accuracy" in r]
    assert tested == [0, 4] and rows[0]["step"] == 0
    for r in (rows[0], rows[-1]):
        assert 0 <= r["test/accuracy"] <= 1 and 0 <= r["test/reward"] <= 1
        assert 0 <= r["test/format_ok"] <= 1
    steps = rows[1:]
    L = measured.policy.preset.num_layers
    for r in steps:
        margins = [r[f"moe/router_margin/layer_{l:02d}"] for l in range(L)]
        assert all(0 <= m <= 1 for m in margins)
        assert r["moe/router_margin/mean"] == pytest.approx(sum(margins) / L)
        assert 0 <= r["moe/router_margin_small/layer_00"] <= 1
    sensed = [r["step"] for r in steps if "moe/route_sensitivity/layer_00" in r]
    assert sensed == [2]  # rollout batch 0 (every 2nd), in its last row with its time
    assert "time/sensitivity" in steps[1] and steps[1]["moe/route_sensitivity/mean"] > 0
    same = ["policy/loss", "train/grad_norm", "reward/mean", "moe/flip_rate/mean",
            "moe/router_margin/mean"]
    assert [[r[k] for k in same] for r in steps] == [[r[k] for k in same]
                                                     for r in step_rows(plain.cfg.run_dir)]
    assert not any(k.startswith(("test/", "moe/route_sensitivity/")) for r in read_jsonl(
        os.path.join(plain.cfg.run_dir, "metrics.jsonl")) for k in r)
