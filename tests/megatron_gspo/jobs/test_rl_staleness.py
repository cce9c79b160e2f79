"""`rollout.max_staleness` in the RL job: rollout batches sampled beside the trainer by weights
exactly k versions old (read back from the batches and recomputed from each version's weights),
R3 replaying the sampling version's routes, the decoupled objective (pi_old = the trainer's
recompute, the sampler's log-probs corrected by the loss's settings), reproducibility whatever
the timing, a SIGTERM and its resume, and the configurations refused. The producer alone is in
tests/megatron_gspo/rollout/test_overlap.py; engine servers in vllm/test_server_staleness.py."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.algo.corrections import correction_inputs
from megatron_gspo.algo.flips import loss_positions, sampler_mismatch, token_rows
from megatron_gspo.algo.losses import PolicyLossConfig, policy_loss
from megatron_gspo.cli import main
from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.jobs.rl import Trainer
from megatron_gspo.jobs.rl_rollouts import check_layout
from megatron_gspo.rollout.backends import check_config
from moe.routing.replay import current_routing
from tests.jsonl import step_rows
from tests.megatron_gspo.jobs.trainers import BASE, make_trainer, params
from tests.megatron_gspo.run.test_lifetime import learnable, sigterm_during  # noqa: F401
from tests.processes import communicate_or_kill

TIMED = ("time/", "perf/")


def spied(trainer):
    """Keep the trainer's weights at the start of each rollout batch (its version), every
    batch it trains on and the routing its loss replays."""
    weights, batches, replayed = {}, {}, {}
    rollout, prepare = trainer.rollout, trainer.prepare

    def take(it):
        weights[it] = params(trainer)
        return rollout(it)

    def keep(batch):
        batches[trainer.state.iteration] = batch
        full, shared = prepare(batch)
        replayed[trainer.state.iteration] = full.replay
        return full, shared
    trainer.rollout, trainer.prepare = take, keep
    return weights, batches, replayed


def load(policy, weights) -> None:
    with torch.no_grad():
        for n, p in policy.model.module.named_parameters():
            p.copy_(weights[n])


@pytest.mark.parametrize("decoder", ["lean", "megatron"])
def test_k1_trains_each_batch_on_samples_of_the_weights_one_version_old(tmp_path, decoder):
    """The acceptance run: k = 1, R3, 4 rollout batches, each of our decoders over its weight
    copy. Batch j is sampled by version max(0, j - 1) (read from the batch, and logged as its
    staleness); its log-probs and its routes (the ones R3 replays) are those of that version's
    weights recomputed, not of the weights that train on it; the loss replayed them."""
    trainer = make_trainer(tmp_path, "train.steps=4", "rollout.max_staleness=1",
                           "train.routing_replay=r3", "train.num_minibatches=2",
                           "train.save_every=0", f"rollout.decoder={decoder}")
    weights, batches, replayed = spied(trainer)
    trainer.train()
    assert [batches[j].version_B.unique().tolist() for j in range(4)] == [[0], [0], [1], [2]]
    assert all(replayed[j] is batches[j].routing for j in range(4))  # the sampler's routes
    rows = step_rows(tmp_path / "run")
    assert [r["rollout/staleness/max"] for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert all(r["replay/route_diff"] == 0.0 for r in rows)
    policy = trainer.policy
    for j in range(1, 4):
        b = batches[j]
        rows_N = token_rows(policy, b.routing, loss_positions(b.response_BT))
        diffs = {}
        for version in (j - 1, j):
            load(policy, weights[version])
            logp_BT, routing = current_routing(policy, b.tokens_BT, b.valid_BT,
                                               start=b.response_start)
            resp_BT = b.response_BT.bool()
            logp = (logp_BT - b.sampler_logp_BT).abs()[resp_BT].max().item()
            routes = sampler_mismatch(routing, b.routing, rows_N)["rollout/routing_mismatch/mean"]
            diffs[version] = (logp, routes)
        assert diffs[j - 1][0] <= 1e-5 and diffs[j - 1][1] == 0.0, (j, diffs)
        assert diffs[j][0] > 1e-3 and diffs[j][1] > 0, (j, diffs)  # one update moved them


def untimed(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(TIMED)}
            for r in step_rows(run_dir)]


def test_a_run_is_the_same_however_long_the_sampler_takes(tmp_path):
    """The versions, not the wall clock, decide what is trained: a sampler slowed down (the
    trainer then waits for every batch) gives the rows of one that keeps ahead."""
    runs = ["train.steps=3", "rollout.max_staleness=1", "train.routing_replay=r3",
            "train.save_every=0"]
    fast = make_trainer(tmp_path, *runs, name="fast")
    fast.train()
    slow = make_trainer(tmp_path, *runs, name="slow")
    beside = slow.rollouts.beside
    sample = beside.sample
    beside.sample = lambda *a, **k: (time.sleep(0.3), sample(*a, **k))[1]
    slow.train()
    got, want = untimed(tmp_path / "slow"), untimed(tmp_path / "fast")
    assert [r["rollout/staleness/max"] for r in want][-1] == 1 and got == want


def test_the_first_minibatch_is_on_policy_for_the_trainer_and_the_stale_sampler_is_corrected(
        tmp_path):
    """The decoupled objective: pi_old is the trainer's recompute at the start of the batch's
    training (the first minibatch's ratio is 1), the sampler's older log-probs enter through
    the correction (TIS weights away from 1). With pi_old = the sampler's (coupled) the first
    minibatch's ratio carries the staleness instead."""
    def first_minibatches(*overrides, name):
        trainer = make_trainer(tmp_path, "train.steps=3", "rollout.max_staleness=1",
                               "train.save_every=0", *overrides, name=name)
        trainer.train()
        return [r for r in step_rows(tmp_path / name)
                if r["train/minibatch"] == 0 and r["train/iteration"] > 0]

    decoupled = first_minibatches("loss.tis_cap=2.0", name="decoupled")
    assert all(r["policy/log_ratio/abs_mean"] <= 1e-6 for r in decoupled)
    assert all(abs(r["policy/tis/mean"] - 1) > 1e-4 for r in decoupled)
    coupled = first_minibatches("rollout.use_sampler_logprobs=true", name="coupled")
    assert all(r["policy/log_ratio/abs_mean"] > 1e-3 for r in coupled)


@pytest.mark.parametrize("loss", ["grpo", "gspo", "gspo_token"])
@pytest.mark.parametrize("correction", [
    {"tis_cap": 2.0}, {"is_mask_token": [0.5, 2.0], "tis_cap": 2.0}, {"is_mask_seq": [0.99, 1.01]},
    {"icepop": [0.5, 5.0]}])
def test_the_decoupled_objective_is_todays_loss_when_behaviour_is_proximal(loss, correction):
    """float32: the loss with the corrections between the behaviour log-probs (the sampler's)
    and the proximal pi_old, when they are equal, is the loss without them (<= 1e-6), on a
    minibatch where the policy has moved from pi_old. The check has teeth: the weights taken
    against the moving policy instead of the proximal one (a coupled correction) miss it."""
    g = torch.Generator().manual_seed(0)
    mask_BT = torch.ones(6, 7)
    mask_BT[1, 5:] = 0
    proximal_BT = -torch.rand(6, 7, generator=g) - 0.1
    logp_BT = proximal_BT + 0.05 * torch.randn(6, 7, generator=g)
    adv_B = torch.randn(6, generator=g)
    cfg = PolicyLossConfig(name=loss, **correction)
    plain, _ = policy_loss(logp_BT, proximal_BT, adv_B, mask_BT, cfg)
    kwargs, _ = correction_inputs(proximal_BT, proximal_BT.clone(), mask_BT, cfg)
    decoupled, _ = policy_loss(logp_BT, proximal_BT, adv_B, mask_BT, cfg, **kwargs)
    assert plain.dtype == decoupled.dtype == torch.float32
    assert abs(float(decoupled - plain)) <= 1e-6
    wrong, _ = correction_inputs(logp_BT, proximal_BT, mask_BT, cfg)
    coupled, _ = policy_loss(logp_BT, proximal_BT, adv_B, mask_BT, cfg, **wrong)
    assert abs(float(coupled - plain)) > 1e-4


def test_a_sigterm_drops_the_batch_sampled_ahead_and_the_resume_samples_it_again(
        tmp_path, capsys, monkeypatch, learnable):  # noqa: F811
    """SIGTERM during rollout batch 2 of 4 at k = 1: step 2 saved, exit 128 + SIGTERM, and one
    line says batch 2 (sampled ahead by version 1) was dropped. The resume trains batches 2
    and 3 once each, batch 2 sampled again by the resumed weights (staleness 0), batch 3 one
    version old: no batch trained twice, none skipped."""
    args = ["train", *BASE, "train.steps=4", "rollout.max_staleness=1", f"run_dir={tmp_path}"]
    with monkeypatch.context() as m:
        sigterm_during(m, Trainer, step=2)
        assert main(args) == 128 + signal.SIGTERM
    out = capsys.readouterr().out
    assert ("rollout.max_staleness=1: dropped rollout batch(es) 2, sampled ahead by weights of "
            "version 1; a resume samples them again by its checkpoint's weights") in out
    assert main(args) == 0
    rows = [r for r in step_rows(tmp_path) if r["train/minibatch"] == 3]
    assert [r["train/iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/staleness/max"] for r in rows] == [0, 1, 0, 1]


def test_staleness_is_refused_where_the_sampler_cannot_sample_beside_the_trainer():
    """One line each: a backend without the capability, vLLM in the trainer's process,
    dynamic sampling (it chooses by rewards while sampling), more than one trainer process."""
    def cfg(*overrides):
        return load_config(None, [*BASE, "rollout.max_staleness=2", *overrides])

    with pytest.raises(ConfigError, match=r"^rollout.max_staleness=2 samples beside the "
                                          r"trainer: rollout.backend=megatron_engine cannot "
                                          r"\(its capability `beside`; .*\blean, megatron\b.* "
                                          r"can\)$"):  # and test backends registered as lean
        check_config(cfg("rollout.backend=megatron_engine"))
    with pytest.raises(ConfigError, match=r"^rollout.max_staleness=2 with rollout.backend=vllm "
                                          r"needs rollout.vllm.mode=server"):
        check_config(cfg("rollout.backend=vllm", "model.preset=qwen3-moe-tiny-hd32"))
    check_config(cfg("rollout.backend=vllm", "rollout.vllm.mode=server"))
    with pytest.raises(ConfigError, match=r"^filter.dynamic_sampling=true chooses groups"):
        cfg("filter.dynamic_sampling=true")
    with pytest.raises(ConfigError, match=r"^rollout.max_staleness=2 samples beside the trainer "
                                          r"in a thread of its process: it needs one trainer "
                                          r"process \(this run has 2\)$"):
        check_layout(cfg(), SimpleNamespace(world_size=2))
    check_layout(cfg(), SimpleNamespace(world_size=1))


@pytest.mark.slow
def test_two_trainer_processes_with_staleness_are_refused_before_the_run_dir_is_written(
        tmp_path):
    """torchrun, 2 processes: the one line on stderr (exit 2 on each rank) once the process
    groups are up, before the run dir is claimed: nothing is written there."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_gspo.cli", "train", *BASE, "rollout.max_staleness=1",
           f"run_dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    _, err = communicate_or_kill(proc, 600)
    assert proc.returncode != 0 and "(exitcode: 2)" in err
    assert ("megatron-gspo: error: rollout.max_staleness=1 samples beside the trainer in a "
            "thread of its process: it needs one trainer process (this run has 2)\n") in err, \
        err[-3000:]
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_stale_sampler_records_its_routing_for_the_mismatch_metrics():
    """Older weights route differently: the routing mismatch per layer is logged at k > 0
    with the lean decoder, as for an engine (not at k = 0: the same weights)."""
    def records(*overrides):
        return Trainer.records_sampler_routing(SimpleNamespace(cfg=load_config(None, [
            *BASE, *overrides])))
    assert records("rollout.max_staleness=1") and not records()
