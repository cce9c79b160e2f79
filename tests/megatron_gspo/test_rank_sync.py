"""Ranks whose prompts finish at different lengths stay in step (docs/pitfalls.md#collectives),
and 2-process EP=2 / DP=2 rollouts and train steps equal the 1-process ones.

The 1-process reference (this process) is the Trainer's random-init policy with its <eos> logit
lifted (`sync_worker.force_early_eos`) so that greedy responses end after 1 to 6 tokens. Rank 0
gets the 4 prompts that end soonest, rank 1 the 4 that run longest: stopping on its own rows, rank
0 would leave the decode loop first and its peer would wait in the MoE all-to-all (EP) until the
process-group timeout. `evaluate` gets 1 example on rank 0 and 3 on rank 1 (one per chunk). A
train step whose loss is infinite on rank 1 only must be skipped on both ranks, and pi_old's
pass, split into forwards by a token budget, runs as many forwards on each rank.
Workers run with a 60 s collective timeout under a hard deadline, so a regression fails, never
hangs. The last test runs the user's command (`torchrun ... train ... model.ep=2`) end to end.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.megatron_gspo import sync_worker as sw
from tests.processes import communicate_or_kill
from tests.moe import parallel_worker as pw

TIMEOUT_S = 600  # hard deadline of a 2-process run (a hang fails; about 20 s when it passes)
EOS_STRENGTH = 0.45  # lifts <eos> so greedy lengths spread over 1..6 (measured on 64 prompts)
LAYOUTS = {"ep2": 2, "dp2": 1}  # model.ep on 2 processes (tp=1): EP=2 x DP=2, and pure DP=2
ATOL = RTOL = 1e-5
PARAM_ATOL = 5e-5
"""Weights after the two Adam steps: Adam divides each gradient entry by its own magnitude, so a
1e-7 relative gradient difference moves a near-zero entry's update by up to ~lr x 5e-3
(measured max 5.2e-6 EP=2, 4.5e-6 DP=2, with lr 1e-3; the steps move weights by 2e-3)."""


def test_agreement_is_local_on_one_process(single_process, monkeypatch):
    """With one rank the helpers answer from the local value and communicate nothing."""
    import torch.distributed as dist

    from megatron_gspo import dist as dist_utils

    def no_collective(*args, **kwargs):
        raise AssertionError("collective called with one process")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    assert dist_utils.world_size() == 1
    assert dist_utils.all_ranks(True) is True and dist_utils.all_ranks(False) is False
    assert dist_utils.max_over_ranks(7) == 7


@pytest.fixture(scope="module")
def reference(single_process, tmp_path_factory):
    from megatron_gspo.rollout.generate import evaluate
    from tests.megatron_gspo.sampling import sample
    from megatron_gspo.jobs.rl import Trainer
    from moe.model.sharding import gather_full_params

    root = tmp_path_factory.mktemp("rank_sync")
    trainer = Trainer.from_config(sw.make_config(str(root / "ref"), ep=1))
    policy, tok, train_set = trainer.policy, trainer.rt.tokenizer, trainer.rt.train_set
    sw.force_early_eos(policy, tok, [ex.prompt for ex in train_set], EOS_STRENGTH)
    policy.train(False)
    lengths = sample(policy, tok, [ex.prompt for ex in train_set], max_new_tokens=sw.MAX_NEW,
                     greedy=True)[2].sum(1).tolist()
    order = sorted(range(len(train_set)), key=lengths.__getitem__)
    chosen = order[:4] + order[-4:]  # rank 0: the 4 shortest responses, rank 1: the 4 longest
    examples = [train_set[i] for i in chosen]
    ref = {"prompts": [ex.prompt for ex in examples], "lengths": [lengths[i] for i in chosen],
           "adv_B": torch.randn(8, generator=torch.Generator().manual_seed(0)),
           "params": gather_full_params(policy.model.module),
           "eval_examples": [examples[:1], examples[4:7]]}
    ref["bad_adv_B"] = ref["adv_B"].clone()
    ref["bad_adv_B"][7] = float("inf")  # rank 1's last row: only rank 1's loss is not finite
    ref["eval"] = [evaluate(trainer.rt.sampler, tok, trainer.rt.task, exs, max_new_tokens=sw.MAX_NEW,
                            batch_size=1) for exs in ref["eval_examples"]]
    ref.update(sw.rollout_and_train(trainer, ref["prompts"], ref["adv_B"], ref["bad_adv_B"]))
    trainer.rt.logger.close()
    path = root / "ref.pt"
    torch.save(ref, path)
    return ref, str(path), root


@pytest.fixture(scope="module")
def two_process(reference):
    _, path, root = reference
    pw.spawn(sw.worker, (2, pw.free_port(), path, str(root), list(LAYOUTS.values())), nprocs=2,
             timeout_s=TIMEOUT_S)
    return {(ep, r): torch.load(root / f"ep{ep}_rank{r}.pt", weights_only=False)
            for ep in LAYOUTS.values() for r in (0, 1)}


def _prompt_len(prompts) -> int:
    from tests.megatron_gspo.sampling import encode_prompts
    from megatron_gspo.tasks.tokenizer import CharTokenizer

    return encode_prompts(CharTokenizer(), prompts)[0].shape[1]


def _decode_steps(ref) -> int:
    return ref["kv=True"]["tokens"].shape[1] - _prompt_len(ref["prompts"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pitfall13_ranks_finishing_at_different_lengths_decode_in_step(reference, two_process,
                                                                     layout):
    """Both ranks take the 1-process number of decode steps, though rank 0's own rows are all
    done earlier (it decodes padding meanwhile), with and without the KV cache; `evaluate` with
    1 chunk on rank 0 and 3 on rank 1 completes with each rank's 1-process metrics."""
    ref = reference[0]
    steps = _decode_steps(ref)
    assert max(ref["lengths"][:4]) < steps == max(ref["lengths"][4:]), ref["lengths"]
    for rank in (0, 1):
        got = two_process[LAYOUTS[layout], rank]
        prompts = ref["prompts"][4 * rank:4 * rank + 4]
        for kv in (True, False):
            s = got[f"kv={kv}"]
            assert s["tokens"].shape[1] - _prompt_len(prompts) == steps, (layout, rank, kv)
            if rank == 0:  # done early: every later column is padding
                assert not s["response"][:, -(steps - max(ref["lengths"][:4])):].any()
        assert got["eval"] == ref["eval"][rank], (layout, rank)
        assert got["agree"] == (False, True, 11)  # dist_utils: MIN of flags, MAX of ints
        assert got["reduced"] == {"x/max": 1.0, "x/min": 1.0, "x": 0.5}  # max / min / mean
        assert got["timeouts_s"] == [60.0] * 3  # model.dist_timeout_min=1 reached every group
        # inf loss on rank 1 only: both ranks skip the step (rank 0 alone stepping would wait
        # in the backward all-to-all / gradient all-reduce its peer never joins)
        assert got["bad_step_skipped"] == 1.0 == ref["bad_step_skipped"], (layout, rank)
        # pi_old's pass: 1 forward wanted on rank 0, 2 on rank 1: both run 2
        assert (ref["pi_old_forwards"], got["pi_old_forwards"]) == (1, 2), (layout, rank)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_process_greedy_rollouts_match_one_process(reference, two_process, layout):
    """Each rank's greedy tokens, response masks and R3 routing equal the 1-process rows exactly;
    sampler log-probs within 1e-5 (decode columns right-aligned: prompts pad differently)."""
    ref = reference[0]
    steps = _decode_steps(ref)
    for rank in (0, 1):
        rows = slice(4 * rank, 4 * rank + 4)
        for kv in (True, False):
            want, got = ref[f"kv={kv}"], two_process[LAYOUTS[layout], rank][f"kv={kv}"]
            what = f"{layout} rank {rank} kv={kv}"
            for key in ("tokens", "response"):
                assert torch.equal(got[key][:, -steps:], want[key][rows, -steps:]), (what, key)
            for g, w in zip(got["tokens"], want["tokens"][rows]):  # prompts too
                assert g[g != 0].tolist() == w[w != 0].tolist(), what
            torch.testing.assert_close(got["logp"][:, -steps:], want["logp"][rows, -steps:],
                                       atol=ATOL, rtol=RTOL)
            if kv:
                n_before = int(want["valid"][:rows.start].sum())
                n_rows = int(want["valid"][rows].sum())
                assert torch.equal(got["routing"],
                                   want["routing"][n_before:n_before + n_rows]), what


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_process_train_steps_match_one_process(reference, two_process, layout):
    """Two optimizer steps on the same 8 rows (4 per rank): loss, sequence clip fraction and grad
    norm of each step (mean over ranks) within 1e-5 relative (measured <= 4.1e-7) and the final
    weights within PARAM_ATOL match the 1-process run."""
    ref = reference[0]
    for rank in (0, 1):
        got = two_process[LAYOUTS[layout], rank]
        for step, (g, w) in enumerate(zip(got["train"], ref["train"])):
            for key in sw.TRAIN_KEYS:
                assert abs(g[key] - w[key]) <= 1e-5 * max(1.0, abs(w[key])), \
                    (layout, rank, step, key, g[key], w[key])
        assert got["params_after"].keys() == ref["params_after"].keys()
        moved = 0.0
        for name, p in got["params_after"].items():
            torch.testing.assert_close(p, ref["params_after"][name], atol=PARAM_ATOL, rtol=0,
                                       msg=lambda m: f"{layout} rank {rank} {name}: {m}")
            moved = max(moved, float((p - ref["params"][name]).abs().max()))
        assert moved > 1e-4  # the steps did move the weights


E2E_OVERRIDES = ("model.ep=2", "train.steps=2", "task.n_eval=16", "rollout.prompts_per_batch=4",
                 "rollout.group_size=2", "train.num_minibatches=2", "train.save_every=0",
                 "model.dist_timeout_min=1",
                 "train.start_accuracy=null")  # the init is synthetic, not an in-band cold start
E2E_EOS_STRENGTH = 4.0
"""Sampled at temperature 1, 4 rows then need 1 decode step in 28 of 64 batches and all 5 in 25
(measured on 256 prompts): the two ranks' step counts differ in about 65% of iterations."""


@pytest.mark.slow
def test_pitfall13_torchrun_train_ep2_with_early_eos_completes(single_process, tmp_path):
    """The reported command, `torchrun --nproc-per-node 2 -m megatron_gspo.cli train --config
    experiments/demo/gspo.yaml model.ep=2 train.steps=2` (small batch and eval set), from an init
    checkpoint whose responses end early at random lengths, so the two ranks' rollouts need
    different numbers of decode steps: it finishes both iterations (it hung after the step-0
    eval until the process-group timeout)."""
    from megatron_gspo.config.schema import load_config
    from megatron_gspo.run.resume import save_state
    from megatron_gspo.jobs import sft
    from megatron_gspo.run.setup import setup_runtime

    init = str(tmp_path / "init")
    rt = setup_runtime(load_config("experiments/demo/gspo.yaml", [f"run_dir={init}",
                                                                  "init_checkpoint=null"]),
                       sft.SPEC)
    sw.force_early_eos(rt.policy, rt.tokenizer, [ex.prompt for ex in rt.train_set[:64]],
                       E2E_EOS_STRENGTH)
    save_state(rt, 0, {"job": "test"})
    rt.logger.close()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_gspo.cli", "train", "--config", "experiments/demo/gspo.yaml",
           *E2E_OVERRIDES, f"run_dir={run_dir}", f"init_checkpoint={init}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    _, err = communicate_or_kill(proc, TIMEOUT_S)  # torchrun and its workers: a hang fails
    assert proc.returncode == 0, err[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["train/iteration"] for r in records if "train/iteration" in r} == {0, 1}, records
    lengths = [r["response/length/max"] for r in records if "response/length/max" in r]
    assert min(lengths) < 5, lengths  # some rank's rows all stopped early (max_new_tokens is 5)
