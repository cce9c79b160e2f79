"""The sampler seam: prompt ids and padding, the registry, and a backend defined here (a stub
that returns fixed tokens) running an RL iteration with no edit outside this file."""

import os

import pytest
import torch

from megatron_gspo.config.schema import load_config
from megatron_gspo.errors import ConfigError
from megatron_gspo.rollout.batch import left_pad
from megatron_gspo.rollout.sampler import (SAMPLERS, Samples, SamplingParams, prompt_ids,
                                           register_sampler)
from megatron_gspo.run.metrics import read_jsonl
from megatron_gspo.tasks.toy import CharTokenizer


def test_prompt_ids_put_bos_first_and_left_pad_aligns_the_ends():
    tok = CharTokenizer()
    ids = prompt_ids(tok, ["1+2=", "12+34="])
    assert ids[0] == [tok.bos_id] + tok.encode("1+2=")
    tokens_BP, valid_BP = left_pad(ids, tok.pad_id)
    assert tokens_BP.shape == (2, 7)
    assert valid_BP[0].tolist() == [False, False, True, True, True, True, True]
    assert tokens_BP[0, :2].tolist() == [tok.pad_id] * 2
    assert (tokens_BP[:, -1] == tok.encode("=")[0]).all()


def test_prompt_ids_without_bos():
    """A tokenizer without <bos> (bos_id None) gets no extra column, only its prompt tokens."""
    tok = CharTokenizer()
    tok.bos_id = None
    tokens_BP, valid_BP = left_pad(prompt_ids(tok, ["1+2=", "12+3="]), tok.pad_id)
    assert tokens_BP.shape == (2, 5) and valid_BP.sum(1).tolist() == [4, 5]
    assert tokens_BP[0].tolist() == [tok.pad_id] + tok.encode("1+2=")


def test_left_pad_refuses_an_empty_prompt():
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1, 2], []], 0)


def test_the_built_in_backends_are_registered():
    from megatron_gspo.rollout import backends  # noqa: F401  (registers them)

    assert {"lean", "megatron", "megatron_engine"} <= set(SAMPLERS)


def test_an_unknown_backend_is_one_config_error_naming_the_registered_ones(tmp_path):
    from megatron_gspo.rollout.backends import check_backend

    with pytest.raises(ConfigError, match=r"rollout.backend='vlm': no such backend; "
                                          r"registered: \[.*'lean'.*\]"):
        check_backend(load_config(None, ["rollout.backend=vlm"]))
    check_backend(load_config(None, ["rollout.decoder=megatron"]))  # the older spelling


def test_decoder_is_the_older_spelling_of_the_decoder_backends():
    assert load_config(None, []).rollout.backend == "lean"
    assert load_config(None, ["rollout.decoder=megatron"]).rollout.backend == "megatron"
    assert load_config(None, ["rollout.backend=megatron"]).rollout.backend == "megatron"
    cfg = load_config(None, ["rollout.backend=megatron_engine", "rollout.decoder=megatron"])
    assert cfg.rollout.backend == "megatron_engine"


class FixedTokens:
    """Answers a+b= with the sum in even rows and "a" in odd ones (then <eos>), log-prob -1
    per token: fixed tokens whose rewards differ within each group of two."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.calls = []

    def answer(self, b: int, prompt: list[int]) -> list[int]:
        a, c = self.tok.decode(prompt[1:]).rstrip("=").split("+")
        return self.tok.encode(str(int(a) + int(c)) if b % 2 == 0 else "a") + [self.tok.eos_id]

    def sample(self, prompts, params: SamplingParams, generator=None) -> Samples:
        self.calls.append(params)
        tokens_BP, valid_BP = left_pad(prompts, self.tok.pad_id)
        answers = [self.answer(b, p) for b, p in enumerate(prompts)]
        B, P, R = len(prompts), tokens_BP.shape[1], max(map(len, answers))
        tokens_BT = torch.cat([tokens_BP, torch.full((B, R), self.tok.pad_id)], dim=1)
        response_BT = torch.zeros(tokens_BT.shape, dtype=torch.bool)
        for b, ids in enumerate(answers):
            tokens_BT[b, P:P + len(ids)] = torch.tensor(ids)
            response_BT[b, P:P + len(ids)] = True
        valid_BT = torch.cat([valid_BP, response_BT[:, P:]], dim=1)
        return Samples(tokens_BT, valid_BT, response_BT, -1.0 * response_BT, None)


@register_sampler("fixed_tokens_stub")
def fixed_tokens(policy, tokenizer, cfg):
    return FixedTokens(tokenizer)


def test_a_backend_registered_here_runs_an_rl_iteration(tmp_path):
    from megatron_gspo.jobs.rl import Trainer

    cfg = load_config(None, [
        "model.preset=tiny", "task.name=addition", "task.kwargs.num_digits=1", "task.n_train=60",
        "task.n_eval=4", "rollout.prompts_per_batch=4", "rollout.group_size=2",
        "rollout.max_new_tokens=3", "train.num_minibatches=2", "train.steps=1",
        "train.eval_every=1", "train.save_every=0", "wandb.mode=disabled",
        "rollout.backend=fixed_tokens_stub", f"run_dir={tmp_path / 'run'}"])
    trainer = Trainer.from_config(cfg)
    sampler = trainer.rt.sampler
    before = [p.detach().clone() for p in trainer.policy.model.module.parameters()]
    trainer.train()
    assert isinstance(sampler, FixedTokens)
    # step 0: the eval, the test split greedy and sampled; the rollout; the last step: the same
    assert [p.greedy for p in sampler.calls] == [True, True, False, False, True, True, False]
    rows = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert [r.get("train/minibatch") for r in rows] == [None, 0, 1]
    assert rows[-1]["reward/accuracy"] == 0.5  # the even rows' sums
    assert rows[-1]["rollout/logprob_mismatch/mean"] > 0  # the stub's -1 is not the policy's
    after = list(trainer.policy.model.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
