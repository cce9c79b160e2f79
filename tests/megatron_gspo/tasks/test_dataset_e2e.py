"""End to end on the committed GSM8K-style fixture: BPE tokenizer with a chat template, verl
JSONL, math-verify rewards, DAPO filters, 2 RL iterations of the tiny model."""

import os

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.run.metrics import read_jsonl

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "gsm_tiny")
MAX_NEW = 16


def config(tmp_path, *overrides):
    return load_config(None, [
        "model.preset=tiny", "model.max_seq_len=128", "task.name=dataset",
        f"data.train_files=[{FIXTURE}/train.jsonl]", f"data.test_files=[{FIXTURE}/test.jsonl]",
        "data.sft_key=extra_info.answer", f"data.tokenizer_path={FIXTURE}",
        "reward.name=math", f"rollout.max_new_tokens={MAX_NEW}", "rollout.prompts_per_batch=2",
        "rollout.group_size=4", "train.num_minibatches=2", "train.eval_every=0",
        "train.save_every=0", "wandb.mode=disabled", f"run_dir={tmp_path / 'run'}", *overrides])


def independent_math_verdict(completion: str, truth: str) -> float:
    """math-verify called directly, with its own defaults (not through megatron_gspo)."""
    from math_verify import parse, verify

    return float(verify(parse("\\boxed{" + truth + "}"), parse(completion)))


def test_two_rl_iterations_on_the_fixture(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("math_verify")
    import megatron_gspo.jobs.rl as trainer_mod
    import megatron_gspo.jobs.rl_rollouts as rollouts_mod  # where the trainer samples

    drawn, kept = [], []
    real_generate, real_sample = rollouts_mod.generate_rollouts, rollouts_mod.sample_rollouts

    def spy_generate(*args, **kwargs):
        drawn.append(real_generate(*args, **kwargs))
        return drawn[-1]

    def spy_sample(*args, **kwargs):
        batch, metrics = real_sample(*args, **kwargs)
        kept.append(batch)
        return batch, metrics

    monkeypatch.setattr(rollouts_mod, "sample_rollouts", spy_sample)
    monkeypatch.setattr(rollouts_mod, "generate_rollouts", spy_generate)
    trainer = trainer_mod.Trainer.from_config(
        config(tmp_path, "train.steps=2", "filter.overlong=true", "filter.dynamic_sampling=true",
               "filter.max_rounds=2"))
    tok = trainer.rt.tokenizer
    assert tok.vocab_size == 512 and len(trainer.rt.train_set) == 180
    trainer.train()

    assert len(kept) == 2 and 2 <= len(drawn) <= 4
    for batch in drawn:
        assert len(batch) == 8
        for row in range(8):
            ex, completion = batch.examples[row], batch.completions[row]
            assert batch.rewards_B[row].item() == independent_math_verdict(completion, ex.meta[0])
            ids = batch.tokens_BT[row][batch.response_BT[row]].tolist()
            assert tok.decode(ids) == completion.strip() or tok.decode(ids) == completion
            cut = len(ids) == MAX_NEW and ids[-1] not in tok.stop_ids
            assert bool(batch.truncated_B[row]) == cut
        assert batch.reward_status_B.tolist() == [0] * 8
    rows = read_jsonl(os.path.join(trainer.cfg.run_dir, "metrics.jsonl"))
    last = rows[-1]
    final = kept[-1]
    assert last["reward/mean"] == pytest.approx(final.rewards_B.mean().item())
    assert last["response/truncated_frac"] == pytest.approx(final.truncated_B.float().mean().item())
    assert last["filter/overlong_masked"] == last["response/truncated_frac"]
    assert last["reward/errors"] == 0.0 and last["filter/rounds"] in (1.0, 2.0)
    assert last["filter/prompts_drawn"] == 2.0 * last["filter/rounds"]
    assert all(torch.isfinite(torch.tensor(r["policy/loss"])) for r in rows if r["step"])
    assert {k for k in rows[0] if k.startswith("test/")} == {"test/accuracy", "test/format_ok",
                                                            "test/reward"}  # step 0 and last
    assert rows[0]["step"] == 0 and "test/reward" in last


def test_fixture_sft_batch_targets_the_worked_solution(tmp_path):
    pytest.importorskip("transformers")
    from megatron_gspo.tasks.datasets import build_task
    from megatron_gspo.jobs.sft import sft_batch
    from megatron_gspo.tasks.tokenizer import load_tokenizer

    cfg = config(tmp_path)
    tok = load_tokenizer(FIXTURE)
    _, train, _, _ = build_task(cfg, tok, model_max_len=128)
    ex = train[0]
    assert ex.answer.endswith(f"#### {ex.meta[0]}") and "=" in ex.answer
    tokens, valid, target = sft_batch(tok, [ex])
    assert tokens[0][target[0]].tolist() == tok.encode(ex.answer) + [tok.eos_id]
    assert tok.decode(tokens[0][valid[0]].tolist()).startswith("<|im_start|>user") is False
    assert tok.hf.decode(tokens[0][valid[0]].tolist()).startswith("<|im_start|>user\n")
