"""Gradient accumulation in the RL step (megatron_gspo.jobs.rl_step): a minibatch in row chunks
of `train.micro_max_tokens` tokens gives the one-forward update and metrics."""

import math
import os

import pytest
import torch

from megatron_gspo.run.metrics import read_jsonl
from tests.megatron_gspo.jobs.trainers import make_trainer, params
from tests.jsonl import step_rows

COMPARED = ("policy/loss", "policy/clip_frac/token", "policy/ratio/mean", "policy/entropy",
            "policy/log_ratio/abs_mean", "train/grad_norm", "moe/flip_rate/mean",
            "moe/drift_vs_old/mean")


def _grad_forwards(trainer) -> list[int]:
    """Rows of each forward the policy runs with grad enabled (the loss's forwards)."""
    real, rows = trainer.policy.token_logprobs, []

    def spy(tokens_BT, *args, **kwargs):
        if torch.is_grad_enabled():
            rows.append(tokens_BT.shape[0])
        return real(tokens_BT, *args, **kwargs)

    trainer.policy.token_logprobs = spy
    return rows


@pytest.mark.parametrize("overrides", [
    ("loss.name=grpo", "train.routing_replay=r2"),
    ("loss.name=gspo", "model.recompute_granularity=full"),
    ("loss.name=grpo",)],
    ids=["grpo-r2", "gspo-recompute", "grpo"])
def test_row_chunks_give_the_one_forward_update_and_metrics(tmp_path, overrides):
    """Each 4-row minibatch in 4 one-row forwards (a budget below one row's tokens: one row
    each), gradients accumulated: the same weights after the iteration's 4 optimizer steps and
    the same loss, clip, entropy, grad-norm and flip metrics as one forward per minibatch, to
    fp32 rounding (Adam's normalisation turns it into ~1e-6 on updates of ~1e-2); under R2
    each chunk replays its own rows, under full recompute each chunk's backward recomputes its
    own forward."""
    one = make_trainer(tmp_path, "train.steps=1", *overrides, name="one")
    chunked = make_trainer(tmp_path, "train.steps=1", "train.micro_max_tokens=1", *overrides,
                           name="chunked")
    rows_one, rows_chunked = _grad_forwards(one), _grad_forwards(chunked)
    init = params(one)
    one.train()
    chunked.train()
    assert rows_one == [4] * 4 and rows_chunked == [1] * 16
    want, got = params(one), params(chunked)
    for name, value in want.items():
        diff = float((got[name] - value).abs().max())
        assert diff < 1e-5, (name, diff)  # updates are ~1e-2: Adam normalises rounding too
    assert any(not torch.equal(value, init[name]) for name, value in want.items())
    a, b = step_rows(one.cfg.run_dir), step_rows(chunked.cfg.run_dir)
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        for key in COMPARED:
            if key in ra:
                assert math.isclose(rb[key], ra[key], rel_tol=1e-5, abs_tol=1e-7), (key, ra, rb)
        assert ra.get("replay/route_diff") == rb.get("replay/route_diff")


def test_a_nan_chunk_skips_the_step_on_every_rank(tmp_path):
    """A NaN in the second chunk's log-probs: the step is skipped (no update, counted), the
    chunks after it never run, and the minibatch's log-probs carry NaN rows there."""
    t = make_trainer(tmp_path, "train.steps=1", "train.micro_max_tokens=1",
                     "train.num_minibatches=1")
    real, calls = t.policy.token_logprobs, []

    def poisoned(tokens_BT, *args, **kwargs):
        out = real(tokens_BT, *args, **kwargs)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 2:
                return (out[0] * float("nan"), out[1])
        return out

    t.policy.token_logprobs = poisoned
    before = params(t)
    t.train()
    assert len(calls) == 2
    row = read_jsonl(os.path.join(t.cfg.run_dir, "metrics.jsonl"))[-1]
    assert row["train/skipped"] == 1.0 and math.isnan(float(row["policy/loss"]))
    for name, value in params(t).items():
        assert torch.equal(value, before[name]), name


def test_r3_replays_the_merged_routing_of_rollout_blocks_in_row_chunks(tmp_path):
    """R3 with both memory knobs: the sampler decodes 4-row blocks (`rollout.max_batch_rows`),
    their routing merges into one cache, and each one-row chunk of an optimizer step replays
    its own rows of it: every route the loss's forwards used is the sampler's."""
    t = make_trainer(tmp_path, "train.steps=1", "train.routing_replay=r3",
                     "rollout.max_batch_rows=4", "train.micro_max_tokens=1")
    real, rows = t.rt.sampler.sample, []
    def sample(prompts, params, *a, **k):  # the rollouts' calls (evals record no routing)
        if params.record_routing:
            rows.append(len(prompts))
        return real(prompts, params, *a, **k)
    t.rt.sampler.sample = sample
    forwards = _grad_forwards(t)
    t.train()
    assert rows == [4] * 4 and forwards == [1] * 16
    records = step_rows(t.cfg.run_dir)
    assert [r["replay/route_diff"] for r in records] == [0.0] * 4
    assert all(r["replay/cache_bytes"] > 0 for r in records)
